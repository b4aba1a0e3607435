"""Recovery time: worker SIGKILL -> first completed training step after restart.

DLRover rows (optional). DLRover (Ant Group, PyPI `dlrover`) is measured when
it is installed in a private directory, without torch (Debian's python3-torch
1.13 is used; nothing may pull torch in from PyPI):

    bench/setup_dlrover.sh            # = the commands below, into ~/.cache/ballast/dlrover-0.6.1
    /usr/bin/python3 -m pip install --no-deps --target ~/.cache/ballast/dlrover-0.6.1 \
        dlrover==0.6.1 grpcio==1.85.3 protobuf==4.25.3 packaging==26.4 deprecated==1.3.1 wrapt==2.5.2 \
        kubernetes==31.0.0 google-auth==2.63.0 pyasn1==0.6.5 pyasn1-modules==0.4.2 \
        websocket-client==1.9.2 requests-oauthlib==2.0.0 durationpy==0.11

0.6.1, the newest on PyPI when this was written, runs on Python 3.11 with
torch 1.13. The bench takes the newest ~/.cache/ballast/dlrover-* (or
--dlrover DIR; --dlrover '' skips it) and runs `dlrover-run --standalone
--max_restarts 3` through dlrover_baseline.py (which patches torch 1.13's
Std.from_str for Python 3.11) with PYTHONPATH=DIR, at monitor_interval 5 (its
default) and 0.1. If it is not installed or does not import, one line says
why and its rows are left out.

Same script (examples/train_ddp.py), same machine, for Ballast (warm restart,
the default, and cold with --no-warm-restart), for torch's own elastic
agent (see torch_elastic_baseline.py) and for DLRover. The kill comes at
step 40 (2 s of training at 0.05 s a step), once a warm agent has its
interpreters for the next restart ready, as in a real job that fails minutes
in. With --hang S the last rank hangs at step 40 instead (Ballast detects it
with --hang-timeout S; torch's agent and DLRover have no hang detection of
their own here, so the script's gloo collectives get a timeout of S and the
surviving rank's failure restarts them); the time counts from the hang.
Prints a table and writes JSON with --json. Not a test: numbers go into notes and docs.

usage: recovery_bench.py [--ballast build/bin/ballast] [--trials 3] [--nproc 2] [--dlrover DIR]
"""
import argparse
import glob
import json
import os
import re
import signal
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
from _benchutil import free_port  # noqa: E402


def trial(launcher_cmd, nproc, timeout=180, env=None, hang_args=None):
    """hang_args: the last rank hangs at KILL_STEP instead of being killed,
    and these script flags are added (e.g. a collective timeout)."""
    out = tempfile.mkdtemp(prefix="ballast-bench-")
    script = [SCRIPT, "--out", out, "--steps", "80", "--step-time", "0.05"]
    if hang_args is not None:
        script += ["--hang-rank", str(nproc - 1), "--hang-step", str(KILL_STEP)] + hang_args
    log = open(os.path.join(out, "launcher.log"), "w")
    proc = subprocess.Popen(launcher_cmd + script, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)
    deadline = time.time() + timeout
    kill_t = None
    try:
        while time.time() < deadline:
            if kill_t is None and hang_args is not None:
                hangs = [e for e in events(out, nproc - 1) if e["event"] == "hang"]
                if hangs:
                    kill_t = hangs[0]["t"]
            elif kill_t is None:
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


def dlrover_env(opt):
    """(env for dlrover_baseline.py, version) or (None, why it is skipped)."""
    if opt is None:  # auto-detect: the newest install by setup_dlrover.sh
        found = sorted(glob.glob(os.path.expanduser("~/.cache/ballast/dlrover-[0-9]*/dlrover")),
                       key=lambda d: [int(n) for n in re.findall(r"\d+", os.path.basename(os.path.dirname(d)))])
        if not found:
            return None, "not installed (no ~/.cache/ballast/dlrover-*; see bench/setup_dlrover.sh)"
        opt = os.path.dirname(found[-1])
    if not opt:
        return None, "--dlrover ''"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (opt, os.environ.get("PYTHONPATH")) if p))
    check = ("import importlib.metadata as m, dlrover.trainer.torch.elastic_run, dlrover.python.master.local_master; "
             "print(m.version('dlrover'))")
    r = subprocess.run([PY, "-c", check], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]
        return None, f"{opt} does not import ({last})"
    return env, r.stdout.strip().splitlines()[-1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ballast", default=os.path.join(ROOT, "build", "bin", "ballast"))
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--hang", type=float, default=None, metavar="S",
                   help="a hang instead of a kill: the last rank stops at step 40; Ballast detects it with "
                        "--hang-timeout S, the peers (no hang detection of their own) through a gloo "
                        "collective timeout of S seconds in the script")
    p.add_argument("--dlrover", default=None,
                   help="DLRover install dir (PYTHONPATH); default: newest ~/.cache/ballast/dlrover-*; '' skips it")
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
    env = {}
    dl_env, dl_version = dlrover_env(a.dlrover)
    if dl_env is None:
        print(f"dlrover: skipped: {dl_version}", flush=True)
    else:
        for mi, label in (("5", "5, default"), ("0.1", "0.1")):
            name = f"dlrover-run {dl_version} --standalone (monitor_interval {label})"
            systems[name] = lambda mi=mi: [PY, os.path.join(HERE, "dlrover_baseline.py"), "--standalone",
                                           "--nproc_per_node", str(a.nproc), "--max_restarts", "3",
                                           "--monitor_interval", mi]
            env[name] = dl_env
    if a.hang is not None:
        for name in list(systems):
            if "dlrover" in name and "0.1" not in name or "monitor_interval 5" in name:
                del systems[name]  # one row per peer: the faster monitor interval
        for name in [n for n in systems if n.startswith("ballast")]:
            base = systems.pop(name)
            systems[f"{name} --hang-timeout {a.hang:g}"] = lambda base=base: base() + ["--hang-timeout", str(a.hang)]
    results = {}
    for name, cmd in systems.items():
        hang_args = None
        if a.hang is not None:
            hang_args = [] if name.startswith("ballast") else ["--pg-timeout", str(a.hang)]
        rows = [trial(cmd(), a.nproc, env=env.get(name), hang_args=hang_args) for _ in range(a.trials)]
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
