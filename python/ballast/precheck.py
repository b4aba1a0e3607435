"""Pre-flight check worker: a matmul benchmark and an allreduce in a small group.

The ballast agent runs one per local rank for the master's RunCheck decisions
(``ballast run --network-check``). Two ways to run it:

``python -u -m ballast.precheck`` runs one check with the torchrun
environment of the check group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK) and:

- ``BALLAST_PRECHECK_MATMUL_SIZE``: square matrix size (default 1024);
- ``BALLAST_PRECHECK_ALLREDUCE_BYTES``: allreduce payload (default 16 MiB);
- ``BALLAST_PRECHECK_TIMEOUT_S``: collective timeout (default 120);
- ``BALLAST_PRECHECK_RESULT``: file to write the measured seconds to;
- ``BALLAST_PRECHECK_FAIL=1``: chaos ``check-fail``: exit 1 after the check.

``python -u -m ballast.precheck --serve DIR`` is what the agent runs: a warm
check server that imports torch (and initializes CUDA) once, then runs one
check per request, so the rounds of a check pay no interpreter start-up. It
waits for ``DIR/req-<LOCAL_RANK>-<n>`` (n = 1, 2, ...; written atomically by
the agent), a file of ``key value`` lines: ``rank``, ``world_size``,
``master_addr``, ``master_port``, ``matmul_size``, ``allreduce_bytes``,
``timeout_s``, ``fail`` (0/1), or ``quit 1``. It answers in
``DIR/res-<LOCAL_RANK>-<n>`` with ``ok 0|1``, ``time_s T`` and
``error TEXT`` (the rest of the file). After a failed check it exits 1: a
broken collective may leave the process unusable, and the agent starts a
fresh server for the next check.

The backend is nccl when CUDA is available, else gloo. A check passes when
the allreduce returned the right sum. Example (one check, what the agent ran
before the server mode)::

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python -m ballast.precheck
"""
import datetime
import os
import sys
import time
import traceback


def run_check(rank, world, addr, port, size, nbytes, timeout_s):
    """One check in the group: returns (seconds, right_sum)."""
    import torch
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        def sync():
            if use_cuda:
                torch.cuda.synchronize()

        a = torch.randn(size, size, device=device)
        b = torch.randn(size, size, device=device)
        data = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        # Warm up both (allocations, first collective) so they are not timed;
        # the barrier lines the group up so nobody's time includes a partner's
        # start.
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
    finally:
        dist.destroy_process_group()
    print(f"ballast precheck: rank {rank} matmul {size}x{size} x3 + allreduce {nbytes} B over {world} ranks: "
          f"{elapsed:.4f} s ({'ok' if ok else 'WRONG SUM'})", flush=True)
    return elapsed, ok


def main() -> int:
    size = int(os.environ.get("BALLAST_PRECHECK_MATMUL_SIZE", "1024"))
    nbytes = int(os.environ.get("BALLAST_PRECHECK_ALLREDUCE_BYTES", str(16 << 20)))
    timeout_s = float(os.environ.get("BALLAST_PRECHECK_TIMEOUT_S", "120"))
    result_path = os.environ.get("BALLAST_PRECHECK_RESULT", "")
    elapsed, ok = run_check(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
                            os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
                            size, nbytes, timeout_s)
    if result_path:
        with open(result_path, "w") as f:
            f.write(f"{elapsed:.6f}\n")
    if not ok:
        print("ballast precheck: the allreduce returned a wrong sum", file=sys.stderr)
        return 1
    if os.environ.get("BALLAST_PRECHECK_FAIL") == "1":
        print("ballast precheck: chaos check-fail: injected check failure", file=sys.stderr)
        return 1
    return 0


def _read_request(path):
    req = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.rstrip("\n").partition(" ")
            if key:
                req[key] = value
    return req


def _write_result(path, ok, elapsed, error):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"ok {1 if ok else 0}\ntime_s {elapsed:.6f}\nerror {error}")
    os.rename(tmp, path)


def serve(directory) -> int:
    local_rank = os.environ.get("LOCAL_RANK", "0")
    import torch  # noqa: F401  (the point of the server: import once, check many times)
    if torch.cuda.is_available():
        torch.cuda.init()
    print(f"ballast precheck: server for local rank {local_rank} ready", flush=True)
    seq = 1
    parent = os.getppid()
    while True:
        req_path = os.path.join(directory, f"req-{local_rank}-{seq}")
        while not os.path.exists(req_path):
            if os.getppid() != parent:  # the agent is gone
                return 1
            time.sleep(0.01)
        req = _read_request(req_path)
        if req.get("quit") == "1":
            return 0
        res_path = os.path.join(directory, f"res-{local_rank}-{seq}")
        seq += 1
        try:
            elapsed, ok = run_check(int(req["rank"]), int(req["world_size"]), req["master_addr"],
                                    int(req["master_port"]), int(req["matmul_size"]), int(req["allreduce_bytes"]),
                                    float(req["timeout_s"]))
            error = "" if ok else "the allreduce returned a wrong sum"
        except Exception as e:  # a broken collective, a timeout, a CUDA error: reported, then exit
            traceback.print_exc()
            elapsed, ok, error = 0.0, False, f"{type(e).__name__}: {e}"
        if ok and req.get("fail") == "1":
            ok, error = False, "chaos check-fail: injected check failure"
            print("ballast precheck: chaos check-fail: injected check failure", file=sys.stderr, flush=True)
        _write_result(res_path, ok, elapsed, error)
        if not ok:
            return 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        sys.exit(serve(sys.argv[2]))
    if len(sys.argv) > 1:
        print("usage: python -m ballast.precheck [--serve DIR]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main())
