"""Validates `ballast simulate` against the real goodput benchmark at the scale
of this machine: one real job (bench/goodput_train.py under `ballast run
--standalone`, 1 node x 2 workers, a worker SIGKILLed every --kill-every s of
compute), then the simulator on the same fault schedule (the kill times), with
its per-event costs measured on that run: the time to the first step, the
mean time from a failure decision to the next first step (the master's
failure records), the step time and the checkpoint stall per step (the
master's accountant). It prints both goodputs and their difference; the issue's
bar is 10%.

  /usr/bin/python3 bench/simulate_validation.py [--steps 60] [--step-time 0.36]
      [--state-mb 64] [--kill-every 5.4]
"""
import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import goodput_bench  # noqa: E402

PY = "/usr/bin/python3"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ballast", default=os.path.join(ROOT, "build", "bin", "ballast"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.36)
    p.add_argument("--state-mb", type=int, default=64)
    p.add_argument("--kill-every", type=float, default=5.4)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args()
    a.torch_every = 10
    kills = max(0, int(a.steps * a.step_time / a.kill_every - 1e-9))
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "build", "python"), OMP_NUM_THREADS="1")
    cmd = [a.ballast, "run", "--standalone", "--nproc-per-node", str(a.nproc), "--python", PY,
           "--max-restarts", str(kills + 2)]
    real = goodput_bench.run(cmd, ["--ckpt", "ballast"], a, kills, env=env)
    with open(os.path.join(real["out"], "launcher.log")) as f:
        log = f.read()
    summary = re.search(r"summary: goodput ([0-9.]+)% of ([0-9.]+) s \(([^)]*)\)", log)
    parts = {k: float(v) for k, v in re.findall(r"(\w+) ([0-9.]+) s", summary.group(3))}
    resumed = re.search(r"training resumed ([0-9.]+) s after each", log)
    kill_times = real["kill_times"]
    # The run's own costs, as the simulator takes them.
    steps_new = a.steps - real["starts"]          # a round's first step counts in its (re)start
    step_s = parts["productive"] / steps_new       # a step without its checkpoint stall
    flash_s = parts.get("checkpoint", 0.0) / real["steps_run"]
    job_start = max(0.0, real["first_step_s"] - step_s)
    restart = max(0.0, float(resumed.group(1)) - step_s) if resumed else 0.0
    faults = ",".join(f"{t:.3f}:process" for t in kill_times)
    sim_cmd = [a.ballast, "simulate", "--gpus", str(a.nproc), "--gpus-per-node", str(a.nproc),
               "--steps", str(a.steps), "--step-time", f"{step_s:.4f}", "--flash-ckpt-cost", f"{flash_s:.4f}",
               "--job-start", f"{job_start:.3f}", "--ballast-restart", f"{restart:.3f}",
               "--policies", "ballast", "--json"] + (["--faults", faults] if faults else ["--failure-rate", "0"])
    sim = json.loads(subprocess.run(sim_cmd, capture_output=True, text=True, check=True).stdout)
    sim_goodput = sim["policies"]["ballast"]["goodput"]
    real_goodput = real["step_log_goodput"]
    accountant = float(summary.group(1)) / 100
    print(f"real job: {a.steps} steps x {a.step_time} s, {a.state_mb} MiB/rank, 1 node x {a.nproc}, "
          f"{len(kill_times)} kills at {', '.join(f'{t:.1f}' for t in kill_times)} s; wall {real['wall_s']:.1f} s, "
          f"goodput {real_goodput:.3f} (step log), {accountant:.3f} (master's accountant)")
    print(f"measured costs: first step {real['first_step_s']:.2f} s, step {step_s:.3f} s + checkpoint stall "
          f"{flash_s:.3f} s, failure decision -> next first step {resumed.group(1) if resumed else '-'} s")
    print("simulator: " + " ".join(sim_cmd[1:]))
    print(f"simulated goodput {sim_goodput:.3f} (wall {sim['policies']['ballast']['wall_s']:.1f} s) vs real "
          f"{real_goodput:.3f} (step log): {100 * (sim_goodput - real_goodput) / real_goodput:+.1f}%, "
          f"vs {accountant:.3f} (accountant): {100 * (sim_goodput - accountant) / accountant:+.1f}%")


if __name__ == "__main__":
    sys.exit(main())
