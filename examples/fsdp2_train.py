"""FSDP2 training with Ballast flash checkpoints (torch >= 2.4; CPU/gloo or GPUs/NCCL).

Every step is flash-saved (each rank saves only its own shards); every start
loads the newest step into the freshly sharded model and optimizer, whatever
the world size was when it was saved (the shards are cut and pasted onto
this world's mesh).

    ballast launch --python PY --nodes 1:2 --nproc-per-node 2 examples/fsdp2_train.py --ckpt /tmp/fsdp2-ckpt

(PY: an interpreter with torch >= 2.4 and ballast, e.g. the venv `make torch2` builds.)
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import init_device_mesh

import ballast

p = argparse.ArgumentParser()
p.add_argument("--ckpt", required=True)
p.add_argument("--steps", type=int, default=50)
p.add_argument("--persist-every", type=int, default=10)
args = p.parse_args()

gpu = torch.cuda.is_available()
dist.init_process_group("nccl" if gpu else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")
if gpu:
    torch.cuda.set_device(device)
mesh = init_device_mesh(device.type, (world,))

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

ckpt = ballast.Checkpointer(args.ckpt)
step, state = ckpt.load(into={"model": model.state_dict(), "optim": opt.state_dict()})
if state is not None:
    opt.load_state_dict(state["optim"])  # the model's DTensors were filled in place
    print(f"rank {rank}/{world}: resumed from step {step} ({ckpt.last_load_source})", flush=True)
step = step or 0

while step < args.steps:
    step += 1
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(16, 64, generator=g).to(device)
    y = torch.randint(0, 10, (16,), generator=g).to(device)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()},
              persist=step % args.persist_every == 0 or step == args.steps)
    ballast.step(step)

ckpt.wait()
if rank == 0:
    print(f"done: {step} steps on {world} ranks, loss {loss.item():.4f}", flush=True)
ckpt.close()
dist.destroy_process_group()
