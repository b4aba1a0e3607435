"""ballast.step / ballast.progress: the worker side of progress reporting."""
import os
import struct
import subprocess
import sys
import timeit
import unittest
import uuid

import ballast

_MAGIC = 0x33676F7270626C62  # "blbprog3", src/common/progress_cell.h
_CELL = 192  # sizeof(ProgressCell)


def _make_progress_shm(cells):
    """Creates a progress object as the agent does; returns (shm name, path)."""
    name = f"ballast-progress-test-{uuid.uuid4().hex[:8]}"
    path = os.path.join("/dev/shm", name)
    with open(path, "wb") as f:
        f.write(struct.pack("<QQ", _MAGIC, cells) + b"\0" * 48 + b"\0" * (_CELL * cells))
    return "/" + name, path


def _read_cell(path, i):
    with open(path, "rb") as f:
        f.seek(64 + _CELL * i)
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


class LossTest(unittest.TestCase):
    """ballast.step(step, loss=) without an agent: a bad loss raises."""

    def run_steps(self, code, **env):
        full = {k: v for k, v in os.environ.items() if k not in ("BALLAST_PROGRESS_SHM", "BALLAST_CHAOS")}
        full.update(env)
        return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)

    def test_a_nan_raises_outside_an_agent_unless_ignored(self):
        code = ("import ballast, torch\n"
                "ballast.step(1, loss=torch.tensor(0.5))\n"
                "ballast.step(2, loss=float('nan'))\nprint('trained on')")
        r = self.run_steps(code)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("BadLossError: rank 0: non-finite loss (nan) at step 2", r.stderr)
        r = self.run_steps(code, BALLAST_ON_NAN="ignore")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("trained on", r.stdout)
        self.assertIn("(ignored: --on-nan ignore)", r.stderr)

    def test_a_spike_needs_history_and_the_threshold(self):
        code = ("import ballast\n"
                "for s in range(1, 21): ballast.step(s, loss=1.0 + 0.01 * (s % 3))\n"
                "ballast.step(21, loss=1.05)\nprint('small ok')\n"
                "ballast.step(22, loss=9.0)")
        r = self.run_steps(code, BALLAST_LOSS_SPIKE="6")
        self.assertIn("small ok", r.stdout)
        self.assertIn("loss spike at step 22: 9", r.stderr)
        self.assertEqual(self.run_steps(code).returncode, 0)  # spikes are off by default

    def test_chaos_nan_replaces_the_loss_of_its_rank_and_attempt(self):
        code = "import ballast\nfor s in range(5): ballast.step(s, loss=1.0)\nprint('done')"
        r = self.run_steps(code, BALLAST_CHAOS="nan:rank=1,at_step=3", RANK="1")
        self.assertIn("ballast chaos: nan: rank 1 reports a NaN loss at step 3", r.stderr)
        self.assertIn("non-finite loss (nan) at step 3", r.stderr)
        r = self.run_steps(code, BALLAST_CHAOS="nan:rank=1,at_step=3", RANK="0")
        self.assertEqual(r.returncode, 0, r.stderr)
        r = self.run_steps(code, BALLAST_CHAOS="nan:rank=1,at_step=3", RANK="1", TORCHELASTIC_RESTART_COUNT="1")
        self.assertEqual(r.returncode, 0, r.stderr)


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
