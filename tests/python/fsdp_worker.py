"""A worker of tests/python/test_fsdp2.py (run under torchrun or `ballast launch`,
torch 2.x, CPU/gloo): a tiny model sharded with FSDP2 (`fully_shard`; with
--hsdp on a 2-D mesh: replicate x shard), trained with AdamW, checkpointed
with ballast. With --sharded-tensor the state is what FSDP1's
SHARDED_STATE_DICT hands over, ShardedTensors split by rows as FSDP1 splits
them (FSDP1 itself needs an accelerator; the model is not trained then).

--mode save: train --steps steps, flash-save the model's and the optimizer's
    sharded state (each rank its own pieces) and persist it; rank 0 writes the
    full tensors to OUT/ref.pt (gathered after the save, for the comparison).
--mode load: a fresh model (other initial values) and an optimizer without any
    state: ckpt.load(into=...) fills the new world's DTensors, then
    optimizer.load_state_dict; every full tensor must equal OUT/ref.pt bitwise.
    Also checks plain load() (DTensors on the current mesh) and load(full=True).
--mode dcp-load: torch.distributed.checkpoint.load of --dcp (a `ballast ckpt
    export --format dcp` of the saved step) into a fresh model and optimizer.
--mode dcp-start: a job's start from the DCP checkpoint --dcp that save wrote
    (ckpt.load(from_dcp=...) with an empty Ballast checkpoint directory).
--mode train (under `ballast launch`): load on every start (any world size),
    train to --steps saving every step, a node lost at --kill-step (rank
    --kill-rank's agent and shared memory), the final full tensors in
    OUT/final-<rank>.pt.
Every rank appends JSON lines to OUT/events-<rank>.jsonl.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import ballast

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../integration/scripts"))
import node_loss  # noqa: E402 (the node-loss fault train_ckpt.py uses too)

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["save", "load", "train", "dcp-load", "dcp-start"], required=True)
p.add_argument("--dcp", help="save: also write a DCP checkpoint here; dcp-load, dcp-start: the one to read")
p.add_argument("--out", required=True)
p.add_argument("--ckpt", required=True)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--hsdp", action="store_true")
p.add_argument("--sharded-tensor", action="store_true")
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--step-time", type=float, default=0.0)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def event(kind, **kw):
    with open(os.path.join(args.out, f"events-{rank}.jsonl"), "a") as f:
        f.write(json.dumps(dict(kind=kind, rank=rank, world=world, time=time.time(), **kw)) + "\n")


def build(seed):
    torch.manual_seed(seed)
    # Uneven on purpose: 7 and 3 rows do not split evenly over 2, 3 or 4 ranks.
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    if args.sharded_tensor:
        return model, None
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh
    if args.hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mesh


def sharded(t):
    """A ShardedTensor of t's rows as FSDP1 splits them (torch.chunk: the last
    ranks may hold fewer rows, or none)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards
    chunk = -(-t.shape[0] // world)
    start = min(rank * chunk, t.shape[0])
    size = max(0, min(chunk, t.shape[0] - start))
    shards = []
    if size:
        md = ShardMetadata([start] + [0] * (t.dim() - 1), [size] + list(t.shape[1:]), f"rank:{rank}/cpu")
        shards.append(STShard(t[start:start + size].clone(), md))
    return init_from_local_shards(shards, list(t.shape))


def train_step(model, opt, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 5, generator=g)
    model(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def full(t):
    if hasattr(t, "full_tensor"):
        return t.full_tensor()
    if type(t).__name__ == "ShardedTensor":
        out = torch.zeros(t.size(), dtype=t.dtype) if rank == 0 else None
        t.gather(dst=0, out=out)
        return out
    return t


def full_state(model, opt):
    """{name: full tensor} of the model's and optimizer's state (a collective)."""
    out = {}
    for k, v in model.state_dict().items():
        out[f"model/{k}"] = full(v)
    for i, s in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(s.items()):
            out[f"optim/{i}/{k}"] = full(v)
    return out


def mismatches(got):
    """On rank 0: the keys whose full tensor differs from OUT/ref.pt (dtype,
    shape or any bit), or that only one side has; elsewhere []."""
    if rank != 0:
        return []
    ref = torch.load(os.path.join(args.out, "ref.pt"))
    return [k for k in sorted(set(ref) | set(got)) if k not in ref or k not in got
            or ref[k].dtype != got[k].dtype or not torch.equal(ref[k], got[k])]


ckpt = ballast.Checkpointer(args.ckpt)
model, mesh = build(seed=0 if args.mode != "load" else 99)
opt = torch.optim.AdamW(model.parameters(), lr=0.05)

if args.sharded_tensor:
    # FSDP1's sharded state dict: no optimizer, nothing trained.
    if args.mode == "save":
        ref = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
        state = {"model": {k: sharded(v) for k, v in model.state_dict().items()}}
        ckpt.save(1, state, persist=True)
        ckpt.wait()
        if rank == 0:
            torch.save(ref, os.path.join(args.out, "ref.pt"))
        event("saved", step=1)
    else:
        targets = {k: sharded(torch.zeros_like(v)) for k, v in model.state_dict().items()}
        step, state = ckpt.load(into={"model": targets})
        same = all(state["model"][k] is targets[k] for k in targets)
        bad = mismatches({f"model/{k}": full(v) for k, v in state["model"].items()})
        event("loaded", step=step, source=ckpt.last_load_source, ok=not bad and same, bad=bad)

elif args.mode == "save":
    for step in range(1, args.steps + 1):
        train_step(model, opt, step)
    ckpt.save(args.steps, {"model": model.state_dict(), "optim": opt.state_dict(), "step": args.steps},
              persist=True)
    ckpt.wait()
    if args.dcp:
        from torch.distributed.checkpoint import save as dcp_save
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(model, opt)
        dcp_save({"model": msd, "optim": osd, "step": args.steps}, checkpoint_id=args.dcp)
    ref = full_state(model, opt)
    if rank == 0:
        torch.save(ref, os.path.join(args.out, "ref.pt"))
    event("saved", step=args.steps)

elif args.mode == "load":
    # The optimizer has no state yet (AdamW before its first step): the load
    # still restores it, as DTensors on this world's mesh.
    assert not opt.state_dict()["state"]
    step, state = ckpt.load(into={"model": model.state_dict(), "optim": opt.state_dict()})
    assert step == args.steps, (step, args.steps)
    opt.load_state_dict(state["optim"])
    bad = mismatches(full_state(model, opt))
    # Plain load(): DTensors with the saved placements on the current mesh
    # (given for HSDP's 2-D mesh; else a 1-D mesh over the world, FSDP's).
    _, plain = ckpt.load(mesh=mesh if args.hsdp else None)
    w = plain["model"]["0.weight"]
    detail = {"plain_type": type(w).__name__,
              "plain_local_equal": bool(torch.equal(w.to_local(), model.state_dict()["0.weight"].to_local())),
              "optim_type": type(plain["optim"]["state"][0]["exp_avg"]).__name__}
    _, whole = ckpt.load(full=True)
    detail["full_equal"] = bool(torch.equal(whole["model"]["0.weight"],
                                            model.state_dict()["0.weight"].full_tensor()))
    train_step(model, opt, args.steps + 1)  # the restored optimizer steps on
    event("loaded", step=step, source=ckpt.last_load_source, ok=not bad, bad=bad, **detail)

elif args.mode in ("dcp-load", "dcp-start"):
    from torch.distributed.checkpoint.state_dict import _init_optim_state, get_state_dict, set_state_dict
    if args.mode == "dcp-load":
        from torch.distributed.checkpoint import load as dcp_load
        _init_optim_state(opt)  # DCP loads into existing tensors only
        target = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}
        dcp_load(target, checkpoint_id=args.dcp)
        opt.load_state_dict(target["optim"])
        step, source = target["step"], "dcp"
    else:
        msd, osd = get_state_dict(model, opt)
        step, state = ckpt.load(into={"model": msd, "optim": osd, "step": 0}, from_dcp=args.dcp)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        source = ckpt.last_load_source
    bad = mismatches(full_state(model, opt))
    train_step(model, opt, args.steps + 1)
    event("loaded", step=step, source=source, ok=not bad, bad=bad)

else:  # train, under ballast launch
    step, state = ckpt.load(into={"model": model.state_dict(), "optim": opt.state_dict()})
    start, ok = 0, None
    if state is not None:
        opt.load_state_dict(state["optim"])
        start = step
        # What the world before the loss held at that step, bitwise.
        got = full_state(model, opt)
        ref_path = os.path.join(args.out, f"ref-{step}.pt")
        if rank == 0 and os.path.exists(ref_path):
            ref = torch.load(ref_path)
            ok = sorted(ref) == sorted(got) and all(torch.equal(ref[k], got[k]) for k in ref)
    event("load", step=step, source=ckpt.last_load_source, ok=ok)
    for step in range(start + 1, args.steps + 1):
        train_step(model, opt, step)
        ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step})
        ballast.step(step)
        if step == args.kill_step and not node_loss.lost_already(args.out):
            ref = full_state(model, opt)
            if rank == 0:
                torch.save(ref, os.path.join(args.out, f"ref-{step}.pt"))
            node_loss.lose_node(args.out, rank, args.kill_rank, step, event)
        time.sleep(args.step_time)
    ckpt.wait()
    final = full_state(model, opt)
    if rank == 0:
        torch.save(final, os.path.join(args.out, "final.pt"))
    event("done", step=args.steps)

ckpt.close()
dist.destroy_process_group()
