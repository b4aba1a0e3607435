"""Goodput under failures: the share of wall time that trained the model.

A job of STEPS steps of --step-time seconds of simulated accelerator compute
(bench/goodput_train.py: DDP on gloo, 1 node x --nproc workers, --state-mb
MiB of state per rank) has a worker SIGKILLed after about every --kill-every
seconds of compute. Goodput = STEPS x step_time / (launch -> job done), so
start-up, checkpoint stalls, recovery and recomputed steps all count as lost,
and so does what each step takes beyond --step-time (the script's own work).
Beside it: issue 31's definition, STEPS x the median measured step time /
wall, and the wall time split into parts from rank 0's step log (wall_split).
Also: the same wall time's productive share by the definition of the
master's goodput accountant (the duration of each step that reached a new
step number, from the script's step log) and, for Ballast, the accountant's
own figure from the job summary line (its wall runs from the master's start
to the job's end, a little shorter than launch -> exit).

Systems, same script, same machine, one after the other:
  ballast (warm restart, overlapped flash save every step, persisted every 10)
  the same with `--save-every auto` (Ballast picks which saves copy)
  ballast with no checkpoint (--ckpt none: the floor; only when --systems
      names it; a kill restarts from step 0, so give --kill-every above the
      compute time)
  torch's elastic agent (elastic_launch, monitor_interval 0.1) with
      torch.save every --torch-every steps
Each is also run without failures (--no-clean skips that). Not a test: the
numbers go into notes and docs.

usage: goodput_bench.py [--ballast build/bin/ballast] [--steps 500] [--step-time 0.36]
                        [--state-mb 64] [--kill-every 60] [--nproc 2] [--trials N] [--json FILE]
issue 31's run (1 x 2, 64 MB, kills at steps 220 and 440 of 660):
       goodput_bench.py --steps 660 --step-time 0.3 --kill-every 66 --no-clean [--mtbf 1m]
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = "/usr/bin/python3"
sys.path.insert(0, os.path.join(ROOT, "examples"))
from train_events import read_events  # noqa: E402
from recovery_bench import free_port  # noqa: E402  (same directory)


def run(cmd, script_flags, a, kills, env=None):
    """Runs one job; SIGKILLs the newest worker of the last rank each time the
    job's newest step passes the next kill step. Returns the measurements."""
    out = tempfile.mkdtemp(prefix="ballast-goodput-")
    ckpt = os.path.join(out, "ckpt")
    script = [os.path.join(HERE, "goodput_train.py"), "--out", out, "--ckpt-dir", ckpt, "--steps", str(a.steps),
              "--step-time", str(a.step_time), "--state-mb", str(a.state_mb)] + script_flags
    kill_every_steps = max(1, int(a.kill_every / a.step_time))
    pending = [kill_every_steps * (i + 1) + a.kill_offset for i in range(kills)]
    victim_rank = a.nproc - 1
    log = open(os.path.join(out, "launcher.log"), "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd + script, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    kill_times = []
    try:
        while proc.poll() is None:
            if time.time() - t0 > a.timeout:
                raise RuntimeError(f"timed out; see {out}/launcher.log")
            if pending:
                evs = read_events(out, victim_rank)
                steps = [e["step"] for e in evs if e["event"] == "step"]
                if steps and steps[-1] >= pending[0]:
                    pid = [e for e in evs if e["event"] == "start"][-1]["pid"]
                    os.kill(pid, signal.SIGKILL)
                    kill_times.append(time.time() - t0)
                    pending.pop(0)
            time.sleep(0.02)
        wall = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"job exited {proc.returncode}; see {out}/launcher.log")
    evs0 = read_events(out, 0)
    starts = [e for e in evs0 if e["event"] == "start"]
    first_step = next(e["t"] for e in evs0 if e["event"] == "step") - t0
    steps_run = sum(1 for e in evs0 if e["event"] == "step")
    # Productive time from the script's own step log, defined as the master's
    # accountant defines it (master/goodput.h): the duration of each step
    # that reached a step number for the first time, less the time checkpoint
    # saves blocked it (the script logs it: ballast's stall counter, the
    # torch.save block); a process's first step after its start belongs to
    # the (re)start.
    productive, high, prev, prev_stall = 0.0, 0, None, 0.0
    for e in evs0:
        if e["event"] == "start":
            prev = None
        elif e["event"] == "step":
            if prev is not None and e["step"] > high:
                productive += e["t"] - prev - (e.get("stall", 0.0) - prev_stall)
            high = max(high, e["step"])
            prev, prev_stall = e["t"], e.get("stall", 0.0)
    # Ballast's own figure: the master's accountant, in the job summary line.
    # Its split of the wall time too ("productive 37.5 s, startup 10.7 s,
    # ...": the parts over 0.05 s), and what save_every auto chose.
    accountant, split, auto = None, {}, []
    with open(os.path.join(out, "launcher.log")) as f:
        for line in f:
            m = re.search(r"summary: goodput ([0-9.]+)% of ([0-9.]+) s \(([^)]*)\)", line)
            if m:
                accountant = float(m.group(1)) / 100
                split = {k: float(v) for k, v in re.findall(r"([a-z]+) ([0-9.]+) s", m.group(3).split(";")[0])}
            m = re.search(r"save_every auto: copying every (\d+) step", line)
            if m:
                auto.append(int(m.group(1)))
    split_log = wall_split(evs0, t0, t0 + wall, a.step_time)
    durations = sorted(split_log.pop("_durations"))
    median_step = durations[len(durations) // 2] if durations else a.step_time
    return {"wall_s": wall, "goodput": a.steps * a.step_time / wall, "accountant_goodput": accountant,
            # The definition: steps x the median step time (as measured) / launch -> exit.
            "median_step_goodput": a.steps * median_step / wall, "median_step_s": median_step,
            "wall_split_s": split_log,
            "accountant_split_s": split, "save_every_auto": auto,
            "step_log_goodput": productive / wall,
            "kills": len(kill_times), "kill_times": kill_times,
            "starts": len(starts), "steps_run": steps_run, "redone_steps": steps_run - a.steps,
            "first_step_s": first_step, "loads": [(s["step"], s["source"], round(s["load_s"], 3)) for s in starts],
            "out": out}


def wall_split(evs, t_launch, t_exit, step_time):
    """Every second of launch -> exit, from one rank's step log: its parts
    add up to the wall time exactly.
      startup   launch -> the first process's "start" (interpreters, import,
                rendezvous, process group, load)
      restart   a process's last step -> the next process's "start"
      first     each process's "start" -> its first step (the first step
                after a (re)start: its compute plus what warms up)
      compute   step_time per new step number (the simulated compute)
      overhead  what the other steps took beyond step_time (the script's
                own work: DDP, the optimizer, saves, progress, its log)
      redone    steps of a number reached before (after a rollback)
      exit      the last step -> exit (the last save's wait, the barrier,
                the process group, the agent and the master ending)
    Also returns "_durations": the new steps' measured times."""
    parts = dict.fromkeys(("startup", "restart", "first", "compute", "overhead", "redone", "exit"), 0.0)
    durations, high, prev, last = [], 0, None, t_launch
    for e in evs:
        if e["event"] == "start":
            parts["startup" if prev is None and last == t_launch else "restart"] += e["t"] - last
            last, prev = e["t"], None
        elif e["event"] == "step":
            dt = e["t"] - last
            if prev is None:
                parts["first"] += dt
            elif e["step"] > high:
                parts["compute"] += step_time
                parts["overhead"] += dt - step_time
                durations.append(dt)
            else:
                parts["redone"] += dt
            high, prev, last = max(high, e["step"]), e["t"], e["t"]
    parts["exit"] = t_exit - last
    parts["_durations"] = durations
    return parts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ballast", default=os.path.join(ROOT, "build", "bin", "ballast"))
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--step-time", type=float, default=0.36)
    p.add_argument("--state-mb", type=int, default=64)
    p.add_argument("--kill-every", type=float, default=60.0)
    p.add_argument("--torch-every", type=int, default=10)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--kill-offset", type=int, default=0,
                   help="kill this many steps after each multiple of the kill interval (the script persists, "
                        "and so copies, every 10th step: an offset of 5 puts the kills between them)")
    p.add_argument("--systems", default="", help="run only the systems whose name contains one of these "
                                                  "comma-separated words (default: all)")
    p.add_argument("--no-clean", action="store_true", help="skip the failure-free runs")
    p.add_argument("--trials", type=int, default=1,
                   help="runs per row: the row shows the run of median goodput, and every run's goodput")
    p.add_argument("--mtbf", default=None,
                   help="adds a row: --save-every auto with this MTBF prior (e.g. 1m: what a user who knows the "
                        "failure rate passes)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    compute = a.steps * a.step_time
    kills = max(0, int(compute / a.kill_every - 1e-9))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        x for x in (os.path.join(ROOT, "build", "python"), os.environ.get("PYTHONPATH")) if x), OMP_NUM_THREADS="1")
    def ballast_cmd(*flags):
        return [a.ballast, "run", "--standalone", "--nproc-per-node", str(a.nproc), "--python", PY,
                "--max-restarts", str(kills + 2), *flags]

    systems = {
        "ballast (warm restart, overlapped flash save every step)": lambda: ballast_cmd(),
        "ballast --save-every auto (the interval from the measured costs and failure rate)":
            lambda: ballast_cmd("--save-every", "auto"),
        **({f"ballast --save-every auto --mtbf {a.mtbf} (the user's prior for the failure rate)":
            lambda: ballast_cmd("--save-every", "auto", "--mtbf", a.mtbf)} if a.mtbf else {}),
        # The script runs with --ckpt none (below): the same command.
        "ballast with no checkpoint (the floor: what the script costs without saves)": lambda: ballast_cmd(),
        f"torch elastic_launch (monitor 0.1 s) + torch.save every {a.torch_every} steps":
            lambda: [PY, os.path.join(HERE, "torch_elastic_baseline.py"), "--nproc-per-node", str(a.nproc),
                     "--monitor-interval", "0.1", "--max-restarts", str(kills + 2), "--port", str(free_port())],
    }
    print(f"goodput bench: {a.steps} steps x {a.step_time} s = {compute:.0f} s of compute, {a.state_mb} MiB of "
          f"state per rank, 1 node x {a.nproc}, {kills} worker kill(s) (one per {a.kill_every:.0f} s of compute)",
          flush=True)
    if not a.systems:
        systems = {n: c for n, c in systems.items() if "no checkpoint" not in n}
    else:
        systems = {n: c for n, c in systems.items() if any(w and w in n for w in a.systems.split(","))}
        if not systems:
            p.error(f"--systems {a.systems!r} matches no system")
    results = {}
    for name, cmd in systems.items():
        flags = (["--ckpt", "none"] if "no checkpoint" in name else ["--ckpt", "ballast"] if name.startswith("ballast")
                 else ["--ckpt", "torch", "--torch-every", str(a.torch_every)])
        rows = {}
        for label, k in (("failures", kills),) + ((("clean", 0),) if not a.no_clean else ()):
            trials = sorted((run(cmd(), flags, a, k, env=env) for _ in range(max(1, a.trials))),
                            key=lambda r: r["goodput"])
            r = dict(trials[(len(trials) - 1) // 2], trials=[t["goodput"] for t in trials])  # the median run
            rows[label] = r
            if len(trials) > 1:
                print(f"{name:70s} {label:8s} {len(trials)} runs, goodput " +
                      ", ".join(f"{t['goodput']:.3f}" for t in trials) + "; the median run:", flush=True)
            acc = f" (step log: {r['step_log_goodput']:.3f}" + (
                "" if r["accountant_goodput"] is None else f", master's accountant: {r['accountant_goodput']:.3f}") + ")"
            print(f"{name:70s} {label:8s} goodput {r['goodput']:.3f}{acc}  wall {r['wall_s']:6.1f} s  kills {r['kills']}  "
                  f"redone steps {r['redone_steps']:3d}  first step {r['first_step_s']:.1f} s  loads {r['loads']}",
                  flush=True)
            print("    launch -> exit from rank 0's step log: " + ", ".join(
                f"{k} {v:.2f} s" for k, v in r["wall_split_s"].items()) +
                f" (median step {r['median_step_s'] * 1000:.1f} ms; steps x median step / wall: "
                f"{r['median_step_goodput']:.3f})", flush=True)
            if r["accountant_split_s"]:
                print(f"    master's split: " + ", ".join(f"{k} {v:.1f} s" for k, v in r["accountant_split_s"].items())
                      + (f"; save_every auto chose {sorted(set(r['save_every_auto']))}" if r["save_every_auto"] else ""),
                      flush=True)
        results[name] = rows
    names = list(results)
    torch = [n for n in names if n.startswith("torch")]
    for name in names:
        if torch and name not in torch:
            ratio = results[name]["failures"]["goodput"] / results[torch[0]]["failures"]["goodput"]
            print(f"{name.split(' (')[0]} / torch goodput with failures: {ratio:.2f}x", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
