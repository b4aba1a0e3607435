"""Hugging Face Trainer with Ballast turned on by one line
(callbacks=[BallastCallback(...)], tests/python/hf_train.py), on the pinned
torch 2.x and transformers, under `ballast launch`, 1 node x 2 workers, DDP
over gloo: a worker SIGKILLed after step 6's flash save (every 2nd step, the
memory reserved after the first) restarts, the Trainer
resumes from step 6 in memory through its own resume path (data skip, RNG,
scheduler), and the job ends with the very weights of a run without the fault;
the same after a NaN loss the callback reports (rolled back to step 4).
"""

import json
import os
import subprocess
import unittest

from _util import TestCase, ballast_bin, torch2_python

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = ballast_bin()
SCRIPT = os.path.join(HERE, "hf_train.py")



class HuggingFaceTrainer(TestCase):
    def run_job(self, name, *extra, launch=()):
        out = os.path.join(self.tmp, name)
        os.makedirs(out)
        argv = [BIN, "launch", "--python", torch2_python(), "--nodes", "1", "--nproc-per-node", "2", *launch,
                SCRIPT, "--out", out, "--ckpt", os.path.join(out, "ckpt"), "--steps", "12", *extra]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=240,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        log = p.stdout[-4000:] + p.stderr[-8000:]
        self.assertEqual(p.returncode, 0, log)
        with open(os.path.join(out, "result.json")) as f:
            return json.load(f), log

    def test_worker_kill_resumes_from_memory_with_the_same_result(self):
        clean, _ = self.run_job("clean")
        self.assertEqual((clean["resumed_step"], clean["global_step"], clean["world"]), (None, 12, 2))
        # Saving every 2nd step: after the first step the callback sizes the
        # shared memory for the state (Checkpointer.reserve).
        faulty, log = self.run_job("faulty", "--kill-step", "6", "--save-every", "2")
        self.assertIn("killed by SIGKILL", log)
        self.assertEqual((faulty["resumed_step"], faulty["source"], faulty["global_step"]), (6, "memory", 12), log)
        self.assertIsNone(clean["reserved_bytes"], "saving every step leaves nothing to reserve")
        # The parameters and AdamW's two moments, float32.
        self.assertGreaterEqual(faulty["reserved_bytes"] or 0, 3 * 4 * faulty["params"], faulty)
        self.assertEqual(faulty["sha256"], clean["sha256"], "the resumed run must end with the same weights")
        # save_every="auto:3": Ballast picks the interval (at most 3 steps); the kill at step 6 goes back to
        # the last step it copied, and the steps after it are trained again to the same weights.
        auto, log = self.run_job("auto", "--kill-step", "6", "--save-every", "auto:3")
        self.assertIn("killed by SIGKILL", log)
        self.assertEqual((auto["source"], auto["global_step"]), ("memory", 12), log)
        self.assertIn(auto["resumed_step"], range(3, 7), log)
        self.assertEqual(auto["sha256"], clean["sha256"], "the resumed run must end with the same weights")

    def test_a_nan_loss_rolls_back_to_the_step_before_and_the_run_ends_as_without_it(self):
        # Rank 1 reports a NaN loss at step 5 (the callback passes the
        # Trainer's loss to ballast.step): the job rolls back to step 4 in
        # memory, and the Trainer resumes from there.
        clean, _ = self.run_job("clean")
        rolled, log = self.run_job("nan", launch=("--chaos", "nan:rank=1,at_step=5"))
        self.assertIn("non-finite loss", log)
        self.assertEqual((rolled["resumed_step"], rolled["source"], rolled["global_step"]), (4, "memory", 12), log)
        self.assertEqual(rolled["sha256"], clean["sha256"], "the rolled-back run must end with the same weights")

    def test_example_runs_as_written(self):
        example = os.path.join(HERE, "../../examples/hf_trainer.py")
        p = subprocess.run([BIN, "launch", "--python", torch2_python(), "--nodes", "1", "--nproc-per-node", "2",
                            example, "--ckpt", os.path.join(self.tmp, "ckpt"), "--out", os.path.join(self.tmp, "out"),
                            "--steps", "6"], capture_output=True, text=True, timeout=200,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        log = p.stdout[-3000:] + p.stderr[-6000:]
        self.assertEqual(p.returncode, 0, log)
        self.assertIn("'train_runtime'", p.stdout + p.stderr)  # the Trainer's closing report


if __name__ == "__main__":
    unittest.main()
