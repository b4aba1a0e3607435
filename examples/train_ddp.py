"""Tiny DDP training job for Ballast's integration tests and demo.

An unchanged torchrun-style script: env:// init, gloo, a deterministic model.
It checkpoints to --out/ckpt.pt after every step (rank 0; temp file + rename)
and resumes from it, so a restarted world continues where it stopped.
Each rank appends JSON lines to --out/rank<R>.jsonl (train_events.py): a "start" event (pid,
world size, restart count, round, first step), a "step" event per step, a
"hang" event, and a "done" event, which the tests read.

When the `ballast` package is importable (it is under `ballast run`), the
script reports progress with ballast.step() and marks its checkpoint writes,
so `--hang-timeout` can watch it; without it the script runs as it is.
"""
import contextlib
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from train_events import append_event as log

try:
    import ballast
except ImportError:  # plain torchrun: no progress reports
    ballast = None



def hang_forever():
    while True:
        time.sleep(3600)  # a stack dump of a hung worker shows this line


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--out", required=True)
    p.add_argument("--fail-rank", type=int, default=-1, help="this rank exits 3 at --fail-step, every attempt")
    p.add_argument("--fail-step", type=int, default=2)
    p.add_argument("--hang-rank", type=int, default=-1,
                   help="this rank hangs at --hang-step, on the first attempt only")
    p.add_argument("--hang-step", type=int, default=3)
    p.add_argument("--pg-timeout", type=float, default=None,
                   help="seconds a collective waits before it fails (torch's default: 30 min)")
    args = p.parse_args()

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rnd = int(os.environ.get("BALLAST_ROUND", "0"))
    os.makedirs(args.out, exist_ok=True)
    if args.pg_timeout is None:
        dist.init_process_group("gloo")
    else:
        import datetime
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    ckpt = os.path.join(args.out, "ckpt.pt")
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    ddp = DDP(model)
    log(args.out, rank, event="start", pid=os.getpid(), world=world, restart=restart, round=rnd, step=start,
        local_rank=int(os.environ["LOCAL_RANK"]), group_rank=int(os.environ["GROUP_RANK"]),
        cell=ballast.progress.state()["cell"] if ballast else "none")

    for step in range(start, args.steps):
        if rank == args.fail_rank and step == args.fail_step:
            print(f"rank {rank}: injected failure at step {step}", file=sys.stderr, flush=True)
            sys.exit(3)
        if restart == 0 and rank == args.hang_rank and step == args.hang_step:
            log(args.out, rank, event="hang", step=step)
            hang_forever()
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        # Everyone finished the step before rank 0 records it as durable.
        dist.barrier()
        if rank == 0:
            with ballast.progress.checkpointing() if ballast else contextlib.nullcontext():
                tmp = ckpt + ".tmp"
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
                os.replace(tmp, ckpt)
        if ballast:
            ballast.step(step + 1)
        log(args.out, rank, event="step", step=step + 1, world=world, restart=restart, loss=float(loss))
        time.sleep(args.step_time)

    dist.barrier()
    log(args.out, rank, event="done", step=args.steps, world=world, restart=restart, round=rnd)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
