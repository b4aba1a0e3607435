"""Pre-flight check worker: a matmul benchmark and an allreduce in a small group.

The ballast agent runs it as ``python -u -m ballast.precheck`` for a RunCheck
decision of the master (``ballast run --network-check``), one process per local
rank, with the torchrun environment of the check group (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK) and:

- ``BALLAST_PRECHECK_MATMUL_SIZE``: square matrix size (default 1024);
- ``BALLAST_PRECHECK_ALLREDUCE_BYTES``: allreduce payload (default 16 MiB);
- ``BALLAST_PRECHECK_TIMEOUT_S``: collective timeout (default 120);
- ``BALLAST_PRECHECK_RESULT``: file to write the measured seconds to;
- ``BALLAST_PRECHECK_FAIL=1``: chaos ``check-fail``: exit 1 after the check.

The backend is nccl when CUDA is available, else gloo. It exits 0 when the
allreduce returned the right sum. Example (what the agent runs)::

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python -m ballast.precheck
"""
import datetime
import os
import sys
import time


def main() -> int:
    size = int(os.environ.get("BALLAST_PRECHECK_MATMUL_SIZE", "1024"))
    nbytes = int(os.environ.get("BALLAST_PRECHECK_ALLREDUCE_BYTES", str(16 << 20)))
    timeout_s = float(os.environ.get("BALLAST_PRECHECK_TIMEOUT_S", "120"))
    result_path = os.environ.get("BALLAST_PRECHECK_RESULT", "")

    import torch
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method="env://",
                            timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()

    def sync():
        if use_cuda:
            torch.cuda.synchronize()

    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    data = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    # Warm up both (allocations, first collective) so they are not timed; the
    # barrier lines the group up so nobody's time includes a partner's start.
    torch.matmul(a, b)
    dist.all_reduce(torch.ones(1, device=device))
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(3):
        torch.matmul(a, b)
    sync()
    dist.all_reduce(data)
    sync()
    elapsed = time.perf_counter() - start
    ok = abs(float(data[0].item()) - world) < 1e-3 and abs(float(data[-1].item()) - world) < 1e-3
    dist.barrier()
    dist.destroy_process_group()
    if result_path:
        with open(result_path, "w") as f:
            f.write(f"{elapsed:.6f}\n")
    print(f"ballast precheck: rank {dist_rank()} matmul {size}x{size} x3 + allreduce {nbytes} B "
          f"over {world} ranks: {elapsed:.4f} s ({'ok' if ok else 'WRONG SUM'})")
    if not ok:
        print("ballast precheck: the allreduce returned a wrong sum", file=sys.stderr)
        return 1
    if os.environ.get("BALLAST_PRECHECK_FAIL") == "1":
        print("ballast precheck: chaos check-fail: injected check failure", file=sys.stderr)
        return 1
    return 0


def dist_rank() -> str:
    return os.environ.get("RANK", "0")


if __name__ == "__main__":
    sys.exit(main())
