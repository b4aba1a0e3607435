"""What a master crash costs a running job under `ballast master --journal`.

A real 2-node DDP job (bench/goodput_train.py, flash checkpoint persisted
every 2 steps) runs once undisturbed and once with its master process
SIGKILLed --kills times (the supervisor restarts it from the journal). For
each kill it prints the master's downtime (kill -> listening again), the
agents' reconnect (listening -> both nodes re-joined) and the steps the
workers made while the master was away; then both jobs' wall times.

With --launcher launch the same job runs under `ballast launch --journal`
(the launcher restarts its master process; the agents are its children).

  /usr/bin/python3 bench/master_crash_bench.py [--kills 3] [--steps 150] [--launcher master|launch]
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from train_events import read_events  # noqa: E402
from _benchutil import free_port  # noqa: E402

BIN = os.environ.get("BALLAST_BIN", os.path.join(ROOT, "build", "bin", "ballast"))
PYTHON = "/usr/bin/python3"
TRAIN = os.path.join(ROOT, "bench", "goodput_train.py")


def log_time(line):
    m = re.search(r"\[ballast \S+ (\d\d:\d\d:\d\d\.\d{3})\]", line)
    return datetime.strptime(m.group(1), "%H:%M:%S.%f") if m else None


def run(steps, kills, step_time, launcher):
    tmp = tempfile.mkdtemp(prefix="ballast-mcbench-")
    port = free_port()
    env = {**os.environ, "BALLAST_TOKEN": "bench", "OMP_NUM_THREADS": "1"}
    out, ckpt = os.path.join(tmp, "out"), os.path.join(tmp, "ckpt")
    os.makedirs(out)
    mlog = open(os.path.join(tmp, "master.log"), "w")
    train = [TRAIN, "--out", out, "--ckpt-dir", ckpt, "--ckpt", "ballast", "--steps", str(steps), "--step-time",
             str(step_time), "--state-mb", "8", "--persist-every", "2"]
    t0 = time.time()
    if launcher == "launch":
        # One process tree: the launcher, its master process and its agents.
        master = subprocess.Popen([BIN, "launch", "--nodes", "2", "--nproc-per-node", "1", "--port", str(port),
                                   "--journal", os.path.join(tmp, "journal"), "--http-port", "-1", "--python",
                                   PYTHON, *train], stdout=mlog, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
        agents = []
        pid_pattern = r"master process pid (\d+) \(incarnation"
    else:
        master = subprocess.Popen([BIN, "master", "--nnodes", "2", "--host", "127.0.0.1", "--advertise-host",
                                   "127.0.0.1", "--port", str(port), "--journal", os.path.join(tmp, "journal"),
                                   "--job-id", "bench", "--http-port", "-1"], stdout=mlog, stderr=subprocess.STDOUT,
                                  env=env, start_new_session=True)
        agents = [subprocess.Popen([BIN, "run", "--rdzv-endpoint", f"127.0.0.1:{port}", "--nnodes", "2",
                                    "--nproc-per-node", "1", "--node-rank", str(r), "--local-addr", "127.0.0.1",
                                    "--python", PYTHON, *train],
                                   stdout=open(os.path.join(tmp, f"agent{r}.log"), "w"), stderr=subprocess.STDOUT,
                                   env=env, start_new_session=True) for r in (0, 1)]
        pid_pattern = r"master process pid (\d+) started"

    def steps_done():
        return max([e["step"] for e in read_events(out, 0) if e["event"] == "step"], default=0)

    def mlog_text():
        with open(os.path.join(tmp, "master.log")) as f:
            return f.read()

    results = []
    for k in range(kills):
        mark = (k + 1) * steps // (kills + 1)
        while steps_done() < mark:
            time.sleep(0.05)
        pid = int(re.findall(pid_pattern, mlog_text())[-1])
        before = steps_done()
        killed_at = datetime.now()
        os.kill(pid, signal.SIGKILL)
        while mlog_text().count("resumed the job from its journal") < k + 1:
            time.sleep(0.02)
        while True:  # both agents re-joined the new master
            text = mlog_text()
            tail = text[text.rfind("resumed the job from its journal"):]
            rejoins = [l for l in tail.splitlines() if "re-joined" in l]
            if len({re.search(r"node=(\S+)", l).group(1) for l in rejoins}) >= 2:
                break
            time.sleep(0.02)
        lines = tail.splitlines()
        listening = next(log_time(l) for l in lines if "master listening on" in l)
        rejoined = log_time(rejoins[-1])
        results.append((killed_at.replace(year=1900, month=1, day=1), listening, rejoined, steps_done() - before))
    for a in agents:
        a.wait()
    master.wait()
    wall = time.time() - t0
    ok = all(a.returncode == 0 for a in agents) and master.returncode == 0
    starts = sum(1 for r in (0, 1) for e in read_events(out, r) if e["event"] == "start")
    if os.environ.get("BALLAST_KEEP_TMP"):
        print(f"kept {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return wall, ok, starts, results


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--launcher", choices=["master", "launch"], default="master",
                   help="ballast master --journal + 2 agents, or ballast launch --journal")
    a = p.parse_args()
    base, ok0, starts0, _ = run(a.steps, 0, a.step_time, a.launcher)
    wall, ok, starts, results = run(a.steps, a.kills, a.step_time, a.launcher)
    for i, (killed, listening, rejoined, steps) in enumerate(results, 1):
        down = (listening - killed).total_seconds()
        reconnect = (rejoined - listening).total_seconds()
        print(f"kill {i}: master down {down:.2f} s, agents re-joined {reconnect:.2f} s after it listened, "
              f"{steps} steps trained meanwhile")
    print(f"undisturbed job: {base:.1f} s (ok={ok0}, {starts0} worker starts); with {a.kills} master kills: "
          f"{wall:.1f} s (ok={ok}, {starts} worker starts)")


if __name__ == "__main__":
    main()
