"""The training job of bench/recovery_matrix.py: DDP (gloo, CPU) on a tiny
deterministic model, --step-time seconds a step (a sleep: simulated
accelerator compute, the CPU stays free), run until the bench says stop.

Checkpointing (--ckpt):
  none     no checkpoint: a restarted world starts again at step 0.
  ballast  ballast.Checkpointer: a flash save (shared memory) after every
           step, persisted to disk every --persist-every steps; load() on
           every start, which says where the state came from
           (ckpt.last_load_source: memory, replica or disk).
  torch    torch.save after every step by rank 0 (temp file + rename) into
           --ckpt-dir, torch.load on every start (source "disk"): what a
           script under torchrun or dlrover-run does without Ballast.

The script works with and without the `ballast` package importable: with it
(under `ballast run`/`launch`) it reports each step with ballast.step(), so
`--hang-timeout` can watch it.

Control from the bench, by files in --out (checked once a step):
  hang     this file names a global rank: that rank hangs (sleeps forever)
           at its next step, once per job (the marker hung-<rank> records it);
  stop     this file holds a step: every rank finishes that step, then the
           job ends cleanly (so agents unlink their shared memory).

Events (JSON lines, examples/train_events.py) go to <out>/rank<R>.jsonl:
"start" (pid, ppid, node, round, restart, world, step, source, load_s),
"step" (pid, step), "hang" and "done".
"""
import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_events import append_event as log  # noqa: E402

try:
    import ballast
except ImportError:  # torchrun / dlrover-run: no progress reports, no flash checkpoint
    ballast = None

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--ckpt", choices=("none", "ballast", "torch"), default="none")
p.add_argument("--ckpt-dir", default=None)
p.add_argument("--steps", type=int, default=100000, help="upper bound; the bench normally stops the job first")
p.add_argument("--step-time", type=float, default=0.05)
p.add_argument("--persist-every", type=int, default=10, help="--ckpt ballast: persist to disk every N steps")
p.add_argument("--pg-timeout", type=float, default=None,
               help="seconds a gloo collective waits before it fails (torch's default: 30 min)")
a = p.parse_args()
if a.ckpt != "none" and not a.ckpt_dir:
    p.error("--ckpt-dir is needed with --ckpt " + a.ckpt)
if a.ckpt == "ballast" and ballast is None:
    sys.exit("matrix_train.py: --ckpt ballast needs the ballast package (PYTHONPATH=build/python)")

rank = int(os.environ["RANK"])
os.makedirs(a.out, exist_ok=True)
t_begin = time.time()
if a.pg_timeout is None:
    dist.init_process_group("gloo")
else:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
world = dist.get_world_size()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

start, source = 0, "none"
t_load = time.time()
if a.ckpt == "ballast":
    ckpt = ballast.Checkpointer(a.ckpt_dir, keep=2)
    saved, state = ckpt.load()
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, source = saved, ckpt.last_load_source
elif a.ckpt == "torch":
    os.makedirs(a.ckpt_dir, exist_ok=True)
    path = os.path.join(a.ckpt_dir, "ckpt.pt")
    if os.path.exists(path):
        state = torch.load(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, source = state["step"], "disk"
load_s = time.time() - t_load
ddp = DDP(model)
log(a.out, rank, event="start", pid=os.getpid(), ppid=os.getppid(), world=world,
    local_rank=int(os.environ.get("LOCAL_RANK", 0)), group_rank=int(os.environ.get("GROUP_RANK", 0)),
    node=os.environ.get("BALLAST_NODE_ID", ""), round=int(os.environ.get("BALLAST_ROUND", "0")),
    restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), step=start, source=source,
    load_s=load_s, init_s=t_load - t_begin, ballast=ballast is not None)

hang_file, stop_file = os.path.join(a.out, "hang"), os.path.join(a.out, "stop")
hung_marker = os.path.join(a.out, f"hung-{rank}")
stop_at = None
step = start
for step in range(start, a.steps):
    if stop_at is None and os.path.exists(stop_file):
        with open(stop_file) as f:
            stop_at = int(f.read())
    if stop_at is not None and step >= stop_at:
        break
    if os.path.exists(hang_file) and not os.path.exists(hung_marker):
        with open(hang_file) as f:
            if int(f.read()) == rank:
                open(hung_marker, "w").close()
                log(a.out, rank, event="hang", pid=os.getpid(), step=step)
                while True:
                    time.sleep(3600)  # a stack dump of the hung worker shows this line
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(16, 32, generator=g)
    y = torch.randn(16, 8, generator=g)
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    done = step + 1  # steps completed; a restart resumes at the step saved here
    if a.ckpt == "ballast":
        ckpt.save(done, {"model": model.state_dict(), "opt": opt.state_dict()},
                  persist=done % a.persist_every == 0)
    elif a.ckpt == "torch":
        dist.barrier()  # every rank finished the step before rank 0 records it as durable
        if rank == 0:
            tmp = path + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": done}, tmp)
            os.replace(tmp, path)
    if ballast is not None:
        ballast.step(done)
    log(a.out, rank, event="step", pid=os.getpid(), step=done)
    time.sleep(a.step_time)
else:
    step = a.steps

dist.barrier()
log(a.out, rank, event="done", pid=os.getpid(), step=step)
dist.destroy_process_group()
