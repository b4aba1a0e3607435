#!/usr/bin/python3
"""What checkpoint copies cost a CPU-bound step, by --ckpt-copy-nice.

bench/goodput_train.py on 2 nodes x 1 worker under `ballast launch` (one
machine, so the replica copies cross loopback), each step a fixed amount of
CPU work (--cpu-work matmuls: the step time shows what competes for the
cores), --state-mb of state per rank flash-saved every step, persisted every
--persist-every steps and copied to the peer node's memory. Runs, one after
the other: no checkpoint (the floor), then the checkpointed job at each
--nices value (0: the persist and replica threads at training's priority).
For each: the median step time (steps after the first 5, rank 0), its
overhead over the floor, and how many steps were persisted (`latest` at the
end trails the last step when the persists were slowed).

Not a test: the figures go into notes and docs. With as many workers as
cores the copies compete with training; on a GPU machine they use idle cores.

Run:  /usr/bin/python3 bench/ckpt_pacing_bench.py [--steps 60] [--cpu-work 40] [--state-mb 64] [--nices 0,10,19]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(args, tmp, name, ckpt, nice, persist_every, replicas):
    out = os.path.join(tmp, name)
    os.makedirs(out)
    argv = [args.ballast, "launch", "--python", "/usr/bin/python3", "--nodes", "2", "--nproc-per-node", "1",
            "--ckpt-copy-nice", str(nice), "--ckpt-replicas", str(replicas), os.path.join(HERE, "goodput_train.py"),
            "--out", out, "--ckpt-dir", os.path.join(out, "ckpt"), "--ckpt", ckpt, "--steps", str(args.steps),
            "--state-mb", str(args.state_mb), "--persist-every", str(persist_every), "--cpu-work", str(args.cpu_work)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(ROOT, "build", "python"))
    p = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    if p.returncode != 0:
        sys.exit(f"{name}: exit {p.returncode}\n{p.stdout[-4000:]}")
    with open(os.path.join(out, "rank0.jsonl")) as f:
        ev = [json.loads(line) for line in f if line.strip()]
    t = [e["t"] for e in ev if e["event"] == "step"]
    dts = [b - a for a, b in zip(t, t[1:])][5:]
    latest = None
    if ckpt == "ballast" and os.path.exists(os.path.join(out, "ckpt", "latest")):
        with open(os.path.join(out, "ckpt", "latest")) as f:
            latest = f.read().strip()
    return statistics.median(dts), latest


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ballast", default=os.path.join(ROOT, "build", "bin", "ballast"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--cpu-work", type=int, default=40)
    p.add_argument("--state-mb", type=int, default=64)
    p.add_argument("--persist-every", type=int, default=1)
    p.add_argument("--nices", default="0,10,19")
    p.add_argument("--parts", action="store_true",
                   help="also the save alone (no persist, no replica) and the save with replicas, at the first nice")
    p.add_argument("--trials", type=int, default=1, help="runs of each mode, interleaved; medians reported")
    args = p.parse_args()
    nices = [int(n) for n in args.nices.split(",")]
    modes = [("no checkpoint", "none", 0, args.persist_every, 1)]
    if args.parts:
        modes += [("save only", "ballast", nices[0], 10 ** 9, 0), ("save + replica", "ballast", nices[0], 10 ** 9, 1)]
    modes += [(f"all, nice {n}", "ballast", n, args.persist_every, 1) for n in nices]
    got = {m[0]: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="ballast-pacing-") as tmp:
        for trial in range(args.trials):
            for i, (name, ckpt, nice, persist_every, replicas) in enumerate(modes):
                step, latest = run(args, tmp, f"{trial}-{i}", ckpt, nice, persist_every, replicas)
                got[name].append((step, latest))
                print(f"trial {trial + 1} {name}: median step {step * 1000:.1f} ms, latest {latest}", flush=True)
    floor = statistics.median(s for s, _ in got["no checkpoint"])
    print(f"\n2 nodes x 1 worker, {args.cpu_work} matmuls a step, {args.state_mb} MB a rank saved every step, "
          f"persisted every {args.persist_every}, replicated to the peer; medians of {args.trials}")
    print(f"{'mode':<16} {'step ms':>8} {'overhead':>9}  latest at the end")
    for name, *_ in modes:
        step = statistics.median(s for s, _ in got[name])
        latest = ",".join(str(l) for _, l in got[name] if l is not None) or "-"
        print(f"{name:<16} {step * 1000:8.1f} {100 * (step / floor - 1):8.1f}%  {latest}")


if __name__ == "__main__":
    main()
