"""ballast.step / ballast.progress: the worker side of progress reporting."""
import os
import struct
import subprocess
import sys
import timeit
import unittest
import uuid

import ballast

_MAGIC = 0x32676F7270626C62  # "blbprog2", src/common/progress_cell.h


def _make_progress_shm(cells):
    """Creates a progress object as the agent does; returns (shm name, path)."""
    name = f"ballast-progress-test-{uuid.uuid4().hex[:8]}"
    path = os.path.join("/dev/shm", name)
    with open(path, "wb") as f:
        f.write(struct.pack("<QQ", _MAGIC, cells) + b"\0" * 48 + b"\0" * (64 * cells))
    return "/" + name, path


def _read_cell(path, i):
    with open(path, "rb") as f:
        f.seek(64 + 64 * i)
        return struct.unpack("<QQQQ", f.read(32))  # step, timestamp_ns, checkpoint_ns, reports


def _run(code, env):
    full = dict(os.environ)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


class StepTest(unittest.TestCase):
    def test_without_agent_records_locally(self):
        ballast.step(7)
        st = ballast.progress.state()
        self.assertEqual(st["step"], 7)
        self.assertGreater(st["timestamp_ns"], 0)
        if not os.environ.get("BALLAST_PROGRESS_SHM"):
            self.assertEqual(st["cell"], "local")

    def test_rejects_negative_and_non_integer_steps(self):
        with self.assertRaises(ValueError):
            ballast.step(-1)
        with self.assertRaises(TypeError):
            ballast.step("3")

    def test_checkpointing_marks_the_cell(self):
        with ballast.progress.checkpointing():
            self.assertGreater(ballast.progress.state()["checkpoint_ns"], 0)
        self.assertEqual(ballast.progress.state()["checkpoint_ns"], 0)

    def test_writes_the_agents_cell_of_its_local_rank(self):
        name, path = _make_progress_shm(2)
        try:
            r = _run("import ballast\nballast.step(41)\nballast.step(42)\n"
                     "with ballast.progress.checkpointing(): pass\n"
                     "print(ballast.progress.state()['cell'])",
                     {"BALLAST_PROGRESS_SHM": name, "LOCAL_RANK": "1"})
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stdout.strip(), f"{name}#1")
            step, ts, ckpt, reports = _read_cell(path, 1)
            self.assertEqual((step, ckpt, reports), (42, 0, 2))
            self.assertGreater(ts, 0)
            self.assertEqual(_read_cell(path, 0), (0, 0, 0, 0))
        finally:
            os.unlink(path)

    def test_cell_index_out_of_range_falls_back_to_local(self):
        name, path = _make_progress_shm(1)
        try:
            r = _run("import ballast\nballast.step(1)\nprint(ballast.progress.state()['cell'])",
                     {"BALLAST_PROGRESS_SHM": name, "LOCAL_RANK": "3"})
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stdout.strip(), "local")
        finally:
            os.unlink(path)

    def test_cheap_enough_for_every_step(self):
        n = 200_000
        best = min(timeit.repeat("step(5)", "import ballast; step = ballast.step", number=n, repeat=3)) / n
        print(f"\nballast.step: {best * 1e9:.0f} ns per call")
        self.assertLess(best, 2e-6)  # generous: ~50 ns on an idle machine


class StackDumpHandlerTest(unittest.TestCase):
    def test_sigusr1_dumps_stacks_only_under_an_agent(self):
        code = ("import os, signal, time, ballast\n"
                "def waiting_here():\n"
                "    os.kill(os.getpid(), signal.SIGUSR1)\n"
                "    time.sleep(0.2)\n"
                "waiting_here()\nprint('alive')")
        r = _run(code, {"BALLAST_NODE_ID": "n1"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("alive", r.stdout)
        self.assertIn("most recent call first", r.stderr)
        self.assertIn("waiting_here", r.stderr)
        env = {k: v for k, v in os.environ.items() if k != "BALLAST_NODE_ID"}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, -10)  # SIGUSR1's default action: plain scripts keep it


if __name__ == "__main__":
    unittest.main()
