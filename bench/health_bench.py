"""Training-health drills: what each bad-but-not-crashing fault costs.

For each drill, `ballast launch --nodes 2 --nproc-per-node 2` runs
tests/integration/scripts/health_train.py (DDP over gloo, an ElasticSampler,
flash checkpoints every step with peer replicas, every third persisted) with
the fault, and the same job without it; from the launcher's log:

- detection: the master's failure record (`detection_s`: from the agent
  seeing the bad step to the decision) plus, for the replica check, the steps
  between the fault and the check that saw it;
- resumed: from the decision to every node's first step after the rollback
  (the failure record's `resume_s`);
- training time lost: the faulty job's wall time minus the clean job's (the
  rollback, the replaced node for a corrupt replica, the steps trained again);
- steps trained again, and whether the final weights are finite and equal to
  the clean run (skipping the bad samples where the drill skips them).

Drills: nan (a real NaN batch on rank 1 at step --fault-step), spike (targets
x1000 on rank 2, with --loss-spike 8), sdc (bitflip chaos on rank 3, replicas
compared every --check-every steps), chaos-nan (the `nan` chaos drill), and
the chaos drills kill-worker (rank 1 SIGKILLed), hang (rank 2 SIGSTOPped,
--hang-timeout 3), kill-agent (node 1 lost), kill-master (launch --journal's
master SIGKILLed; the time until the new master serves), slow (3 nodes x 1:
rank 1's forward passes 6x slower, --exclude-stragglers) and disk-full (node
1's next 4 checkpoint writes fail), each at step --fault-step.

Also measures the per-step cost of ballast.step(step, loss=) and of one
parameter fingerprint (ballast.health.fingerprint) on a model of --params
float32 parameters, against that model's forward+backward step on this CPU.

usage: PYTHONPATH=build/python python bench/health_bench.py [--ballast build/bin/ballast]
         [--python /usr/bin/python3] [--steps 30] [--fault-step 12] [--check-every 8] [--json]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests/integration/scripts/health_train.py")


def launch(a, flags, script_args, env=None, nodes=2, nproc=2, steps=None):
    out = tempfile.mkdtemp(prefix="ballast-health-bench-")
    flags = [f.replace("{out}", out) for f in flags]
    argv = [a.ballast, "launch", "--python", a.python, "--nodes", str(nodes), "--nproc-per-node", str(nproc), *flags,
            "--http-port", "0", SCRIPT, "--out", out, "--steps", str(steps or a.steps), *script_args]
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    wall = time.monotonic() - t0
    log = p.stdout + p.stderr
    with open(os.path.join(out, "events.jsonl")) as f:
        events = [json.loads(line) for line in f if line.strip()]
    return p.returncode, log, events, wall


def summary_parts(log):
    m = re.search(r"summary: goodput ([\d.]+)% of ([\d.]+) s \(([^)]*)\)", log)
    parts = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", m.group(3))} if m else {}
    return (float(m.group(1)) if m else None), parts


def step_costs(params):
    import torch
    import ballast
    from ballast import health

    width = int((params / 2) ** 0.5)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width))
    x = torch.randn(32, width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    train_step()
    step_s = min(timeit.repeat(train_step, number=3, repeat=3)) / 3
    fp_s = min(timeit.repeat(lambda: health.fingerprint(model), number=3, repeat=3)) / 3
    n = 100000
    plain = min(timeit.repeat(lambda: ballast.step(5), number=n, repeat=3)) / n
    with_loss = min(timeit.repeat(lambda: ballast.step(5, loss=1.25), number=n, repeat=3)) / n
    return {"params": sum(p.numel() for p in model.parameters()), "train_step_s": step_s, "fingerprint_s": fp_s,
            "step_ns": plain * 1e9, "step_with_loss_ns": with_loss * 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ballast", default=os.path.join(ROOT, "build/bin/ballast"))
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fault-step", type=int, default=12)
    ap.add_argument("--check-every", type=int, default=5,
                    help="replica check interval of the sdc drill (the last agreed step must still be on disk: "
                         "every third step persists, 3 kept)")
    ap.add_argument("--params", type=float, default=25e6)
    ap.add_argument("--drills", default="nan,spike,sdc,chaos-nan,kill-worker,hang,kill-agent,kill-master,slow,"
                                        "disk-full")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    s = a.fault_step
    # name: (launch flags, script args, shape); the slow drill needs 3 nodes
    # (a straggler is compared with the median) and a longer job.
    slow_shape = dict(nodes=3, nproc=1, steps=150)
    drills = {
        "nan": ([], ["--nan-step", str(s), "--bad-rank", "1"], {}),
        "spike": (["--loss-spike", "8"], ["--spike-step", str(s), "--bad-rank", "2"], {}),
        "sdc": (["--replica-check-every", str(a.check_every), "--chaos", f"bitflip:rank=3,at_step={s}"], [], {}),
        "chaos-nan": (["--chaos", f"nan:rank=0,at_step={s}"], [], {}),
        "kill-worker": (["--chaos", f"kill-worker:rank=1,at_step={s}"], [], {}),
        "hang": (["--hang-timeout", "3", "--chaos", f"hang:rank=2,at_step={s}"], [], {}),
        "kill-agent": (["--chaos", f"kill-agent:node=1,at_step={s}"], [], {}),
        "kill-master": (["--journal", "{out}/journal", "--chaos", f"kill-master:at_step={s}"],
                        ["--step-time", "0.1"], {}),
        "slow": (["--exclude-stragglers", "--chaos", f"slow:rank=1,factor=6,at_step={s}"], ["--step-time", "0.03"],
                 slow_shape),
        "disk-full": (["--chaos", f"disk-full:node=1,at_step={s},writes=4"], [], {}),
    }
    cleans = {}

    def clean(script_args, shape):
        key = (tuple(script_args), tuple(sorted(shape.items())))
        if key not in cleans:
            rc, log, events, wall = launch(a, [], script_args, **shape)
            assert rc == 0, log[-3000:]
            cleans[key] = (events, wall)
        return cleans[key]

    clean_events, clean_wall = clean([], {})
    rows = []
    for name in a.drills.split(","):
        flags, script_args, shape = drills[name]
        ref_events, ref_wall = clean([x for x in script_args if x in ("--step-time", "0.1", "0.03")], shape)
        rc, log, events, wall = launch(a, flags, script_args, **shape)
        if rc != 0:
            rows.append({"drill": name, "error": log[-2000:]})
            continue
        skip = re.search(r"samples (\d+:\d+:\d+) are skipped", log)
        ref_sha = ref_events[-1]["sha256"]
        if skip:
            _, _, skip_events, _ = launch(a, [], [], env={"BALLAST_SKIP_DATA": skip.group(1)})
            ref_sha = skip_events[-1]["sha256"]
        # The chaos report's detection time, else the master's hold (the agent saw it at once).
        det = re.search(r"decided ([\d.]+) s after it was seen", log) or re.search(
            r"failure report held for ([\d.]+) s", log)
        if name == "kill-master":  # no failure record: the time until the new master serves
            t = re.findall(r"(\d\d):(\d\d):(\d\d\.\d+)\] \S+ .*(SIGKILL to the master process|resumed the job from "
                           r"its journal)", log)
            secs = [int(h) * 3600 + int(m) * 60 + float(x) for h, m, x, _ in t]
            det = None
            master_back_s = secs[-1] - secs[0] if len(secs) >= 2 else None
        status = re.search(r"training resumed ([\d.]+) s after each", log)
        goodput, parts = summary_parts(log)
        starts = [e for e in events if e["ev"] == "start"]
        row = {
            "drill": name,
            "decision_s": float(det.group(1)) if det else 0.0,
            "steps_to_detect": (-s) % a.check_every if name == "sdc" else 0,
            "resumed_s": float(status.group(1)) if status else None,
            "lost_wall_s": wall - ref_wall,
            "resumed_from": (starts[-1]["step"], starts[-1]["source"]),
            "recompute_s": parts.get("recompute", 0.0),
            "restart_s": parts.get("restart", 0.0),
            "goodput_pct": goodput,
            "finite": events[-1]["finite"],
            "same_as_clean": events[-1]["sha256"] == ref_sha,
        }
        if name == "kill-master":
            row["master_back_s"] = master_back_s
            row["worker_restarts"] = len(starts) - 1
        if name == "disk-full":
            row["failed_writes"] = len(re.findall(r"checkpoint write failed on node", log))
            row["latest"] = events[-1]["latest"]
        rows.append(row)
    costs = step_costs(a.params)
    if a.json:
        print(json.dumps({"clean_wall_s": clean_wall, "drills": rows, "costs": costs}, indent=1))
        return
    print(f"torch {a.python}; 2 nodes x 2 workers; {a.steps} steps; fault at step {a.fault_step}; "
          f"clean job {clean_wall:.2f} s")
    print("| drill | detected and decided (s) | steps until seen | resumed (s) | wall time lost (s) | "
          "restart / recompute (s) | resumed from | final weights |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['drill']} | failed: {r['error'][-200:]!r} |")
            continue
        ok = ("finite, = clean run" if r["same_as_clean"] else "finite, differ") if r["finite"] else "NaN!"
        if "master_back_s" in r:
            ok += f"; master back after {r['master_back_s']:.2f} s, {r['worker_restarts']} worker restart(s)"
        if "failed_writes" in r:
            ok += f"; {r['failed_writes']} failed writes, latest step on disk {r['latest']}"
        print(f"| {r['drill']} | {r['decision_s']:.2f} | {r['steps_to_detect']} | {r['resumed_s']} | "
              f"{r['lost_wall_s']:.2f} | {r['restart_s']:.2f} / {r['recompute_s']:.2f} | "
              f"step {r['resumed_from'][0]} ({r['resumed_from'][1]}) | {ok} |")
    c = costs
    print(f"\nper step: ballast.step {c['step_ns']:.0f} ns, with loss= {c['step_with_loss_ns']:.0f} ns; "
          f"fingerprint of {c['params'] / 1e6:.1f}M params {c['fingerprint_s'] * 1e3:.1f} ms = "
          f"{100 * c['fingerprint_s'] / c['train_step_s']:.1f}% of one training step ({c['train_step_s'] * 1e3:.0f} ms), "
          f"{100 * c['fingerprint_s'] / c['train_step_s'] / 100:.2f}% at --replica-check-every 100")


if __name__ == "__main__":
    main()
