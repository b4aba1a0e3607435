"""How fast the pre-flight check finds a faulty node, and what it costs.

Runs `ballast launch --nodes N --nproc-per-node 1 --network-check` on loopback
with a trivial worker (a shell that exits 0), once without a fault and once
with `--chaos check-fail:node=R`, and reads the launcher's log timestamps:

- check done: from the master's start to the check's verdict (no fault: the
  check's whole cost before training; with the fault: time to localize it);
- training: from the master's start to the first round (with the fault: the
  faulty node was excluded, replaced, and the new set checked again).

The check program imports torch in one process per local rank, so on this
2-core VM most of each round is Python start-up. Not a test: numbers go into
notes. Check sizes default to the production ones (matmul 1024, allreduce
16 MiB); set BALLAST_PRECHECK_* to change them.

usage: precheck_bench.py [--ballast build/bin/ballast] [--nodes 4 5] [--trials 1]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAMP = re.compile(r"^\[ballast launch (\d\d):(\d\d):(\d\d)\.(\d{3})\]")


def seconds(line):
    m = STAMP.match(line)
    if not m:
        return None
    h, mi, s, ms = (int(g) for g in m.groups())
    return h * 3600 + mi * 60 + s + ms / 1000.0


def run(ballast, nodes, bad):
    out = tempfile.mkdtemp(prefix="ballast-health-")
    argv = [ballast, "launch", "--nodes", str(nodes), "--nproc-per-node", "1", "--network-check",
            "--python", "/usr/bin/python3"]
    if bad is not None:
        argv += ["--chaos", f"check-fail:node={bad}"]
    argv += ["--no-python", "/bin/sh", "-c", "exit 0"]
    log_path = os.path.join(out, "launch.log")
    with open(log_path, "w") as log:
        code = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT, timeout=600)
    start = verdict = training = None
    excluded = []
    for line in open(log_path):
        t = seconds(line)
        if t is None:
            continue
        if start is None and "master listening" in line:
            start = t
        if verdict is None and ("passed the pre-flight check" in line or "pre-flight check of" in line
                                and ("faulty" in line or "straggler" in line)):
            verdict = t
        m = re.search(r"node=(\S+) excluded from the job", line)
        if m:
            excluded.append(m.group(1))
        if training is None and re.search(r"round=1 starts", line):
            training = t
    if None in (start, verdict, training):
        raise RuntimeError(f"launch exit {code}: log {log_path} lacks the expected lines")
    return verdict - start, training - start, excluded, code


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ballast", default=os.path.join(ROOT, "build", "bin", "ballast"))
    p.add_argument("--nodes", type=int, nargs="+", default=[4, 5])
    p.add_argument("--trials", type=int, default=1)
    a = p.parse_args()
    for n in a.nodes:
        for bad in (None, 1):
            checks, starts, notes = [], [], set()
            for _ in range(a.trials):
                check_s, train_s, excluded, code = run(a.ballast, n, bad)
                checks.append(check_s)
                starts.append(train_s)
                notes.add(f"exit {code}, excluded {len(excluded)}")
            what = "no fault        " if bad is None else f"check-fail node {bad}"
            print(f"{n} nodes, {what}: verdict {statistics.median(checks):6.2f} s, "
                  f"training starts {statistics.median(starts):6.2f} s after the master started "
                  f"({'; '.join(sorted(notes))}; median of {a.trials})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
