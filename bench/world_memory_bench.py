"""Load time in a world that shrank: from the world's memory vs from disk.

Four ranks saved one step of a row-sharded tensor (MB per rank each) to
shared memory and to disk. Two ranks (gloo, real processes) then load their
halves: rank 0 holds saved rank 0's store and, as replicas, saved ranks 2 and
3's; rank 1 holds saved rank 1's. From memory the ranks exchange the images
they lack over the process group; from disk each reads the files it needs,
evicted from the page cache first (files that other nodes wrote are not in
this node's cache).

    /usr/bin/python3 bench/world_memory_bench.py --mb 256 --trials 3
"""

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile

import torch

import ballast
from ballast import _ballast
from _benchutil import free_port

WORKER = r"""
import json, os, sys, time, torch, torch.distributed as dist, ballast
dist.init_process_group("gloo")
rank = dist.get_rank()
rows, cols = json.loads(sys.argv[2])
half = rows // 2
shm = os.environ.pop("BENCH_SHM") if sys.argv[3] == "memory" else None
if shm is None:
    os.environ.pop("BALLAST_CKPT_REPLICAS", None)
ckpt = ballast.Checkpointer(sys.argv[1], shm=shm)
dist.barrier()
t0 = time.perf_counter()
step, state = ckpt.load(shards={"w": ((rows, cols), (half * rank, 0), (half, cols))})
dist.barrier()
dt = time.perf_counter() - t0
if rank == 0:
    print(json.dumps({"seconds": dt, "source": ckpt.last_load_source, "step": step}))
dist.destroy_process_group()
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256, help="MB per saved rank")
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    cols = 1024
    rows_per = max(1, args.mb * (1 << 20) // (4 * cols))
    rows = 4 * rows_per
    tmp = tempfile.mkdtemp(prefix="ballast-wmb-")
    tag = f"/ballast-bench-{os.getpid()}-{secrets.token_hex(4)}"
    stores = []
    try:
        d = os.path.join(tmp, "ckpt")
        for j in range(4):
            piece = torch.full((rows_per, cols), float(j))
            state = {"w": ballast.Shard(piece, (rows, cols), (j * rows_per, 0))}
            disk = ballast.Checkpointer(d, rank=j, world_size=4)
            disk.save(1, state, persist=True)
            disk.wait()
            disk.close()
            store = _ballast.create_store(f"{tag}-s{j}")
            stores.append(store)
            mem = ballast.Checkpointer(d, rank=j, world_size=4, shm=store.name)
            mem.save(1, state)
            mem.close()
        results = {"memory": [], "disk": []}
        for trial in range(args.trials):
            for mode in (("memory", "disk") if trial % 2 == 0 else ("disk", "memory")):
                if mode == "disk":
                    # Files other nodes wrote are not in this node's page cache.
                    for root, _, files in os.walk(d):
                        for f in files:
                            fd = os.open(os.path.join(root, f), os.O_RDONLY)
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                            os.close(fd)
                port = free_port()
                procs = []
                for rank in range(2):
                    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                               WORLD_SIZE="2", OMP_NUM_THREADS="1", BENCH_SHM=stores[rank].name,
                               BALLAST_CKPT_REPLICAS=(f"{stores[2].name},{stores[3].name}" if rank == 0 else ""))
                    procs.append(subprocess.Popen([sys.executable, "-c", WORKER, d, json.dumps([rows, cols]), mode],
                                                  env=env, stdout=subprocess.PIPE, text=True))
                outs = [p.communicate(timeout=600)[0] for p in procs]
                if any(p.returncode for p in procs):
                    raise SystemExit(f"a worker failed: {outs}")
                r = json.loads(outs[0].strip().splitlines()[-1])
                assert r["source"] == mode, r
                results[mode].append(r["seconds"])
                print(f"trial {trial} {mode}: {r['seconds']:.3f} s", flush=True)
        for mode, xs in results.items():
            xs.sort()
            print(f"{mode}: median {xs[len(xs) // 2]:.3f} s (min {xs[0]:.3f}, max {xs[-1]:.3f}) for "
                  f"{args.mb} MB x 4 saved ranks -> 2 ranks")
    finally:
        for s in stores:
            s.close()
        shutil.rmtree(tmp, True)


if __name__ == "__main__":
    main()
