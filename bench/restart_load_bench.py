"""The load after a restart: a worker saves --gb GB to its flash checkpoint
and is SIGKILLed; the agent restarts it and the new process loads the state
from memory, the way a training script does on every start.

The restarted process times, in order:
  ckpt.load()            the README's first example: tensors that view the
                         slot (copy-on-write), checksum verified
  ckpt.load(into=...)    into tensors that exist already (a model's)
  torch.load             of the same state saved with torch.save (page cache
                         hot: read once before the kill)

Run (one line of JSON with --json):

  build/bin/ballast run --standalone --nproc-per-node 1 --max-restarts 1 --python /usr/bin/python3 \\
      bench/restart_load_bench.py --gb 1 --dir /tmp/restart-bench
"""

import argparse
import json
import os
import signal
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "build", "python"))
import ballast  # noqa: E402
from _benchutil import make_state  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--gb", type=float, default=1.0)
p.add_argument("--dir", required=True)
p.add_argument("--json", action="store_true")
args = p.parse_args()
os.makedirs(args.dir, exist_ok=True)
pt = os.path.join(args.dir, "state.pt")


ckpt = ballast.Checkpointer(os.path.join(args.dir, "ckpt"))
if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    state = make_state(int(args.gb * 1e9))
    ckpt.save(1, state)
    torch.save(state, pt)
    torch.load(pt)  # the page cache holds the file now
    os.kill(os.getpid(), signal.SIGKILL)

t = time.perf_counter()
step, state = ckpt.load()
default_s = time.perf_counter() - t
assert step == 1 and ckpt.last_load_source == "memory", (step, ckpt.last_load_source)
targets = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
for v in targets["model"].values():
    v.fill_(0)  # touched: a model's tensors exist already
del state
t = time.perf_counter()
ckpt.load(into=targets)
into_s = time.perf_counter() - t
t = time.perf_counter()
torch.load(pt)
torch_s = time.perf_counter() - t
row = {"gb": args.gb, "load_default_s": round(default_s, 4), "load_into_s": round(into_s, 4),
       "torch_load_s": round(torch_s, 4), "default_speedup": round(torch_s / default_s, 2),
       "into_speedup": round(torch_s / into_s, 2)}
print(json.dumps(row) if args.json else
      f"{args.gb} GB after a restart: load() {default_s:.3f} s, load(into=) {into_s:.3f} s, torch.load "
      f"{torch_s:.3f} s: load() {torch_s / default_s:.1f}x, load(into=) {torch_s / into_s:.1f}x faster", flush=True)
ckpt.close()
