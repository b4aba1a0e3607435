#!/usr/bin/python3
"""Flash-checkpoint benchmark: ballast.Checkpointer against its floor and torch.save/load.

For state dicts of each size (default 0.1, 1 and 4 GB; a size is skipped when it
does not fit comfortably in memory) it measures, in one run:

  memcpy floor  a plain parallel memcpy of the same bytes into pre-faulted shared
                memory (same thread count as the checkpoint copy)
  save          blocking time of Checkpointer.save() (steady state: both slots
                already sized; the copy, checksum and commit)
  torch.save    torch.save to the same directory plus fsync
  load (mem)    Checkpointer.load() from shared memory (checksums verified as it
                copies; and without verification)
  load into     Checkpointer.load(into=state): into the state's existing tensors
  torch.load    torch.load of the file torch.save wrote (page cache hot)

Targets: save within 1.2x of the memcpy floor and >= 20x faster than
torch.save+fsync at 1 GB; load from memory >= 5x faster than torch.load; load
into existing tensors within 1.5x of the memcpy floor.

Run:  PYTHONPATH=build/python /usr/bin/python3 bench/ckpt_bench.py [--sizes 0.1,1,4] [--dir D]
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import ballast
from _benchutil import make_state
from ballast import _ballast


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def tensors_of(state):
    out = []
    for v in state["model"].values():
        out.append(v)
    return out


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def bench_size(gb, root, repeats):
    nbytes = int(gb * (1 << 30))
    state = make_state(nbytes)
    tensors = tensors_of(state)
    total = sum(t.numel() * t.element_size() for t in tensors)
    r = {"size_gb": round(total / (1 << 30), 3), "copy_threads": _ballast.default_copy_threads()}

    floor = _ballast.bench_memcpy([(t.data_ptr(), t.numel() * t.element_size()) for t in tensors],
                                  repeats=repeats)
    r["memcpy_floor_s"] = floor

    d = os.path.join(root, f"ckpt-{gb}")
    ckpt = ballast.Checkpointer(d)
    step = [0]

    def save():
        step[0] += 1
        ckpt.save(step[0], state)

    save()
    save()  # both slots sized and pre-faulted: what every later save sees
    r["save_best_s"], r["save_median_s"] = timed(save, repeats)

    ckpt.verify = True
    r["load_mem_s"], _ = timed(lambda: ckpt.load(), repeats)
    assert ckpt.last_load_source == "memory"
    ckpt.verify = False
    r["load_mem_noverify_s"], _ = timed(lambda: ckpt.load(), repeats)
    ckpt.verify = True
    # In place: into the state's own (already faulted) tensors, as after a restart.
    r["load_into_s"], _ = timed(lambda: ckpt.load(into=state), repeats)
    assert ckpt.last_load_source == "memory"

    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "torch.pt")

    def torch_save():
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    r["torch_save_fsync_s"], _ = timed(torch_save, 1)
    r["torch_load_s"], _ = timed(lambda: torch.load(path), max(1, repeats // 2))

    # And a durable flash checkpoint, for reference: save(persist) + wait().
    t0 = time.perf_counter()
    save_t0 = time.perf_counter()
    step[0] += 1
    ckpt.save(step[0], state, persist=True)
    r["persist_save_blocking_s"] = time.perf_counter() - save_t0
    ckpt.wait()
    r["persist_durable_s"] = time.perf_counter() - t0
    ckpt.close()
    shutil.rmtree(d, ignore_errors=True)

    r["save_vs_floor"] = r["save_best_s"] / floor
    r["torch_save_vs_save"] = r["torch_save_fsync_s"] / r["save_best_s"]
    r["torch_load_vs_load_mem"] = r["torch_load_s"] / r["load_mem_s"]
    r["torch_load_vs_load_mem_noverify"] = r["torch_load_s"] / r["load_mem_noverify_s"]
    r["torch_load_vs_load_into"] = r["torch_load_s"] / r["load_into_s"]
    r["load_into_vs_floor"] = r["load_into_s"] / floor
    r["save_gbps"] = total / r["save_best_s"] / 1e9
    r["floor_gbps"] = total / floor / 1e9
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0.1,1,4", help="GB, comma separated")
    p.add_argument("--dir", default=None, help="directory for files (default: a temp dir)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print JSON lines only")
    args = p.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    root = args.dir or tempfile.mkdtemp(prefix="ballast-bench-")
    os.makedirs(root, exist_ok=True)
    results = []
    try:
        for gb in (float(s) for s in args.sizes.split(",")):
            need = 6 * gb * (1 << 30)  # state, 2 slots, floor buffer, loads, torch.load
            if need > mem_available():
                print(f"skip {gb} GB: needs ~{need / (1 << 30):.0f} GB free, "
                      f"{mem_available() / (1 << 30):.1f} GB available", file=sys.stderr)
                continue
            r = bench_size(gb, root, args.repeats)
            results.append(r)
            if args.json:
                print(json.dumps(r))
            else:
                print(f"\n== {r['size_gb']} GB state ({r['copy_threads']} copy threads) ==")
                print(f"memcpy floor           {r['memcpy_floor_s'] * 1e3:9.1f} ms  ({r['floor_gbps']:.1f} GB/s)")
                print(f"save (blocking)        {r['save_best_s'] * 1e3:9.1f} ms  ({r['save_gbps']:.1f} GB/s)"
                      f"  median {r['save_median_s'] * 1e3:.1f} ms  -> {r['save_vs_floor']:.2f}x floor"
                      f" (target <= 1.2x)")
                print(f"torch.save + fsync     {r['torch_save_fsync_s'] * 1e3:9.1f} ms"
                      f"  -> save is {r['torch_save_vs_save']:.1f}x faster (target >= 20x at 1 GB)")
                print(f"load from memory       {r['load_mem_s'] * 1e3:9.1f} ms  (verified)"
                      f"  -> {r['torch_load_vs_load_mem']:.1f}x faster than torch.load (target >= 5x)")
                print(f"load from memory       {r['load_mem_noverify_s'] * 1e3:9.1f} ms  (no verify)"
                      f"  -> {r['torch_load_vs_load_mem_noverify']:.1f}x faster than torch.load")
                print(f"load into (in place)   {r['load_into_s'] * 1e3:9.1f} ms  (verified)"
                      f"  -> {r['load_into_vs_floor']:.2f}x floor (target <= 1.5x),"
                      f" {r['torch_load_vs_load_into']:.1f}x faster than torch.load")
                print(f"torch.load             {r['torch_load_s'] * 1e3:9.1f} ms")
                print(f"save(persist) + wait   {r['persist_save_blocking_s'] * 1e3:9.1f} ms blocking, "
                      f"{r['persist_durable_s'] * 1e3:.1f} ms until durable")
            sys.stdout.flush()
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
