#!/usr/bin/python3
"""What checkpoint copies cost a CPU-bound step, by --ckpt-copy-nice and --ckpt-copy-share.

bench/goodput_train.py on 2 nodes x 1 worker under `ballast launch` (one
machine, so the replica copies cross loopback), each step a fixed amount of
CPU work (--cpu-work matmuls: the step time shows what competes for the
cores), --state-mb of state per rank flash-saved every step, persisted every
--persist-every steps and copied to the peer node's memory. Runs, one after
the other: no checkpoint (the floor), then the checkpointed job at each
--nices value (0: the persist and replica threads at training's priority)
and each --shares value (the share of the time the persists may take; 1:
every step asked for is written). For each: the median step time (steps
after the first 5, rank 0), its overhead over the floor, how many steps were
written to disk (complete on both ranks) and `latest` at the end.

Not a test: the figures go into notes and docs. With as many workers as
cores the copies compete with training; on a GPU machine they use idle cores.

With --replica-shares, also the save with replicas (nothing persisted) at each
share: the replica copies paced by the share (the log says the interval the
ranks agreed on, from step 32 on; --skip 40 leaves the steps before out).

Run:  /usr/bin/python3 bench/ckpt_pacing_bench.py [--steps 60] [--cpu-work 40] [--state-mb 64] [--nices 0,10,19]
          [--shares 1,0.25] [--parts] [--replica-shares 0.25,0.05] [--skip 5] [--trials 3]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(args, tmp, name, ckpt, nice, persist_every, replicas, share):
    out = os.path.join(tmp, name)
    os.makedirs(out)
    argv = [args.ballast, "launch", "--python", "/usr/bin/python3", "--nodes", "2", "--nproc-per-node", "1",
            "--ckpt-copy-nice", str(nice), "--ckpt-replicas", str(replicas), "--ckpt-copy-share", str(share),
            os.path.join(HERE, "goodput_train.py"),
            "--out", out, "--ckpt-dir", os.path.join(out, "ckpt"), "--ckpt", ckpt, "--steps", str(args.steps),
            "--state-mb", str(args.state_mb), "--persist-every", str(persist_every), "--cpu-work", str(args.cpu_work)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(ROOT, "build", "python"))
    p = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    if p.returncode != 0:
        sys.exit(f"{name}: exit {p.returncode}\n{p.stdout[-4000:]}")
    with open(os.path.join(out, "rank0.jsonl")) as f:
        ev = [json.loads(line) for line in f if line.strip()]
    t = [e["t"] for e in ev if e["event"] == "step"]
    dts = [b - a for a, b in zip(t, t[1:])][args.skip:]
    latest = None
    if ckpt == "ballast" and os.path.exists(os.path.join(out, "ckpt", "latest")):
        with open(os.path.join(out, "ckpt", "latest")) as f:
            latest = f.read().strip()
    written = len(set(re.findall(r"checkpoint step (\d+) durable on all", p.stdout)))
    # The replica interval the ranks agreed on last (1: every saved step).
    said = re.findall(r"copying (?:a step to the peer nodes at most once every (\d+) step|every saved step)", p.stdout)
    every = int(said[-1] or 1) if said else 1
    return statistics.median(dts), latest, written, every


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ballast", default=os.path.join(ROOT, "build", "bin", "ballast"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--cpu-work", type=int, default=40)
    p.add_argument("--state-mb", type=int, default=64)
    p.add_argument("--persist-every", type=int, default=1)
    p.add_argument("--nices", default="0,10,19")
    p.add_argument("--shares", default="1", help="--ckpt-copy-share values (1: every step asked for is written)")
    p.add_argument("--parts", action="store_true",
                   help="also the save alone (no persist, no replica) and the save with replicas, at the first nice")
    p.add_argument("--replica-shares", default="",
                   help="also the save with replicas (no persist) at each of these --ckpt-copy-share values "
                        "(the replica copies paced: ballast.save_policy.ReplicaPace)")
    p.add_argument("--skip", type=int, default=5,
                   help="steps left out of the median at the start (the replica pace is agreed at step 32)")
    p.add_argument("--trials", type=int, default=1, help="runs of each mode, interleaved; medians reported")
    args = p.parse_args()
    nices = [int(n) for n in args.nices.split(",")]
    shares = [float(x) for x in args.shares.split(",")]
    modes = [("no checkpoint", "none", 0, args.persist_every, 1, 1.0)]
    if args.parts:
        modes += [("save only", "ballast", nices[0], 10 ** 9, 0, 1.0),
                  ("save + replica", "ballast", nices[0], 10 ** 9, 1, 1.0)]
    modes += [(f"save + replica, share {float(x):g}", "ballast", nices[0], 10 ** 9, 1, float(x))
              for x in filter(None, args.replica_shares.split(","))]
    modes += [(f"all, nice {n}, share {x:g}", "ballast", n, args.persist_every, 1, x) for n in nices for x in shares]
    got = {m[0]: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="ballast-pacing-") as tmp:
        for trial in range(args.trials):
            for i, (name, ckpt, nice, persist_every, replicas, share) in enumerate(modes):
                step, latest, written, every = run(args, tmp, f"{trial}-{i}", ckpt, nice, persist_every, replicas,
                                                   share)
                got[name].append((step, latest, written))
                replicas_said = f", replicas every {every} step(s)" if replicas and ckpt == "ballast" else ""
                print(f"trial {trial + 1} {name}: median step {step * 1000:.1f} ms, {written} steps written, "
                      f"latest {latest}{replicas_said}", flush=True)
    floor = statistics.median(s for s, _, _ in got["no checkpoint"])
    print(f"\n2 nodes x 1 worker, {args.cpu_work} matmuls a step, {args.state_mb} MB a rank saved every step, "
          f"persisted every {args.persist_every}, replicated to the peer; medians of {args.trials}")
    print(f"{'mode':<26} {'step ms':>8} {'overhead':>9} {'written':>8}  latest at the end")
    for name, *_ in modes:
        step = statistics.median(s for s, _, _ in got[name])
        written = statistics.median(w for _, _, w in got[name])
        latest = ",".join(str(l) for _, l, _ in got[name] if l is not None) or "-"
        print(f"{name:<26} {step * 1000:8.1f} {100 * (step / floor - 1):8.1f}% {written:8g}  {latest}")


if __name__ == "__main__":
    main()
