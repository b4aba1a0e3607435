"""Rendezvous latency on loopback: N agents start at once against one master;
time from the agents' start until every worker of the first round is running.

Each agent runs one trivial worker (--no-python /bin/true would exit at once,
so the worker is a tiny shell that records its start time). Uses
`ballast master` + N x `ballast run`. Not a test: numbers go into notes.

usage: rendezvous_bench.py [--ballast build/bin/ballast] [--agents 2 16 64]
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(ballast, n):
    out = tempfile.mkdtemp(prefix="ballast-rdzv-")
    env = dict(os.environ, BALLAST_TOKEN="bench", BALLAST_LAST_CALL_S="0")
    master = subprocess.Popen([ballast, "master", "--nnodes", str(n), "--host", "127.0.0.1", "--advertise-host",
                               "127.0.0.1", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env=env, text=True)
    addr = None
    for line in master.stdout:
        m = re.search(r"listening on (\S+)", line)
        if m:
            addr = m.group(1)
            break
    worker = f"date +%s.%N > {out}/start-$RANK"
    t0 = time.time()
    agents = [subprocess.Popen([ballast, "run", "--rdzv-endpoint", addr, "--nnodes", str(n), "--nproc-per-node", "1",
                                "--no-python", "/bin/sh", "-c", worker], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=env) for _ in range(n)]
    codes = [a.wait(timeout=300) for a in agents]
    master.wait(timeout=60)
    starts = [float(open(os.path.join(out, f"start-{r}")).read()) for r in range(n)]
    return max(starts) - t0, codes


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ballast", default=os.path.join(ROOT, "build", "bin", "ballast"))
    p.add_argument("--agents", type=int, nargs="+", default=[2, 16, 64])
    a = p.parse_args()
    for n in a.agents:
        latency, codes = run(a.ballast, n)
        bad = [c for c in codes if c != 0]
        print(f"{n:3d} agents: all workers running {latency:6.2f} s after the agents started"
              f"{'' if not bad else f' ({len(bad)} agents failed)'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
