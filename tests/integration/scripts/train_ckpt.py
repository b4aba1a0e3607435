"""Deterministic DDP (gloo) training with ballast flash checkpoints, for
tests/integration/ckpt_integration_test.cc.

Every step is saved to shared memory and persisted (persist=True), except
--kill-step, which stays in memory only: at that step, in the first attempt,
every rank saves, meets the others at a barrier, and then --kill-rank SIGKILLs
itself. The agents' breakpoint save must then persist the in-memory step, and
the restarted workers must restore it from memory. Data depends only on
(step, rank) and gradients are reduced parameter by parameter (see
per_parameter_allreduce), so a run with the failure ends with the same
weights, bit for bit, as one without.

Events (JSON lines) go to <out>/rank<RANK>.jsonl; the final model state to
<out>/final-rank<RANK>.pt.
"""
import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ballast
import ddp_exact  # beside this script
import node_loss

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--ckpt", required=True)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--kill-rank", type=int, default=1)
p.add_argument("--kill-node-step", type=int, default=-1,
               help="at this step (first attempt) --kill-rank's whole node is lost: its agent is "
                    "SIGKILLed and its shared memory removed, after the step was saved everywhere")
p.add_argument("--step-time", type=float, default=0.02)
p.add_argument("--trigger", default=None,
               help="the --kill-step / --kill-node-step fault comes at the first step after this file exists "
                    "(rank 0 looks; every rank learns it through an allreduce) instead of at a fixed step; "
                    "a first attempt that reaches the middle step before the file exists waits there for it, "
                    "so the fault always falls mid-run however slowly the test's precondition comes")
p.add_argument("--no-persist", action="store_true", help="keep every step in memory only (nothing on disk)")
p.add_argument("--kill-rank-node", action="store_true",
               help="with --trigger: the fault is the loss of --kill-rank's node, not of the rank alone")
p.add_argument("--shard-momentum", action="store_true",
               help="save the momentum as each rank's slice of one flat vector (ballast.Shard, as a "
                    "ZeRO optimizer would) and load this world's slices (resharded when it changed)")
args = p.parse_args()

rank = int(os.environ["RANK"])
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)


def log(event, **kw):
    kw.update(event=event, rank=rank, restart=restart, pid=os.getpid(), t=time.time())
    with open(os.path.join(args.out, f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(kw) + "\n")


dist.init_process_group("gloo")
world = dist.get_world_size()
log("start", world=world, shm=os.environ.get("BALLAST_CKPT_SHM"))

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(512, 512, bias=False), torch.nn.Tanh(), torch.nn.Linear(512, 512, bias=False))
ddp = DDP(model)

ddp.register_comm_hook(None, ddp_exact.per_parameter_allreduce)  # bitwise across restarts
params = list(model.parameters())
opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)

def weights_sha256():
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def momentum_sha256():
    h = hashlib.sha256()
    for prm in params:
        buf = opt.state[prm].get("momentum_buffer")
        if buf is not None:
            h.update(buf.contiguous().numpy().tobytes())
    return h.hexdigest()


FLAT = sum(prm.numel() for prm in params)
base, extra = divmod(FLAT, world)
sizes = [base + (1 if r < extra else 0) for r in range(world)]
first = sum(sizes[:rank])  # this rank's slice of the flat momentum: [first, first + sizes[rank])


def momentum_state():
    if not args.shard_momentum:
        return {str(i): opt.state[prm]["momentum_buffer"] for i, prm in enumerate(params)}
    flat = torch.cat([opt.state[prm]["momentum_buffer"].reshape(-1) for prm in params])
    return ballast.Shard(flat[first:first + sizes[rank]].clone(), (FLAT,), (first,))


def restore_momentum(saved):
    if not args.shard_momentum:
        for i, prm in enumerate(params):
            opt.state[prm]["momentum_buffer"] = saved[str(i)].clone()
        return
    # Every rank loaded its slice: gather the whole vector (padded to one size).
    mine = torch.zeros(max(sizes))
    mine[:sizes[rank]] = saved
    parts = [torch.empty(max(sizes)) for _ in range(world)]
    dist.all_gather(parts, mine)
    flat = torch.cat([part[:n] for part, n in zip(parts, sizes)])
    offset = 0
    for prm in params:
        opt.state[prm]["momentum_buffer"] = flat[offset:offset + prm.numel()].reshape(prm.shape).clone()
        offset += prm.numel()


ckpt = ballast.Checkpointer(args.ckpt, keep=3)
if args.shard_momentum:
    step, state = ckpt.load(shards={"momentum": ((FLAT,), (first,), (sizes[rank],))})
else:
    step, state = ckpt.load()
log("load", step=step, source=ckpt.last_load_source)
start = 0
if state is not None:
    model.load_state_dict(state["model"])
    restore_momentum(state["momentum"])
    start = step + 1
    log("restored", step=step, sha256=weights_sha256(), momentum=momentum_sha256())



def trigger_state():
    # 1: the trigger file exists; 2: it fired before (in an earlier attempt or
    # round: a node loss starts the next round with restart 0); 0: neither.
    # Rank 0 looks, every rank learns it through an allreduce.
    state = 0
    if rank == 0:
        state = 1 if os.path.exists(args.trigger) else 2 if os.path.exists(args.trigger + ".fired") else 0
    flag = torch.tensor([state])
    dist.all_reduce(flag)
    return int(flag.item())


def triggered(hold):
    # hold: wait here (every rank polls together) until the trigger comes,
    # unless it fired before.
    while True:
        state = trigger_state()
        if state != 0 or not hold:
            return state == 1
        time.sleep(args.step_time)


for step in range(start, args.steps):
    armed = args.trigger and restart == 0 and args.kill_step < 0 and args.kill_node_step < 0
    if armed and triggered(hold=step == args.steps // 2):
        if rank == 0:
            open(args.trigger + ".fired", "w").close()
            os.unlink(args.trigger)  # once: a replacement's workers start with restart 0 too
        if args.kill_rank_node:
            args.kill_node_step = step
        else:
            args.kill_step = step
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 512, generator=g)
    y = torch.randn(16, 512, generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "momentum": momentum_state(),
        "step": step,
    }
    kill_now = step == args.kill_step and restart == 0
    ckpt.save(step, state, persist=not kill_now and not args.no_persist)
    ballast.step(step)  # progress reports (the agent's recovery timeline counts to the first step)
    log("step", step=step, loss=float(loss), sha256=weights_sha256(), momentum=momentum_sha256())
    if step == args.kill_node_step and restart == 0 and not node_loss.lost_already(args.out):
        node_loss.lose_node(args.out, rank, args.kill_rank, step, log)
    if kill_now:
        # Every rank holds this step in memory (and only there) before the kill.
        dist.barrier()
        if rank == args.kill_rank:
            log("kill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(args.step_time)

ckpt.wait()
torch.save(model.state_dict(), os.path.join(args.out, f"final-rank{rank}.pt"))
log("done", step=args.steps - 1, world=world, sha256=weights_sha256(), latest=ckpt.latest_step())
dist.barrier()
dist.destroy_process_group()
