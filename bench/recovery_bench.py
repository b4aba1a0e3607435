"""Recovery time: worker SIGKILL -> first completed training step after restart.

Same script (examples/train_ddp.py), same machine, for Ballast (warm restart,
the default, and cold with --no-warm-restart) and for torch's own elastic
agent (see torch_elastic_baseline.py). The kill comes at step 40 (2 s of
training at 0.05 s a step), once a warm agent has its interpreters for the
next restart ready, as in a real job that fails minutes in. Prints a table and
writes JSON with --json. Not a test: numbers go into notes and docs.

usage: recovery_bench.py [--ballast build/bin/ballast] [--trials 3] [--nproc 2]
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(ROOT, "examples", "train_ddp.py")
PY = "/usr/bin/python3"
KILL_STEP = 40
sys.path.insert(0, os.path.join(ROOT, "examples"))
from train_events import read_events as events  # noqa: E402  (the format train_ddp.py writes)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def trial(launcher_cmd, nproc, timeout=180):
    out = tempfile.mkdtemp(prefix="ballast-bench-")
    script = [SCRIPT, "--out", out, "--steps", "80", "--step-time", "0.05"]
    log = open(os.path.join(out, "launcher.log"), "w")
    proc = subprocess.Popen(launcher_cmd + script, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + timeout
    kill_t = None
    try:
        while time.time() < deadline:
            if kill_t is None:
                steps = [max([e["step"] for e in events(out, r) if e["event"] == "step"] or [0]) for r in range(nproc)]
                if min(steps) >= KILL_STEP:
                    victim = [e for e in events(out, nproc - 1) if e["event"] == "start"][0]["pid"]
                    kill_t = time.time()
                    os.kill(victim, signal.SIGKILL)
            else:
                starts = [e for e in events(out, 0) if e["event"] == "start"]
                if len(starts) >= 2:
                    after = [e["t"] for e in events(out, 0) if e["event"] == "step" and e["t"] > starts[1]["t"]]
                    if after:
                        restart_t = starts[1]["t"]
                        proc.wait(timeout=max(1, deadline - time.time()))
                        return {"workers_restarted_s": restart_t - kill_t, "first_step_s": after[0] - kill_t,
                                "exit": proc.returncode}
            if proc.poll() is not None and kill_t is None:
                raise RuntimeError(f"launcher exited early ({proc.returncode}); see {out}/launcher.log")
            time.sleep(0.02)
        raise RuntimeError(f"trial timed out; see {out}/launcher.log")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ballast", default=os.path.join(ROOT, "build", "bin", "ballast"))
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    systems = {
        "ballast run --standalone (warm restart)": lambda: [a.ballast, "run", "--standalone", "--nproc-per-node",
                                                            str(a.nproc), "--python", PY],
        "ballast run --standalone --no-warm-restart (cold)":
            lambda: [a.ballast, "run", "--standalone", "--nproc-per-node", str(a.nproc), "--python", PY,
                     "--no-warm-restart"],
        "torch elastic_launch (monitor_interval 5, torchrun default)":
            lambda: [PY, os.path.join(HERE, "torch_elastic_baseline.py"), "--nproc-per-node", str(a.nproc),
                     "--monitor-interval", "5", "--port", str(free_port())],
        "torch elastic_launch (monitor_interval 0.1)":
            lambda: [PY, os.path.join(HERE, "torch_elastic_baseline.py"), "--nproc-per-node", str(a.nproc),
                     "--monitor-interval", "0.1", "--port", str(free_port())],
    }
    results = {}
    for name, cmd in systems.items():
        rows = [trial(cmd(), a.nproc) for _ in range(a.trials)]
        results[name] = rows
        med_restart = statistics.median(r["workers_restarted_s"] for r in rows)
        med_step = statistics.median(r["first_step_s"] for r in rows)
        print(f"{name:60s} workers restarted {med_restart:6.2f} s   first step after kill {med_step:6.2f} s "
              f"(median of {len(rows)}; exits {[r['exit'] for r in rows]})", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
