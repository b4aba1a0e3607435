"""Tiny DDP job that hangs once, for the hang-detection integration test.

Like examples/train_ddp.py (gloo, deterministic model, rank 0 checkpoints to
--out/ckpt.pt after every step and every attempt resumes from it), but it
reports progress with ballast.step() and, on the first attempt only
(TORCHELASTIC_RESTART_COUNT == 0), rank --hang-rank sleeps forever at step
--hang-step. Each rank appends JSON lines to --out/rank<R>.jsonl: "start",
"step" (after ballast.step), "hang" (just before hanging) and "done".
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ballast


def log(out, rank, **event):
    event["t"] = time.time()
    with open(os.path.join(out, f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(event) + "\n")


def hang_forever():
    while True:
        time.sleep(3600)  # the stack dump must show this line


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--out", required=True)
    p.add_argument("--hang-rank", type=int, default=1)
    p.add_argument("--hang-step", type=int, default=3)
    args = p.parse_args()

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    os.makedirs(args.out, exist_ok=True)
    dist.init_process_group("gloo")

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
    log(args.out, rank, event="start", pid=os.getpid(), world=world, restart=restart, step=start,
        cell=ballast.progress.state()["cell"])

    for step in range(start, args.steps):
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
        dist.barrier()
        if rank == 0:
            with ballast.progress.checkpointing():
                tmp = ckpt + ".tmp"
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
                os.replace(tmp, ckpt)
        ballast.step(step + 1)
        log(args.out, rank, event="step", step=step + 1, world=world, restart=restart)
        time.sleep(args.step_time)

    dist.barrier()
    log(args.out, rank, event="done", step=args.steps, world=world, restart=restart)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
