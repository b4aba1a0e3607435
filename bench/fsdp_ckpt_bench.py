"""FSDP2 checkpoint speed: Ballast's flash checkpoint against
torch.distributed.checkpoint (DCP), side by side, on torch 2.x (CPU, gloo).

An FSDP2 model (Linear layers) with AdamW state, about --gb GB of state in
all (parameters + exp_avg + exp_avg_sq), sharded over the ranks:

  save   blocking time of a flash save (first of the job, then the median of
         the next ones), of DCP async_save (the call's return) and of DCP's
         synchronous save
  load   load from memory into the existing model and optimizer
         (ckpt.load(into=...)) against DCP's load from disk, with its files
         in the page cache (dcp_load_disk) and read from the disk
         (dcp_load_disk_cold: the files evicted from the page cache first,
         as on a node that restarted or replaced a lost one);
         flash_memory_into_unverified: the same load with
         Checkpointer(verify=False), which skips the checksum
  reshard  a step persisted by 4 ranks, loaded on 2 (`--phase reshard`)

Run (it starts torchrun itself; one JSON line per phase with --json):

  ~/.cache/ballast/torch-2.15.0-py3.11/bin/python bench/fsdp_ckpt_bench.py --gb 1

On GPUs the save copies device memory to pinned host buffers first; here
every tensor is already in host memory, so the figures are the host side.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def evict(directory):
    """Drops directory's files from the page cache (written back first), so
    the next read comes from the disk: what a load after a node restart or on
    a new node reads. No root needed: posix_fadvise(DONTNEED) per file."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0, help="state size in GB (parameters and AdamW state)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--phase", choices=["all", "speed", "reshard-save", "reshard-load"], default="all")
    return p.parse_args()


def torchrun(nproc, args, phase, scratch):
    torchrun_bin = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun_bin, "--standalone", "--nproc-per-node", str(nproc), os.path.abspath(__file__),
           "--gb", str(args.gb), "--repeat", str(args.repeat), "--phase", phase, "--dir", scratch]
    if args.json:
        cmd.append("--json")
    env = dict(os.environ, OMP_NUM_THREADS="1", BALLAST_BENCH_CHILD="1")
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(r.stdout)
    if r.returncode != 0:
        sys.exit(f"{phase} failed (exit {r.returncode})")


def main_parent(args):
    scratch = args.dir or tempfile.mkdtemp(prefix="ballast-fsdp-bench-")
    try:
        if args.phase in ("all", "speed"):
            torchrun(args.ranks, args, "speed", scratch)
        if args.phase == "all":
            torchrun(4, args, "reshard-save", scratch)
            torchrun(2, args, "reshard-load", scratch)
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)


def main_child(args):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    sys.path.insert(0, os.path.join(HERE, "..", "build", "python"))
    import ballast  # also lets gloo's threads finish before the interpreter finalizes (torch 2.x)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    # 3 x 4 bytes per parameter (weights, exp_avg, exp_avg_sq).
    width = 2048
    layers = max(1, round(args.gb * 1e9 / 12 / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    gb = 12 * layers * width * width / 1e9

    def state():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def timed(fn):
        dist.barrier()
        t = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t
        return dt, out

    def report(name, values):
        worst = [0.0] * world
        dist.all_gather_object(worst, values)
        if rank == 0:
            row = {"phase": name, "ranks": world, "state_gb": round(gb, 3)}
            for k in values:
                row[k] = round(max(w[k] for w in worst), 4)  # the slowest rank
            print(json.dumps(row) if args.json else
                  f"{name} ({world} ranks, {gb:.2f} GB): " + ", ".join(f"{k} {v} s" for k, v in row.items()
                                                                       if k not in ("phase", "ranks", "state_gb")),
                  flush=True)

    root = args.dir
    if args.phase == "speed":
        ckpt = ballast.Checkpointer(os.path.join(root, "ballast"))
        first, _ = timed(lambda: ckpt.save(1, state()))
        flash = [timed(lambda i=i: ckpt.save(2 + i, state()))[0] for i in range(args.repeat)]
        dcp_async, dcp_sync = [], []
        for i in range(args.repeat):
            d = os.path.join(root, f"dcp-async-{i}")
            t, fut = timed(lambda d=d: dcp.async_save(state(), checkpoint_id=d))
            fut.result()
            dcp_async.append(t)
            d = os.path.join(root, f"dcp-sync-{i}")
            dcp_sync.append(timed(lambda d=d: dcp.save(state(), checkpoint_id=d))[0])
        report("save", {"flash_first": first, "flash": statistics.median(flash),
                        "dcp_async_save": statistics.median(dcp_async), "dcp_save": statistics.median(dcp_sync)})
        mem, mem_unverified, dcp_load, dcp_cold = [], [], [], []
        dcp_dir = os.path.join(root, "dcp-sync-0")
        for i in range(args.repeat):
            mem.append(timed(lambda: ckpt.load(into=state()))[0])
            assert ckpt.last_load_source == "memory", ckpt.last_load_source
            ckpt.verify = False  # as Checkpointer(verify=False): no checksum pass over the memory
            mem_unverified.append(timed(lambda: ckpt.load(into=state()))[0])
            ckpt.verify = True
            target = state()
            dcp_load.append(timed(lambda: dcp.load(target, checkpoint_id=dcp_dir))[0])
            if rank == 0:
                evict(dcp_dir)
            dist.barrier()
            target = state()
            dcp_cold.append(timed(lambda: dcp.load(target, checkpoint_id=dcp_dir))[0])
        report("load", {"flash_memory_into": statistics.median(mem),
                        "flash_memory_into_unverified": statistics.median(mem_unverified),
                        "dcp_load_disk": statistics.median(dcp_load),
                        "dcp_load_disk_cold": statistics.median(dcp_cold)})
        ckpt.close()
    elif args.phase == "reshard-save":
        ckpt = ballast.Checkpointer(os.path.join(root, "reshard"))
        ckpt.save(1, state(), persist=True)
        ckpt.wait()
        ckpt.close()
    else:
        ckpt = ballast.Checkpointer(os.path.join(root, "reshard"))
        t, (step, _) = timed(lambda: ckpt.load(into=state()))
        assert step == 1 and ckpt.last_load_source == "disk", (step, ckpt.last_load_source)
        report("reshard 4->2 from disk", {"load_into": t})
        ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    a = parse()
    if os.environ.get("BALLAST_BENCH_CHILD") == "1":
        main_child(a)
    else:
        main_parent(a)
