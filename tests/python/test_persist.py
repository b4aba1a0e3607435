"""Persistence: no-agent mode (in-process persister) and the agent channel."""

import os
import subprocess
import sys
import threading
import time
import unittest

import torch

import ballast
from ballast import _ballast
from _util import TestCase, shm_exists


def read_latest(d):
    with open(os.path.join(d, "latest")) as f:
        return int(f.read())


class NoAgent(TestCase):
    def test_persist_and_wait_make_latest_name_the_step(self):
        c = self.checkpointer()
        c.save(7, {"w": torch.arange(5)}, persist=True)
        c.wait()
        self.assertEqual(read_latest(c.dir), 7)
        self.assertEqual(c.latest_step(), 7)
        self.assertTrue(os.path.exists(os.path.join(c.dir, "step-7", "rank-0.ballast")))
        self.assertTrue(os.path.exists(os.path.join(c.dir, "step-7", "COMPLETE")))

    def test_keep_retains_the_newest_complete_steps(self):
        c = self.checkpointer(keep=2)
        for step in range(1, 6):
            c.save(step, {"w": torch.full((3,), step)}, persist=True)
            c.wait()
        steps = sorted(n for n in os.listdir(c.dir) if n.startswith("step-"))
        self.assertEqual(steps, ["step-4", "step-5"])
        self.assertEqual(c.latest_step(), 5)

    def test_unpersisted_saves_stay_in_memory_only(self):
        c = self.checkpointer()
        c.save(1, {"w": torch.ones(1)}, persist=True)
        c.wait()
        c.save(2, {"w": torch.ones(1) * 2})
        c.wait()  # nothing newer was requested
        self.assertEqual((c.latest_step(), c.memory_step()), (1, 2))
        step, s = c.load()
        self.assertEqual((step, c.last_load_source, float(s["w"])), (2, "memory", 2.0))

    def test_disk_newer_than_memory_wins(self):
        a = self.checkpointer()
        a.save(5, {"w": torch.ones(1) * 5}, persist=True)
        a.wait()
        b = self.checkpointer()
        b.save(3, {"w": torch.ones(1) * 3})
        step, s = b.load()
        self.assertEqual((step, b.last_load_source, float(s["w"])), (5, "disk", 5.0))

    def test_memory_saved_as_another_rank_is_not_used(self):
        c = self.checkpointer(rank=0, world_size=1)
        c.save(1, {"w": torch.ones(1)}, persist=True)
        c.wait()
        c.save(2, {"w": torch.ones(1)})
        other = ballast.Checkpointer(c.dir, rank=0, world_size=2, shm=c._store.name)
        self.addCleanup(other.close)
        step, _ = other.load()
        self.assertEqual((step, other.last_load_source), (1, "disk"))

    def test_load_a_given_step_from_disk(self):
        c = self.checkpointer(keep=5)
        for step in (1, 2):
            c.save(step, {"v": step}, persist=True)
            c.wait()
        fresh = self.checkpointer()
        self.assertEqual(fresh.load(step=1), (1, {"v": 1}))
        self.assertEqual(fresh.last_load_source, "disk")
        self.assertEqual(fresh.load(step=9), (None, None))

    def test_two_ranks_commit_only_when_both_are_durable(self):
        r0 = self.checkpointer(rank=0, world_size=2)
        r1 = self.checkpointer(rank=1, world_size=2)
        r0.save(1, {"r": 0}, persist=True)
        r0.wait()
        self.assertIsNone(r0.latest_step())
        r1.save(1, {"r": 1}, persist=True)
        r1.wait()
        self.assertEqual(r0.latest_step(), 1)
        fresh = self.checkpointer(rank=1, world_size=2)
        self.assertEqual(fresh.load(), (1, {"r": 1}))

    def test_close_unlinks_the_shared_memory(self):
        c = ballast.Checkpointer(os.path.join(self.tmp, "c"))
        name = c._store.name
        self.assertTrue(shm_exists(name))
        c.save(1, {"w": torch.ones(3)}, persist=True)
        c.close()  # finishes the pending persist first
        self.assertFalse(shm_exists(name))
        self.assertEqual(ballast.Checkpointer(c.dir).latest_step(), 1)
        with self.assertRaisesRegex(RuntimeError, "closed"):
            c.save(2, {})

    def test_interpreter_exit_unlinks_and_finishes_persisting(self):
        d = os.path.join(self.tmp, "c")
        code = ("import ballast, torch, sys\n"
                f"c = ballast.Checkpointer({d!r})\n"
                "print(c._store.name); sys.stdout.flush()\n"
                "c.save(3, {'w': torch.ones(100)}, persist=True)\n")
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                             text=True, timeout=60)
        name = out.stdout.strip()
        self.assertTrue(name.startswith("/ballast-"))
        self.assertFalse(shm_exists(name))
        self.assertEqual(read_latest(d), 3)


class SimulatedAgent(TestCase):
    """The worker side of the agent channel; the test plays the agent."""

    def setUp(self):
        super().setUp()
        self.name = f"/ballast-test-{os.getpid()}-{id(self)}"
        self.store = _ballast.create_store(self.name)
        self.addCleanup(self.store.close)

    def test_persist_request_goes_to_the_agent(self):
        c = self.checkpointer(keep=4, rank=1, world_size=2, shm=self.name)
        self.assertTrue(c.agent)
        c.save(9, {"w": torch.ones(2)}, persist=True)
        self.assertEqual(self.store.requested_persist_step(), 9)
        self.assertEqual(self.store.get_persist_config(),
                         {"dir": c.dir, "rank": 1, "world_size": 2, "keep": 4})
        with self.assertRaisesRegex(TimeoutError, "ballast run"):
            c.wait(timeout=0.2)
        # The agent persists and marks the step durable.
        threading.Timer(0.1, lambda: self.store.mark_durable(9)).start()
        t0 = time.monotonic()
        c.wait(timeout=10)
        self.assertLess(time.monotonic() - t0, 5)

    def test_agent_persist_error_fails_wait_with_its_message(self):
        c = self.checkpointer(shm=self.name)
        c.save(3, {"w": torch.ones(2)}, persist=True)
        threading.Timer(0.1, lambda: self.store._report_persist_error(
            3, "the agent cannot write step 3 to /x: No space left on device")).start()
        t0 = time.monotonic()
        with self.assertRaisesRegex(OSError, "No space left on device"):
            c.wait(timeout=30)
        self.assertLess(time.monotonic() - t0, 10)
        # An error for an older step does not fail a newer wait.
        c.save(4, {"w": torch.ones(2)}, persist=True)
        threading.Timer(0.1, lambda: self.store.mark_durable(4)).start()
        c.wait(timeout=10)

    def test_env_names_the_store(self):
        os.environ["BALLAST_CKPT_SHM"] = self.name
        self.addCleanup(os.environ.pop, "BALLAST_CKPT_SHM")
        c = self.checkpointer()
        c.save(4, {"w": torch.ones(2)})
        c.close()
        self.assertTrue(shm_exists(self.name))  # the agent's store outlives the worker
        again = self.checkpointer()
        self.assertEqual(again.load()[0], 4)
        self.assertEqual(again.last_load_source, "memory")

    def test_missing_store_says_what_to_do(self):
        with self.assertRaisesRegex(FileNotFoundError, "BALLAST_CKPT_SHM"):
            ballast.Checkpointer(self.tmp, shm="/ballast-test-no-such-store")


if __name__ == "__main__":
    unittest.main()
