"""Training health under `ballast launch`: a bad loss reported with
ballast.step(step, loss=) rolls the whole job back instead of poisoning it.

2 nodes x 2 workers of DDP (gloo), flash checkpoints every step with peer
replicas (the default) and every third step persisted, an ElasticSampler
(tests/integration/scripts/health_train.py). In the first attempt one rank's
batch at step 6 is NaN (a real NaN: after the allreduce every rank's weights
are NaN, and step 6 is saved in memory, replicated and persisted), or scaled
x1000 at step 12 (a loss spike with --loss-spike; spikes need 10 steps of history). The job must roll back to step 5,
skip step 6's samples, and end with exactly the weights of a job that never
saw them (a run with BALLAST_SKIP_DATA set from the start): no NaN, nothing
of the bad step left in memory or on disk. --on-nan fail and --max-rollbacks 0
fail the job with a message naming the rank, node and step; a chaos drill
(--chaos nan:...) is rolled back the same way. A bit flipped in one rank's
weights (--chaos bitflip:...) is found by the replica fingerprints: its node
is excluded and replaced, and the job rolls back to the last step all
replicas agreed on.
"""

import json
import os
import re
import subprocess
import unittest

from _health_job import BIN, GLOBAL_BATCH, SCRIPT, HealthJob


class TrainingHealth(HealthJob):
    def check_rolled_back(self, rc, log, events, out, bad_step, what):
        self.assertEqual(rc, 0, log[-8000:])
        self.assertIn(what, log)
        self.assertIn("rolling back (rollback 1 of 3) to the newest checkpoint before step %d" % bad_step, log)
        skip = "0:%d:%d" % ((bad_step - 1) * GLOBAL_BATCH, bad_step * GLOBAL_BATCH)
        self.assertRegex(log, r"samples %s are skipped" % re.escape(skip))
        starts = [e for e in events if e["ev"] == "start"]
        self.assertEqual(len(starts), 2, starts)
        # The rollback round resumed from the step before the bad one, in memory.
        self.assertEqual((starts[1]["step"], starts[1]["source"], starts[1]["skip"]), (bad_step - 1, "memory", skip))
        done = events[-1]
        self.assertEqual((done["ev"], done["step"], done["finite"]), ("done", 14, True), done)
        # Nothing of the bad history is left: the persisted step 6 was deleted
        # and re-written by the new history (every third step persists).
        self.assertEqual(done["latest"], 12)
        return skip, done

    def test_a_nan_rolls_every_rank_back_and_skips_the_bad_batch(self):
        rc, log, events, out = self.launch("nan", script_args=["--nan-step", "6", "--bad-rank", "1"])
        skip, done = self.check_rolled_back(rc, log, events, out, 6, "non-finite loss (nan) at step 6")
        self.assertRegex(log, r"worker rank 1 \(local rank 1\) on node \S+ \(host [^)]+\)")
        self.assertIn("1 failure (1 nan)", log)
        self.assertEqual(done["sha256"], self.reference(skip)["sha256"],
                         "the rolled-back job must end with the weights of one that never trained the bad batch")

    def test_a_loss_spike_rolls_back_with_loss_spike_on(self):
        rc, log, events, out = self.launch("spike", "--loss-spike", "8",
                                           script_args=["--spike-step", "12", "--bad-rank", "2"])
        skip, done = self.check_rolled_back(rc, log, events, out, 12, "loss spike at step 12")
        self.assertEqual(done["sha256"], self.reference(skip)["sha256"])

    def test_on_nan_fail_and_used_up_rollbacks_fail_naming_rank_node_and_step(self):
        rc, log, _, _ = self.launch("fail", "--on-nan", "fail", script_args=["--nan-step", "4", "--bad-rank", "3"])
        self.assertNotEqual(rc, 0, log[-4000:])
        self.assertIn("job failed: bad loss (--on-nan fail): worker rank 3 (local rank 1) on node", log)
        self.assertIn("non-finite loss (nan) at step 4", log)
        # A chaos drill with no rollbacks allowed: the same report, another limit.
        rc, log, _, _ = self.launch("drill", "--max-rollbacks", "0", "--chaos", "nan:rank=2,at_step=3")
        self.assertNotEqual(rc, 0, log[-4000:])
        self.assertIn("ballast chaos: nan: rank 2 reports a NaN loss at step 3", log)
        self.assertIn("job failed: bad loss after 0 of 0 rollbacks: worker rank 2 (local rank 0)", log)

    def test_a_flipped_bit_excludes_its_node_and_rolls_back_to_the_last_agreed_step(self):
        # Rank 3 (node 1) flips a bit of its weights at step 5; replicas are
        # compared every 4 steps: step 8 disagrees, step 4 was the last that agreed.
        rc, log, events, out = self.launch("sdc", "--replica-check-every", "4",
                                           "--chaos", "bitflip:rank=3,at_step=5")
        self.assertEqual(rc, 0, log[-8000:])
        self.assertIn("ballast chaos: bitflip: rank 3 flipped a bit of", log)
        self.assertRegex(log, r"silent data corruption at step 8: rank 3's parameter fingerprint [0-9a-f]{16} differs "
                              r"from the 3 other replicas'")
        self.assertRegex(log, r"node-1 excluded from the job: its parameters diverged")
        self.assertIn("every checkpoint step from 5 on is dropped", log)
        starts = [e for e in events if e["ev"] == "start"]
        # Step 4 agreed: rank 0 resumes from its pinned copy in memory (the
        # replacement node's ranks from disk: the target was persisted at its
        # check, before the script's own persist of step 6).
        self.assertEqual((starts[-1]["step"], starts[-1]["source"]), (4, "memory"), starts)
        done = events[-1]
        self.assertEqual((done["ev"], done["step"], done["finite"]), ("done", 14, True), done)
        self.assertIn("1 failure (1 sdc)", log)
        # launch --chaos ends with what was injected and what the job did about it.
        self.assertRegex(log, r"chaos: injected bitflip:rank=3,at_step=5; the job responded:\n  [\d.]+ s, round 1: sdc, "
                              r"rank 3 on node node-1 \(node rank 1\): silent data corruption at step 8: .* -> exclude "
                              r"and roll back, waiting for nodes; decided [\d.]+ s after it was seen, training again [\d.]+ s later")
        # No data is skipped for a corrupt replica: the result is the clean run's.
        self.assertEqual(done["sha256"], self.reference("")["sha256"])

    def sdc_rolls_back_to_the_pinned_agreed_step(self, every, flip_rank, flip_step, agreed, steps):
        """3 nodes x 1 worker, nothing persisted by the script: rank flip_rank's
        weights get a flipped bit at flip_step; the next check blames its node,
        which is excluded and replaced. Every rank of the new world must resume
        from the step of the last agreed check (kept pinned in the survivors'
        memory, persisted for the replacement), with exactly the clean run's
        weights of that step, and the job must end with the clean run's."""
        shape = dict(nodes=3, nproc=1)
        job = ("--steps", str(steps), "--persist-every", "0", "--step-time", "0")
        rc, log, events, out = self.launch(f"sdc-{every}", "--replica-check-every", str(every), "--chaos",
                                           f"bitflip:rank={flip_rank},at_step={flip_step}", script_args=job, **shape)
        self.assertEqual(rc, 0, log[-8000:])
        self.assertRegex(log, r"node-%d excluded from the job: its parameters diverged" % flip_rank)
        self.assertIn("every checkpoint step from %d on is dropped" % (agreed + 1), log)
        with open(os.path.join(out, "starts.jsonl")) as f:
            starts = [json.loads(line) for line in f if line.strip()]
        last = max(s["round"] for s in starts)
        resumed = sorted((s for s in starts if s["round"] == last), key=lambda s: s["rank"])
        self.assertEqual([s["rank"] for s in resumed], [0, 1, 2], starts)
        self.assertEqual({s["step"] for s in resumed}, {agreed}, resumed)
        # The survivors from their own memory, the replacement's rank from the
        # disk (nothing else holds its shard of that step).
        self.assertEqual([s["source"] for s in resumed],
                         ["disk" if r == flip_rank else "memory" for r in range(3)], resumed)
        # The clean run, its weights after every step.
        rc, ref_log, ref, _ = self.launch("reference", script_args=job + ("--log-weights",), **shape)
        self.assertEqual(rc, 0, ref_log[-6000:])
        at_agreed = [e["sha256"] for e in ref if e["ev"] == "weights" and e["step"] == agreed]
        self.assertEqual({s["sha256"] for s in resumed}, set(at_agreed), resumed)
        done = events[-1]
        self.assertEqual((done["ev"], done["step"], done["finite"]), ("done", steps, True), done)
        self.assertEqual(done["sha256"], ref[-1]["sha256"])
        return log

    def test_sdc_with_a_check_every_5_steps_resumes_from_the_pinned_agreed_step(self):
        # Node 1 holds node 0's replicas: the excluded node is a survivor's replica partner.
        self.sdc_rolls_back_to_the_pinned_agreed_step(every=5, flip_rank=1, flip_step=7, agreed=5, steps=14)

    def test_sdc_with_a_check_every_100_steps_resumes_from_the_pinned_agreed_step(self):
        # Node 2 holds node 1's replicas and sends its own to node 0; the
        # agreed step (100) is 100 saves old when step 200 disagrees.
        self.sdc_rolls_back_to_the_pinned_agreed_step(every=100, flip_rank=2, flip_step=150, agreed=100, steps=210)

    def test_sdc_without_the_targets_persist_fails_naming_the_uncovered_rank(self):
        # BALLAST_SDC_PERSIST=0 and nothing persisted by the script: the
        # survivors hold step 5 pinned, but nothing holds rank 1's shard of it.
        rc, log, events, out = self.launch("sdc-lost", "--replica-check-every", "5", "--chaos",
                                           "bitflip:rank=1,at_step=7", env={"BALLAST_SDC_PERSIST": "0"},
                                           script_args=("--persist-every", "0", "--step-time", "0"), nodes=3, nproc=1)
        self.assertNotEqual(rc, 0, log[-6000:])
        self.assertIn("every checkpoint step from 6 on is dropped", log)
        self.assertRegex(log, r"CheckpointLostError: ranks 0, 2 hold step 5 in memory, but no checkpoint in memory, "
                              r"in a peer's replica or on disk covers step 5 for ranks 1 of this world of 3")
        self.assertIn("checkpoint-lost", log)
        with open(os.path.join(out, "starts.jsonl")) as f:
            self.assertEqual([json.loads(line)["round"] for line in f if line.strip()].count(1), 3)

    def test_bad_flags_get_a_clear_error(self):
        for flags, want in ((["--on-nan", "retry"], "--on-nan must be rollback, fail or ignore"),
                            (["--loss-spike", "0.5"], "--loss-spike must be a z-score >= 1"),
                            (["--max-rollbacks", "-1"], "--max-rollbacks must be a count of 0 or more (got -1)")):
            p = subprocess.run([BIN, "launch", "--nodes", "1", *flags, SCRIPT], capture_output=True, text=True,
                               timeout=30)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn(want, p.stderr)


if __name__ == "__main__":
    unittest.main()
