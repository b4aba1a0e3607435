"""Paced peer replicas (--ckpt-copy-share) through a node loss: 2 nodes x 2
workers of real DDP (gloo) under `ballast launch`, a flash checkpoint every
step, nothing on disk (--no-persist), and node rank 1 lost at step 45 (its
agent SIGKILLed, its shared memory removed).

With a share of 0.01 the copies to the peer node cost far more than that, so
from the ranks' agreement at step 32 on, every rank asks its agent to send
only the first save of each block of k steps (the same steps on every rank).
The replacement's ranks restore the newest step sent (several saves before
the loss) from the replica on node rank 0, and the survivors find that same
step in their own memory (their stores keep the last replicated steps while
newer saves rotate): no rank reads the disk (there is none), and the final
weights are bit for bit those of an uninterrupted run.
"""

import os
import re
import unittest

from _util import TestCase, assert_resumed_from, events, final_hashes, launch_train_ckpt

WORLD, STEPS, KILL_STEP = 4, 50, 45  # 45: never the first of a block of a power of two
AGREE_STEPS = 32  # save_policy._REPLICA_AGREE_STEPS: the ranks agree at steps 0, 32, 64, ...


class PacedReplicas(TestCase):
    def launch(self, out, *extra, kill=True):
        return launch_train_ckpt(self, out, *extra, steps=STEPS, step_time=0.02, kill_step=KILL_STEP if kill else None,
                                 script_args=["--no-persist"], timeout=200)

    def test_a_lost_node_resumes_from_the_last_paced_replica_with_the_survivors_memory(self):
        ref = os.path.join(self.tmp, "ref")
        self.launch(ref, kill=False)
        want = final_hashes(ref, WORLD)
        self.assertEqual(len(want), WORLD)

        out = os.path.join(self.tmp, "paced")
        log = self.launch(out, "--ckpt-copy-share", "0.01")
        self.assertEqual(len(events(out, 2, "kill-node")), 1, log[-4000:])
        said = re.findall(r"copying a step to the peer nodes at most once every (\d+) step\(s\)", log)
        self.assertTrue(said, log[-6000:])
        k = int(said[0])
        self.assertGreaterEqual(k, 2)
        # Every step before the agreement at step 32 went (k was 1: nothing
        # measured at step 0), then the first of each block of k.
        sent = set(range(AGREE_STEPS)) | {s for s in range(AGREE_STEPS, KILL_STEP + 1) if s // k != (s - 1) // k}
        resume = max(sent)
        print(f"paced replicas: k={k}, the last step sent before the loss at {KILL_STEP}: {resume}")
        self.assertLess(resume, KILL_STEP, f"k={k}")
        for rank in (2, 3):
            self.assertRegex(log, rf"rank {rank} step {resume} copied from the replica on node node-0")
        assert_resumed_from(self, out, log, resume, (2, 3), WORLD)
        self.assertEqual(final_hashes(out, WORLD), want)


if __name__ == "__main__":
    unittest.main()
