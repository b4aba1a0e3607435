"""The training job of bench/goodput_bench.py: DDP (gloo) with a small model
and STATE_MB of per-rank state (as sharded optimizer state would be), a step
of --step-time seconds of simulated accelerator compute (a sleep: the CPU
stays free, as it is while a GPU computes), checkpointed one of two ways:

  --ckpt ballast  ballast.Checkpointer: an overlapped flash save every step
                  (save(blocking=False), guard(optimizer)), persisted to disk
                  every --persist-every steps; load(into=...) on restart.
  --ckpt torch    torch.save of each rank's state every --torch-every steps
                  (step-<N>/rank<R>.pt, temp + rename, `latest` written by
                  rank 0 after a barrier), torch.load on restart: what a
                  script run under torch's elastic agent does.
  --ckpt none     no checkpoint (the floor: what the job costs without one).

Events go to <out>/rank<R>.jsonl (examples/train_events.py).
"""
import argparse
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_events import append_event as log  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--ckpt-dir", required=True)
p.add_argument("--ckpt", choices=("ballast", "torch", "none"), required=True)
p.add_argument("--steps", type=int, default=500)
p.add_argument("--step-time", type=float, default=0.36)
p.add_argument("--state-mb", type=int, default=64)
p.add_argument("--persist-every", type=int, default=10)
p.add_argument("--torch-every", type=int, default=10)
p.add_argument("--cpu-work", type=int, default=0,
               help="the step's compute is this many 256x256 matmuls on the CPU instead of --step-time's sleep (a "
                    "fixed amount of work: the step time then shows what competes for the cores)")
a = p.parse_args()

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
world = dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
ddp = DDP(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
big = torch.zeros(a.state_mb << 18, dtype=torch.float32)  # STATE_MB MiB of this rank's state
CHUNK = 1 << 16


def state():
    return {"model": model.state_dict(), "opt": opt.state_dict(), "big": big}


start, source = 0, None
t_load = time.time()
if a.ckpt == "ballast":
    import ballast
    ckpt = ballast.Checkpointer(a.ckpt_dir, keep=2)
    opt = ckpt.guard(opt)
    step, st = ckpt.load(into={"model": model.state_dict(), "big": big})
    if st is not None:
        opt.load_state_dict(st["opt"])
        start = step + 1
    source = ckpt.last_load_source
elif a.ckpt == "torch":
    latest = os.path.join(a.ckpt_dir, "latest")
    source = None
    if os.path.exists(latest):
        with open(latest) as f:
            step = int(f.read())
        st = torch.load(os.path.join(a.ckpt_dir, f"step-{step}", f"rank{rank}.pt"))
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        big.copy_(st["big"])
        start, source = step + 1, "disk"
log(a.out, rank, event="start", pid=os.getpid(), step=start, source=source, load_s=time.time() - t_load)

stall = 0.0  # seconds checkpoint saves blocked training (what goodput's checkpoint part counts)
for step in range(start, a.steps):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, 64, generator=g)
    loss = ddp(x).square().mean()
    opt.zero_grad()
    loss.backward()
    if a.cpu_work:
        m = torch.full((256, 256), 1e-3)
        for _ in range(a.cpu_work):
            m = m @ m  # the forward and backward, on the CPU
    else:
        time.sleep(a.step_time)  # the accelerator's forward and backward
    opt.step()  # (guarded: waits for the previous overlapped save first)
    lo = (step * CHUNK) % big.numel()
    big[lo:lo + CHUNK] += 1.0  # the per-rank state changes every step
    if a.ckpt == "ballast":
        ckpt.save(step, state(), persist=(step + 1) % a.persist_every == 0, blocking=False)
    elif a.ckpt == "torch" and (step + 1) % a.torch_every == 0:
        t_save = time.time()
        d = os.path.join(a.ckpt_dir, f"step-{step}")
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f"rank{rank}.pt.tmp")
        torch.save(state(), tmp)
        os.replace(tmp, os.path.join(d, f"rank{rank}.pt"))
        dist.barrier()
        if rank == 0:
            with open(os.path.join(a.ckpt_dir, "latest.tmp"), "w") as f:
                f.write(str(step))
            os.replace(os.path.join(a.ckpt_dir, "latest.tmp"), os.path.join(a.ckpt_dir, "latest"))
            old = os.path.join(a.ckpt_dir, f"step-{step - 2 * a.torch_every}")
            shutil.rmtree(old, ignore_errors=True)
        stall += time.time() - t_save
    if a.ckpt == "ballast":
        ballast.step(step + 1)  # progress for the agent (hang detection) and the master's goodput accountant
        stall = ballast.progress.state()["ckpt_stall_ns"] / 1e9  # this process's saves and waits for them
    log(a.out, rank, event="step", step=step + 1, stall=stall)

if a.ckpt == "ballast":
    ckpt.wait_saved()
dist.barrier()
log(a.out, rank, event="done", step=a.steps)
dist.destroy_process_group()
