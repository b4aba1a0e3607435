"""A worker SIGKILLed in the middle of a save never leaves a torn step: a new
Checkpointer on the same (agent-owned) store loads the previous step."""

import os
import signal
import subprocess
import sys
import time
import unittest

import torch

import ballast
from ballast import _ballast
from _util import TestCase

CHILD = r"""
import os, sys, torch, ballast
ckpt = ballast.Checkpointer(sys.argv[1])            # opens $BALLAST_CKPT_SHM
ckpt.save(1, {"w": torch.arange(1000, dtype=torch.float32), "step": 1})
mode, marker = sys.argv[2], sys.argv[3]
big = {"w": torch.full((int(sys.argv[4]),), 2.0), "step": 2}
if mode == "hook":
    ckpt._store._set_test_pause_before_commit(marker)   # stops after the copy, before commit
    ckpt.save(2, big)
else:
    open(marker, "w").close()                       # the parent kills us after a short delay
    while True:
        ckpt.save(2, big)
"""


class KilledMidSave(TestCase):
    def setUp(self):
        super().setUp()
        self.name = f"/ballast-test-crash-{os.getpid()}-{id(self)}"
        self.store = _ballast.create_store(self.name)  # plays the agent: owns the memory
        self.addCleanup(self.store.close)
        self.dir = os.path.join(self.tmp, "ckpt")
        self.marker = os.path.join(self.tmp, "marker")

    def run_child(self, mode, numel):
        env = dict(os.environ, BALLAST_CKPT_SHM=self.name)
        proc = subprocess.Popen([sys.executable, "-c", CHILD, self.dir, mode, self.marker, str(numel)],
                                env=env)
        self.addCleanup(lambda: (proc.poll() is None and proc.kill(), proc.wait()))
        deadline = time.monotonic() + 60
        while not os.path.exists(self.marker):
            self.assertIsNone(proc.poll(), "child exited early")
            self.assertLess(time.monotonic(), deadline, "child never reached the save")
            time.sleep(0.005)
        return proc

    def kill(self, proc):
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        self.assertEqual(proc.returncode, -signal.SIGKILL)

    def test_killed_between_copy_and_commit_loads_the_previous_step(self):
        proc = self.run_child("hook", 1 << 20)
        self.kill(proc)
        ckpt = self.checkpointer(shm=self.name)
        step, state = ckpt.load()
        self.assertEqual((step, ckpt.last_load_source), (1, "memory"))
        self.assertEqual(state["step"], 1)
        self.assertTrue(torch.equal(state["w"], torch.arange(1000, dtype=torch.float32)))
        # The dead writer's lock is taken over: the restarted worker saves again.
        ckpt.save(3, {"step": 3})
        self.assertEqual(ckpt.load(), (3, {"step": 3}))

    def test_killed_at_a_random_point_of_a_large_save(self):
        proc = self.run_child("loop", 16 << 20)  # 64 MB per save
        time.sleep(0.05)
        self.kill(proc)
        ckpt = self.checkpointer(shm=self.name)
        step, state = ckpt.load()  # checksums verified
        self.assertIn(step, (1, 2))
        self.assertEqual(state["step"], step)
        if step == 2:
            self.assertTrue(bool((state["w"] == 2.0).all()))


if __name__ == "__main__":
    unittest.main()
