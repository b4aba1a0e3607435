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
compared every --check-every steps), chaos-nan (the `nan` chaos drill).

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


def launch(a, flags, script_args, env=None):
    out = tempfile.mkdtemp(prefix="ballast-health-bench-")
    argv = [a.ballast, "launch", "--python", a.python, "--nodes", "2", "--nproc-per-node", "2", *flags,
            "--http-port", "0", SCRIPT, "--out", out, "--steps", str(a.steps), *script_args]
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
    ap.add_argument("--drills", default="nan,spike,sdc,chaos-nan")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    s = a.fault_step
    drills = {
        "nan": ([], ["--nan-step", str(s), "--bad-rank", "1"]),
        "spike": (["--loss-spike", "8"], ["--spike-step", str(s), "--bad-rank", "2"]),
        "sdc": (["--replica-check-every", str(a.check_every), "--chaos", f"bitflip:rank=3,at_step={s}"], []),
        "chaos-nan": (["--chaos", f"nan:rank=0,at_step={s}"], []),
    }
    clean_rc, clean_log, clean_events, clean_wall = launch(a, [], [])
    assert clean_rc == 0, clean_log[-3000:]
    rows = []
    for name in a.drills.split(","):
        flags, script_args = drills[name]
        rc, log, events, wall = launch(a, flags, script_args)
        if rc != 0:
            rows.append({"drill": name, "error": log[-2000:]})
            continue
        skip = re.search(r"samples (\d+:\d+:\d+) are skipped", log)
        ref_sha = clean_events[-1]["sha256"]
        if skip:
            _, _, ref_events, _ = launch(a, [], [], env={"BALLAST_SKIP_DATA": skip.group(1)})
            ref_sha = ref_events[-1]["sha256"]
        det = re.search(r"failure report held for ([\d.]+) s", log)
        status = re.search(r"training resumed ([\d.]+) s after each", log)
        goodput, parts = summary_parts(log)
        starts = [e for e in events if e["ev"] == "start"]
        row = {
            "drill": name,
            "decision_s": float(det.group(1)) if det else 0.0,
            "steps_to_detect": (-s) % a.check_every if name == "sdc" else 0,
            "resumed_s": float(status.group(1)) if status else None,
            "lost_wall_s": wall - clean_wall,
            "resumed_from": (starts[-1]["step"], starts[-1]["source"]),
            "recompute_s": parts.get("recompute", 0.0),
            "restart_s": parts.get("restart", 0.0),
            "goodput_pct": goodput,
            "finite": events[-1]["finite"],
            "same_as_clean": events[-1]["sha256"] == ref_sha,
        }
        rows.append(row)
    costs = step_costs(a.params)
    if a.json:
        print(json.dumps({"clean_wall_s": clean_wall, "drills": rows, "costs": costs}, indent=1))
        return
    print(f"torch {a.python}; 2 nodes x 2 workers; {a.steps} steps; fault at step {a.fault_step}; "
          f"clean job {clean_wall:.2f} s")
    print("| drill | decision after the agent saw it (s) | steps until seen | resumed (s) | wall time lost (s) | "
          "restart / recompute (s) | resumed from | final weights |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['drill']} | failed: {r['error'][-200:]!r} |")
            continue
        ok = ("finite, = clean run" if r["same_as_clean"] else "finite, differ") if r["finite"] else "NaN!"
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
