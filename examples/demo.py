"""Ballast demo: a real DDP job on 2 nodes x 2 workers survives a worker crash.

Runs `ballast launch --nodes 2 --nproc-per-node 2 examples/train_ddp.py`, kills
one worker with SIGKILL mid-run, and narrates how the job detected the failure,
recovered, and finished. Run it with `make demo`.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from train_events import read_events as events

HERE = os.path.dirname(os.path.abspath(__file__))
BALLAST = os.environ.get("BALLAST_BIN", os.path.join(HERE, "..", "build", "bin", "ballast"))
PYTHON = "/usr/bin/python3"
STEPS = 30


def say(t0, msg):
    print(f"[demo +{time.time() - t0:5.1f}s] {msg}", flush=True)


def main():
    out = tempfile.mkdtemp(prefix="ballast-demo-")
    log_path = os.path.join(out, "launch.log")
    cmd = [BALLAST, "launch", "--nodes", "2", "--nproc-per-node", "2", "--max-restarts", "3", "--python", PYTHON,
           os.path.join(HERE, "train_ddp.py"), "--out", out, "--steps", str(STEPS), "--step-time", "0.2"]
    print("$ " + " ".join(cmd[:9]) + " examples/train_ddp.py ...", flush=True)
    t0 = time.time()
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    shown = 0

    def show_ballast_lines():
        # Echo Ballast's own log lines (not the workers' output) as they come.
        nonlocal shown
        with open(log_path) as f:
            lines = f.readlines()
        for line in lines[shown:]:
            if line.startswith("[ballast"):
                print("    " + line.rstrip(), flush=True)
        shown = len(lines)

    killed = None
    while proc.poll() is None:
        show_ballast_lines()
        if killed is None and min(max([e.get("step", 0) for e in events(out, r) if e["event"] == "step"] or [0])
                                  for r in range(4)) >= 8:
            victim = [e for e in events(out, 1) if e["event"] == "start"][0]
            say(t0, f"all 4 ranks passed step 8; killing worker rank 1 (pid {victim['pid']}) with SIGKILL")
            os.kill(victim["pid"], signal.SIGKILL)
            killed = time.time()
        time.sleep(0.1)
    show_ballast_lines()
    code = proc.returncode
    say(t0, f"ballast launch exited with code {code}")

    starts = {r: [e for e in events(out, r) if e["event"] == "start"] for r in range(4)}
    done = {r: [e for e in events(out, r) if e["event"] == "done"] for r in range(4)}
    if killed is not None and all(len(s) >= 2 for s in starts.values()):
        restart_at = min(s[1]["t"] for s in starts.values())
        resumed = starts[0][1]["step"]
        first_step_after = min(e["t"] for e in events(out, 0) if e["event"] == "step" and e["t"] > restart_at)
        print()
        print("What happened:")
        print(f"  - worker rank 1 was killed at +{killed - t0:.1f}s")
        print(f"  - its agent saw the SIGKILL and reported it; the master restarted all workers in place")
        print(f"  - restarted workers were running {restart_at - killed:.1f}s after the kill "
              f"(restart count {starts[0][1]['restart']}), resumed from step {resumed}")
        print(f"  - first training step after the restart completed {first_step_after - killed:.1f}s after the kill")
    ok = code == 0 and all(len(d) == 1 and d[0]["step"] == STEPS for d in done.values())
    if ok:
        print(f"  - all 4 ranks completed {STEPS} steps; the job succeeded in {time.time() - t0:.1f}s")
        print(f"(logs: {log_path})")
        return 0
    print(f"demo FAILED: exit code {code}; see {log_path}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
