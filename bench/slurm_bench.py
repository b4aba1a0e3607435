"""Node kill -> first training step on the hot spare, under a real Slurm.

A fresh Slurm cluster (tests/slurm/slurm_cluster.py: slurmctld and one slurmd
per network namespace) runs `sbatch -N 4 --no-kill` with
`ballast slurm --nodes 3 --spares 1 --nproc-per-node 1` and a tiny DDP job
(examples/train_ddp.py). Once every rank trains, one training node (not the
batch host) is killed like a dead machine: its slurmd and every process in its
namespace get SIGKILL. Then, from the kill:

  detect    the master logs the node lost
  agent     an agent starts on the spare (0: the spare's agent already runs)
  rdzv      the next round starts (with the spare in it)
  workers   the new round's workers are up (their "start" event, after
            init_process_group)
  step      the first training step of the new round
  slurm_nr  Slurm marks the node not responding (sinfo state ends in '*')
  slurm_dn  Slurm marks it DOWN (the same config as the tests:
            SlurmdTimeout=5, MessageTimeout=2)

    sudo /usr/bin/python3 bench/slurm_bench.py --ballast build/bin/ballast --trials 3
"""
import argparse
import datetime
import glob
import json
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, os.path.join(ROOT, "tests", "slurm"))
from slurm_cluster import SlurmCluster  # noqa: E402

LOG_TIME = re.compile(r"^\[ballast [a-z]+ (\d\d:\d\d:\d\d\.\d{3})\]")


def log_lines(path):
    """(epoch seconds, line) for every log line of the job's output ("[ballast slurm 01:12:48.051] ...",
    local time of today)."""
    out = []
    today = datetime.date.today().isoformat()
    try:
        with open(path) as f:
            for line in f:
                m = LOG_TIME.match(line)
                if m:
                    t = datetime.datetime.strptime(f"{today} {m.group(1)}", "%Y-%m-%d %H:%M:%S.%f").timestamp()
                    out.append((t, line))
    except FileNotFoundError:
        pass
    return out


def events(out_dir):
    evs = []
    for path in glob.glob(os.path.join(out_dir, "rank*.jsonl")):
        with open(path) as f:
            evs += [json.loads(line) for line in f if line.strip()]
    return evs


def first(lines, pattern, after):
    for t, line in lines:
        if t >= after and re.search(pattern, line):
            return t
    return None


def trial(args, n):
    with SlurmCluster(nodes=4) as c:
        out = os.path.join(c.workdir, "out")
        os.makedirs(out)
        log = os.path.join(c.workdir, "job.out")
        script = os.path.join(c.workdir, "job.sbatch")
        with open(script, "w") as f:
            f.write("#!/bin/sh\nexec " + " ".join([
                os.path.abspath(args.ballast), "slurm", "--python", "/usr/bin/python3", "--nodes", "3",
                "--spares", "1", "--nproc-per-node", "1", os.path.join(os.path.abspath(ROOT), "examples/train_ddp.py"),
                "--steps", str(args.steps), "--step-time", str(args.step_time), "--out", out]) + "\n")
        os.chmod(script, 0o755)
        job = c.sbatch(script, args=["-N", "4", "--no-kill", "-o", log])
        deadline = time.time() + 180
        while len([e for e in events(out) if e["event"] == "step" and e["step"] >= 5]) < 3:
            if time.time() > deadline:
                raise SystemExit(f"trial {n}: the job did not train within 180 s; see {log}")
            time.sleep(0.2)
        # The first round waits for every started node: n1-n3 (node ranks
        # 0-2) train, n4 is the spare. n1 holds the batch step: kill n2.
        victim = "n2"
        t0 = time.time()
        c.kill_node(victim)
        slurm_nr = slurm_dn = None
        while time.time() < t0 + 30 and slurm_dn is None:
            st = c.node_state(victim)
            if slurm_nr is None and st.endswith("*"):
                slurm_nr = time.time() - t0
            if "down" in st:
                slurm_dn = time.time() - t0
            time.sleep(0.1)
        c.wait_job(job, 240)
        lines = log_lines(log)
        evs = events(out)
        detect = first(lines, rf"node={victim} round=\d+ lost", t0 - 0.01)
        agent = first(lines, r"started the agent of node rank", t0 - 0.01)  # none: the spare runs already
        rdzv = first(lines, r"round=\d+ starts", t0 - 0.01)
        starts = sorted(e["t"] for e in evs if e["event"] == "start" and e["t"] >= t0)
        steps_after = sorted(e["t"] for e in evs if e["event"] == "step" and e["t"] >= (starts[-1] if starts else t0))
        done = [e for e in evs if e["event"] == "done"]
        res = {
            "detect": detect - t0 if detect else None,
            "agent": (agent - t0) if agent else 0.0,
            "rdzv": rdzv - t0 if rdzv else None,
            "workers": starts[-1] - t0 if starts else None,
            "step": steps_after[0] - t0 if steps_after else None,
            "slurm_nr": slurm_nr,
            "slurm_dn": slurm_dn,
            "done_ranks": len(done),
            "agent_starts": sum("started the agent of node rank" in line for _, line in lines),
        }
        print(f"trial {n}: " + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in res.items()), flush=True)
        return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ballast", default=os.path.join(ROOT, "build/bin/ballast"))
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.2)
    args = p.parse_args()
    results = [trial(args, i + 1) for i in range(args.trials)]
    print("median over", len(results), "trials (seconds after the kill):")
    for k in ("detect", "agent", "rdzv", "workers", "step", "slurm_nr", "slurm_dn"):
        vals = [r[k] for r in results if r[k] is not None]
        if vals:
            print(f"  {k:9s} {statistics.median(vals):6.2f}  (min {min(vals):.2f}, max {max(vals):.2f})")


if __name__ == "__main__":
    main()
