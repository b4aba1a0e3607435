"""ballast.ElasticSampler under `ballast launch`: real DDP training (gloo) that
loses a node mid-training (2 -> 1 node) and gets it back (1 -> 2) still trains
each epoch's samples exactly once.

Which samples count as "seen": those of the steps in the final lineage. Every
round resumes from a checkpoint (scripts/sampler_train.py records in each
checkpoint the round that saved it, its "origin"), so the finished state
descends from a chain of checkpoints: the last round F resumed from step s_F
saved by round Q, so F contributes steps s_F+1 .. end; Q resumed from s_Q
saved by P and contributes s_Q+1 .. s_F; and so on back to the fresh start.
Steps a round trained after the checkpoint the next round resumed from (the
work of a failed round past its last committed step) are not in the lineage:
their effect on the model was thrown away, so the sampler must hand those
samples out again, and counting them would be wrong. A lineage step's log is
complete on every rank because each rank logs a step's indices before its
forward pass, and a checkpoint of step s exists only after the all-reduce of
step s, i.e. after every rank of that round logged it. So: within each epoch,
the samples of the lineage steps over all ranks and rounds must be every
index exactly once (242 samples, batch 4: the remaining count always splits
evenly over 1 or 2 ranks, so there is no padding; test_sampler covers tails).

Node 1's agent SIGKILLs itself 3 s after its workers start (--chaos); launch
starts a replacement, which --network-check (tiny sizes) holds back for its
pre-flight check while the job trains on 1 node (the check starts a last
call, BALLAST_LAST_CALL_S=3, after it joined), then admits: rounds go
2 nodes -> 1 -> 2. Takes about 17 s here.
"""

import collections
import glob
import json
import os
import subprocess
import sys
import time
import unittest

from _util import TestCase

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.environ.get("BALLAST_BIN", os.path.join(HERE, "../../build/bin/ballast"))
if not os.access(BIN, os.X_OK):  # a missing build is a failure, not a skip
    raise RuntimeError(f"no ballast binary at {BIN}: run `make` (or set BALLAST_BIN)")
PYTHON = os.environ.get("BALLAST_PYTHON", "/usr/bin/python3")
SCRIPT = os.path.join(HERE, "scripts", "sampler_train.py")
SIZE, BATCH, EPOCHS = 242, 4, 4


def read_events(out):
    events = []
    for path in glob.glob(os.path.join(out, "rank*.jsonl")):
        with open(path) as f:
            events += [json.loads(line) for line in f if line.strip()]
    return events


def check_lineage(tc, out, epochs=EPOCHS, size=SIZE):
    """Asserts that the steps of the finished state's lineage (module doc)
    trained each epoch's samples exactly once. Returns the lineage
    [(round, world, first step, last step, sampler state resumed)] and the
    rank-steps trained outside it (redone)."""
    events = read_events(out)
    starts = collections.defaultdict(list)
    trains = collections.defaultdict(list)  # round -> train events
    for e in events:
        if e["ev"] == "start":
            starts[e["round"]].append(e)
        elif e["ev"] == "train":
            trains[e["round"]].append(e)
    done = [e for e in events if e["ev"] == "done"]
    tc.assertEqual(len({e["round"] for e in done}), 1, done)
    final = done[0]["round"]
    tc.assertEqual(sorted(e["rank"] for e in done), list(range(done[0]["world"])))
    for rnd, ss in starts.items():  # the ranks of a round resumed from one checkpoint
        tc.assertEqual(len({(s["step"], s["origin"], json.dumps(s["sampler"])) for s in ss}), 1, ss)

    # The lineage, walked back from the finished round: [(round, world, first step, last step)].
    lineage, rnd, hi = [], final, done[0]["step"]
    while True:
        s = starts[rnd][0]
        lineage.append((rnd, s["world"], s["step"] + 1, hi, s["sampler"]))
        if s["origin"] is None:
            tc.assertEqual(s["step"], 0)
            break
        tc.assertLess(s["origin"], rnd)
        rnd, hi = s["origin"], s["step"]
    lineage.reverse()

    seen = collections.defaultdict(list)  # epoch -> indices
    counted = 0
    for rnd, world, lo, hi, _ in lineage:
        by_step = collections.defaultdict(list)
        for e in trains[rnd]:
            if lo <= e["step"] <= hi:
                by_step[e["step"]].append(e)
        tc.assertEqual(sorted(by_step), list(range(lo, hi + 1)), f"round {rnd}")
        for step, es in by_step.items():
            tc.assertEqual(sorted(e["rank"] for e in es), list(range(world)),
                             f"round {rnd} step {step}: one log per rank")
            tc.assertEqual(len({e["epoch"] for e in es}), 1)
            for e in es:
                seen[e["epoch"]] += e["idx"]
                counted += 1
    tc.assertEqual(sorted(seen), list(range(epochs)))
    for epoch, idx in seen.items():
        counts = collections.Counter(idx)
        dup = sorted(i for i, c in counts.items() if c > 1)
        missing = sorted(set(range(size)) - set(counts))
        tc.assertEqual((dup, missing), ([], []), f"epoch {epoch}")
        tc.assertEqual(len(idx), size)

    return lineage, sum(len(v) for v in trains.values()) - counted


class ElasticSamplerUnderLaunch(TestCase):
    def test_scale_down_and_up_mid_epoch_sees_each_sample_once_per_epoch(self):
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        env = dict(os.environ, OMP_NUM_THREADS="1", BALLAST_PRECHECK_MATMUL_SIZE="64",
                   BALLAST_PRECHECK_ALLREDUCE_BYTES="4096", BALLAST_PRECHECK_TIMEOUT_S="90",
                   # The replacement's check starts a last call after it joined: 3 s of 1-node training.
                   BALLAST_LAST_CALL_S="3")
        env.pop("BALLAST_CKPT_SHM", None)
        argv = [BIN, "launch", "--nodes", "1:2", "--nproc-per-node", "1", "--port", "0",
                "--network-check", "--python", PYTHON, "--chaos", "kill-agent:node=1,after=3",
                SCRIPT, "--out", out, "--epochs", str(EPOCHS), "--size", str(SIZE),
                "--batch", str(BATCH), "--step-time", "0.05", "--overlap"]  # overlapped saves, copied by the store's thread
        t0 = time.monotonic()
        p = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=170)
        elapsed = time.monotonic() - t0
        log = p.stdout
        self.assertEqual(p.returncode, 0, log[-6000:])
        self.assertIn("chaos: kill-agent:node=1,after=3 (", log)
        self.assertIn("scale down to 1 nodes", log, log[-6000:])
        self.assertIn("scale up from 1 to 2 nodes", log, log[-6000:])

        lineage, redone = check_lineage(self, out)
        worlds = [w for _, w, _, _, _ in lineage]
        self.assertEqual((worlds[0], worlds[-1]), (2, 2), lineage)
        self.assertIn(1, worlds, lineage)
        resumes = [sd for _, _, _, _, sd in lineage[1:]]
        self.assertTrue(any(0 < sd["position"] < SIZE for sd in resumes),
                        f"no resume in the middle of an epoch: {resumes}")
        print(f"\n  {elapsed:.1f} s; lineage (round, world, steps, resumed at epoch/position): " +
              ", ".join(f"({r}, {w}, {lo}-{hi}, {sd['epoch']}/{sd['position']})"
                        for r, w, lo, hi, sd in lineage) +
              f"; {redone} rank-step(s) trained outside the lineage (redone)", file=sys.stderr)


if __name__ == "__main__":
    unittest.main()
