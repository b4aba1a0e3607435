#!/usr/bin/python3
"""Checkpoint stall: how much a flash checkpoint every step slows training.

A training loop (an MLP with Adam, --state-mb of parameters + optimizer state,
--step-ms of compute a step) runs --steps steps three ways: without
checkpoints, with Checkpointer.save() every step (blocking), and with
save(blocking=False) every step (the copy overlaps the next forward and
backward; ckpt.guard(opt) waits for it before opt.step()). Prints the mean
step time of each and the stall (extra time a step) as a share of the step.

Not a test. On a machine where training runs on GPUs the copy uses otherwise
idle CPU cores and memory bandwidth; here training is CPU work too, so the
copy threads compete with it for the same cores.

Run:  PYTHONPATH=build/python /usr/bin/python3 bench/ckpt_stall_bench.py [--state-mb 64] [--step-ms 360]
"""
import argparse
import statistics
import tempfile
import time

import torch

import ballast


def build(state_mb):
    # Adam keeps two moments per parameter: parameters are a third of the state.
    n = int(state_mb * (1 << 20) / 4 / 3)
    width = 1024
    layers = max(1, n // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt


def run(mode, steps, args, model, opt, ckpt, step0):
    x = torch.randn(64, 1024)
    burn = torch.randn(512, 512)
    times = []
    for step in range(step0, step0 + steps):
        t0 = time.perf_counter()
        out = model(x)
        out.sum().backward()
        # Fill the step up to --step-ms of compute.
        while (time.perf_counter() - t0) * 1e3 < args.step_ms:
            burn = (burn @ burn).tanh_()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mode != "none":
            state = {"model": model.state_dict(), "opt": opt.state_dict()}
            ckpt.save(step, state, blocking=mode == "blocking")
        times.append(time.perf_counter() - t0)
    ckpt.wait_saved()
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-mb", type=float, default=64)
    p.add_argument("--step-ms", type=float, default=360)
    p.add_argument("--steps", type=int, default=8, help="steps per mode and round")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, opt = build(args.state_mb)
    ckpt = ballast.Checkpointer(tempfile.mkdtemp(prefix="ballast-stall-"))
    opt_guarded = ckpt.guard(opt)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    # Warm up: Adam state exists, both slots are sized.
    run("blocking", 4, args, model, opt_guarded, ckpt, 0)
    times = {"none": [], "blocking": [], "async": []}
    step = 10
    for _ in range(args.rounds):  # interleaved, so drifts of the machine hit every mode alike
        for mode in times:
            times[mode] += run(mode, args.steps, args, model, opt_guarded, ckpt, step)
            step += args.steps
    base = statistics.median(times["none"])
    print(f"state {state_bytes * 3 / (1 << 20):.0f} MiB (params + Adam moments), step {args.step_ms:.0f} ms of "
          f"compute; medians of {args.rounds} x {args.steps} steps")
    print(f"no checkpoint              {base * 1e3:8.1f} ms a step")
    for mode in ("blocking", "async"):
        t = statistics.median(times[mode])
        print(f"save every step ({mode:8s}) {t * 1e3:8.1f} ms a step  -> stall {(t - base) * 1e3:6.1f} ms "
              f"({(t - base) / base * 100:5.1f}% of the step)")
    ckpt.close()


if __name__ == "__main__":
    main()
