"""What the Ray tests (test_ray.py) and bench/ray_bench.py share: a loopback-only
network namespace to run the cluster in, Ray's settings for a small cluster on
one machine, finding a job's processes and the Ray node of an agent, and whether a process runs."""
import json
import os
import sys

# Ray's health checks every 200 ms: a removed node is reported dead in ~0.5 s
# (Ray's defaults take 15 s or more).
HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 200, "health_check_timeout_ms": 200,
          "health_check_failure_threshold": 3}
STORE = 80 << 20  # the smallest object store Ray accepts is 75 MiB


def enter_loopback_netns(mark):
    """Re-executes this program inside a new network namespace that has only
    loopback (unless the environment variable `mark` says it runs there): Ray
    would bind the machine's routable address otherwise; there every node is
    127.0.0.1. Needs root."""
    if os.environ.get(mark) == "1":
        return
    os.environ[mark] = "1"
    os.execvp("unshare", ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
                          sys.executable, *sys.argv])


def alive(pid):
    """Whether pid runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def read_jsonl(path):
    """The JSON lines of a file some process may be appending to: a last line
    without its newline yet is being written and is left for the next read."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def job_processes(marker):
    """[(pid, command line)] of the processes whose command line mentions marker (e.g. the job's output dir)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            found.append((int(d), cmd[:200]))
    return found


def agent_ray_node(out, node_rank):
    """The Ray node id of the running Ballast agent of node rank node_rank whose
    command line mentions out (from its environment: BALLAST_RAY_NODE_ID)."""
    for pid, cmd in job_processes(out):
        if " run " not in cmd or f"--node-rank {node_rank} " not in cmd:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"BALLAST_RAY_NODE_ID" in env:
            return env[b"BALLAST_RAY_NODE_ID"].decode()
    return None
