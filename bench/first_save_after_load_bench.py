#!/usr/bin/python3
"""The first save after a load from disk, with and without the background sizing a disk load now starts.

A Checkpointer (no agent) saves GB of state and persists it. Then, 3 times: a
new Checkpointer (a new process's fresh shared memory) saves at once, which
sizes and faults its memory during the save (what followed a load from disk
before); and a new Checkpointer loads the step from disk, which sizes the
memory for the next save in the background, waits for that, and saves. Times
are the blocking time of the save call.

Run:  PYTHONPATH=build/python OMP_NUM_THREADS=1 /usr/bin/python3 bench/first_save_after_load_bench.py [GB]
"""
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import ballast

gb = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
state = {"w": torch.randn(int(gb * (1 << 28)))}
base = tempfile.mkdtemp(prefix="rsv-")
d = os.path.join(base, "c")
c = ballast.Checkpointer(d, rank=0, world_size=1); c.save(1, state, persist=True); c.wait(); c.close()
old, new, wait_s = [], [], []
for trial in range(3):
    # Before: a new process's first save, nothing sized (what followed a load from disk).
    c = ballast.Checkpointer(d, rank=0, world_size=1)
    t = time.perf_counter(); c.save(2, state); old.append(time.perf_counter() - t); c.close()
    # After: load() from disk sizes the memory in the background; the next step comes, then the save.
    c = ballast.Checkpointer(d, rank=0, world_size=1)
    step, got = c.load(); assert c.last_load_source == "disk", c.last_load_source
    t0 = time.perf_counter()
    while c._store.growing(): time.sleep(0.005)
    wait_s.append(time.perf_counter() - t0)
    t = time.perf_counter(); c.save(2, state); new.append(time.perf_counter() - t); c.close()
    del got
print(f"{gb:g} GB, 3 trials: first save after a disk load, before {['%.3f' % x for x in old]} median {statistics.median(old):.3f} s; "
      f"after (memory sized in the background in {['%.2f' % x for x in wait_s]} s) {['%.3f' % x for x in new]} median {statistics.median(new):.3f} s")
shutil.rmtree(base)
