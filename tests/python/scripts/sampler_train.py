"""DDP training over ballast.ElasticSampler, for test_sampler_elastic.py.

A torchrun-style script (env:// init, gloo): a linear model trained with a
prefetching DataLoader over a synthetic dataset whose first tensor is the
sample index. After every step it advances the sampler and saves model +
sampler state with ballast.Checkpointer (persist=True, so a replaced node's
agent, which has no memory of the old one, finds it on disk; --persist-every N
asks for disk every N steps, 0 never); it resumes from the checkpoint.

Each rank appends JSON lines to <out>/rank<R>.jsonl:
  {"ev": "start", round, rank, world, step, origin, sampler, source, own}: what
      it resumed from (origin: the round that saved that checkpoint, or null;
      source: rank 0's "memory" or "disk"; own: this rank's load, "missing"
      when the saving world had no such rank);
  {"ev": "train", round, rank, world, step, epoch, idx}: written before the
      step's forward pass; step is the number the step's checkpoint gets;
  {"ev": "done", round, rank, world, step}.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import ballast


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--size", type=int, default=242)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--step-time", type=float, default=0.05)
    # 0: never ask for disk (memory and replicas only; what reaches disk is the
    # agents' breakpoint save when they stop).
    p.add_argument("--persist-every", type=int, default=1)
    p.add_argument("--overlap", action="store_true",
                   help="save(blocking=False) with a guarded optimizer: each copy overlaps the next step")
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rnd = int(os.environ.get("BALLAST_ROUND", "0"))
    log_path = os.path.join(args.out, f"rank{rank}.jsonl")

    def log(**ev):
        ev.update(round=rnd, rank=rank, world=world, t=time.time())
        with open(log_path, "a") as f:  # one write: survives a SIGKILL right after
            f.write(json.dumps(ev) + "\n")

    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.size, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(args.size, 1, generator=g)
    ds = TensorDataset(torch.arange(args.size), x, y)
    sampler = ballast.ElasticSampler(ds, shuffle=True, seed=1234)
    # A worker process that draws indices well ahead of training.
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=1, prefetch_factor=4)

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # no momentum: no optimizer state
    ckpt = ballast.Checkpointer(os.path.join(args.out, "ckpt"), keep=3)
    if args.overlap:
        opt = ckpt.guard(opt)
    try:
        step, state = ckpt.load()
        own = ckpt.last_load_source
    except FileNotFoundError:  # a rank the world that saved the step did not have
        step, state, own = None, None, "missing"
    if rank == 0 and state is not None:
        model.load_state_dict(state["model"])
    # Replicated state: rank 0's copy is the truth. DDP broadcasts rank 0's
    # model; the sampler state is global, so rank 0's serves every rank.
    box = [None if state is None else
           {"step": step, "sampler": state["sampler"], "origin": state["origin"],
            "source": ckpt.last_load_source}]
    dist.broadcast_object_list(box, src=0)
    resumed = box[0]
    step = 0
    if resumed is not None:
        sampler.load_state_dict(resumed["sampler"])
        step = resumed["step"]
    log(ev="start", step=step, origin=None if resumed is None else resumed["origin"],
        sampler=sampler.state_dict(), source=None if resumed is None else resumed["source"], own=own)
    ddp = DDP(model)

    for epoch in range(sampler.epoch, args.epochs):
        sampler.set_epoch(epoch)  # the resumed epoch keeps its position
        for idx, xb, yb in loader:
            log(ev="train", step=step + 1, epoch=epoch, idx=idx.tolist())
            loss = torch.nn.functional.mse_loss(ddp(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            sampler.advance(len(idx))
            ckpt.save(step, {"model": model.state_dict(), "sampler": sampler.state_dict(),
                             "origin": rnd},
                      persist=args.persist_every > 0 and step % args.persist_every == 0, blocking=not args.overlap)
            ballast.step(step)
            time.sleep(args.step_time)
    ckpt.wait()
    dist.barrier()
    log(ev="done", step=step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
