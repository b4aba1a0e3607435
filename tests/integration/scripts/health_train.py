"""DDP training (gloo) that reports its loss with ballast.step(step, loss=),
for tests/python/test_health.py.

A small MLP on a synthetic regression dataset, sampled by
ballast.ElasticSampler; every step is flash-saved
(model, optimizer, sampler) and every third persisted (--persist-every); the DDP gradients are
bitwise the same after a restart (ddp_exact), so a job rolled back over a
bad step ends with exactly the weights of a job that never trained that
step's samples.

Faults, in the job's first attempt (TORCHELASTIC_RESTART_COUNT 0) only:
  --nan-step S --bad-rank R     rank R's batch of step S is NaN: a real NaN
                                loss, NaN gradients on every rank after the
                                allreduce, NaN weights saved at step S;
  --spike-step S --bad-rank R   rank R's targets of step S are scaled by
                                1000: a loss spike that wrecks the weights.

Rank 0 appends JSON lines to <out>/events.jsonl: {"ev": "start", round,
restart, step, source} and, at the end, {"ev": "done", step, sha256,
finite}.
"""
import argparse
import hashlib
import json
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import ballast
import ddp_exact  # beside this script

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=14)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--nan-step", type=int, default=-1)
p.add_argument("--spike-step", type=int, default=-1)
p.add_argument("--bad-rank", type=int, default=1)
p.add_argument("--step-time", type=float, default=0.02)
p.add_argument("--persist-every", type=int, default=3, help="persist every Nth step (0: never)")
p.add_argument("--pad-mb", type=int, default=0, help="MiB of extra state in each save (a costlier copy)")
p.add_argument("--log-weights", action="store_true", help="rank 0 logs the weights' digest after every step")
args = p.parse_args()

rank = int(os.environ["RANK"])
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)


def log(**ev):
    if rank != 0:
        return
    ev.update(round=int(os.environ.get("BALLAST_ROUND", "0")), restart=restart, t=time.time())
    with open(os.path.join(args.out, "events.jsonl"), "a") as f:
        f.write(json.dumps(ev) + "\n")


dist.init_process_group("gloo")
g = torch.Generator().manual_seed(0)
x = torch.randn(512, 16, generator=g)
y = torch.tanh(x @ torch.randn(16, 1, generator=g))
ds = TensorDataset(torch.arange(len(x)), x, y)
sampler = ballast.ElasticSampler(ds, shuffle=True, seed=7)
# In the main process: a forked loader worker of torch 2.15 deadlocked once in
# CI (blocked on a lock in the child); test_sampler covers a prefetching loader.
loader = DataLoader(ds, batch_size=args.batch, sampler=sampler)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
ddp = DDP(model)
ddp.register_comm_hook(None, ddp_exact.per_parameter_allreduce)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

ckpt = ballast.Checkpointer(os.path.join(args.out, "ckpt"), keep=3)
pad = torch.ones(args.pad_mb << 18)  # float32
step, state = ckpt.load()
if state is not None:
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sampler.load_state_dict(state["sampler"])
step = step or 0
log(ev="start", step=step, source=ckpt.last_load_source, sampler=sampler.state_dict(),
    skip=os.environ.get("BALLAST_SKIP_DATA", ""), package=ballast.__file__)


def weights():
    h = hashlib.sha256()
    finite = True
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
        finite = finite and bool(torch.isfinite(t).all())
    return h.hexdigest(), finite


# Every rank's start: the step and the weights it resumed from.
with open(os.path.join(args.out, "starts.jsonl"), "a") as f:
    f.write(json.dumps({"rank": rank, "round": int(os.environ.get("BALLAST_ROUND", "0")), "step": step,
                        "source": ckpt.last_load_source, "sha256": weights()[0]}) + "\n")

while step < args.steps:
    sampler.set_epoch(sampler.epoch)
    for idx, xb, yb in loader:
        if step >= args.steps:
            break
        step += 1
        if restart == 0 and rank == args.bad_rank:
            if step == args.nan_step:
                xb = xb * float("nan")
            elif step == args.spike_step:
                yb = yb * 1000.0
        loss = torch.nn.functional.mse_loss(ddp(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sampler.advance(len(idx))
        ckpt.save(step, {"model": model.state_dict(), "opt": opt.state_dict(), "sampler": sampler.state_dict(),
                         **({"pad": pad} if args.pad_mb else {})},
                  persist=args.persist_every > 0 and step % args.persist_every == 0)
        ballast.step(step, loss=loss, model=model)
        if args.log_weights:
            log(ev="weights", step=step, sha256=weights()[0])
        time.sleep(args.step_time)
    if sampler.epoch_done:
        sampler.set_epoch(sampler.epoch + 1)

ckpt.wait()
sha, finite = weights()
log(ev="done", step=step, sha256=sha, finite=finite, latest=ckpt.latest_step())
dist.barrier()
dist.destroy_process_group()
