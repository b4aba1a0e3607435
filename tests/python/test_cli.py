"""`ballast ckpt ls|inspect|verify|export` end to end, against the real binary;
and the count flags of launch, run, master, slurm and simulate: a negative or
out-of-range value is a usage error that says what to pass."""

import os
import subprocess
import unittest

import torch

import ballast
from _util import TestCase

BIN = os.environ.get("BALLAST_BIN", os.path.join(os.path.dirname(__file__), "../../build/bin/ballast"))
if not os.access(BIN, os.X_OK):  # a missing build is a failure, not a skip
    raise RuntimeError(f"no ballast binary at {BIN}: run `make` (or set BALLAST_BIN)")


class CkptCli(TestCase):
    def setUp(self):
        super().setUp()
        self.dir = os.path.join(self.tmp, "ckpt")
        self.states = {}
        for rank in range(2):
            c = ballast.Checkpointer(self.dir, keep=3, rank=rank, world_size=2)
            for step in (10, 20):
                g = torch.arange(40, dtype=torch.float32).reshape(8, 5) * step
                state = {"model": {"w": ballast.Shard(g[rank * 4:rank * 4 + 4].clone(), (8, 5), (rank * 4, 0)),
                                   "b": torch.full((3,), float(step), dtype=torch.bfloat16)},
                         "opt": {"state": {0: {"m": torch.ones(2, 2) * rank}}, "lr": 0.5},
                         "global_w": g}
                c.save(step, state, persist=True)
                c.wait()
                self.states[(step, rank)] = state
            c.close()

    def ballast(self, *args, rc=0):
        p = subprocess.run([BIN, "ckpt", *args], capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, rc, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}")
        return p.stdout + p.stderr

    def test_ls_lists_steps_and_latest(self):
        out = self.ballast("ls", self.dir)
        self.assertRegex(out, r"10\s+complete\s+2/2")
        self.assertRegex(out, r"20\s+complete\s+2/2.*<- latest")
        self.assertIn("latest: 20", out)

    def test_inspect_prints_entries(self):
        out = self.ballast("inspect", self.dir, "--step", "10", "--rank", "1")
        self.assertIn("step 10", out)
        self.assertIn("saved by rank 1 of 2", out)
        self.assertRegex(out, r"model/w\s+float32\s+\(4, 5\)\s+80\s+shard of \(8, 5\) at \(4, 0\)")
        self.assertRegex(out, r"model/b\s+bfloat16\s+\(3,\)\s+6")
        self.assertRegex(out, r"opt/state/0/m\s+float32\s+\(2, 2\)\s+16")

    def test_verify_passes_then_names_the_corrupt_file(self):
        self.assertIn("4 file(s) in 2 step(s) verified", self.ballast("verify", self.dir))
        bad = os.path.join(self.dir, "step-20", "rank-1.ballast")
        with open(bad, "r+b") as f:
            f.seek(os.path.getsize(bad) - 8)
            f.write(b"\xff" * 8)
        out = self.ballast("verify", self.dir, rc=1)
        self.assertIn(f"CORRUPT  {bad}", out)
        self.assertIn("delete the step directory", out)
        self.assertIn("ok       " + os.path.join(self.dir, "step-20", "rank-0.ballast"), out)

    def test_verify_reports_a_missing_shard_of_a_complete_step(self):
        os.remove(os.path.join(self.dir, "step-10", "rank-0.ballast"))
        self.assertIn("MISSING", self.ballast("verify", self.dir, rc=1))

    def test_export_is_readable_by_plain_torch_load(self):
        out_file = os.path.join(self.tmp, "r1.pt")
        self.ballast("export", self.dir, "--step", "10", "--rank", "1", "--to", out_file)
        got = torch.load(out_file)
        want = self.states[(10, 1)]
        self.assertTrue(torch.equal(got["model"]["w"], want["model"]["w"].tensor))
        self.assertTrue(torch.equal(got["model"]["b"], want["model"]["b"]))
        self.assertTrue(torch.equal(got["opt"]["state"][0]["m"], want["opt"]["state"][0]["m"]))
        self.assertEqual(got["opt"]["lr"], 0.5)

    def test_export_full_assembles_shards(self):
        out_file = os.path.join(self.tmp, "full.pt")
        self.ballast("export", self.dir, "--to", out_file, "--full")  # latest: 20
        got = torch.load(out_file)
        self.assertTrue(torch.equal(got["model"]["w"], self.states[(20, 0)]["global_w"]))

    def test_errors_say_what_to_do(self):
        out = self.ballast("inspect", os.path.join(self.tmp, "nope"), rc=1)
        self.assertIn("not a directory", out)
        empty = os.path.join(self.tmp, "empty")
        os.makedirs(empty)
        self.assertIn("pass --step", self.ballast("inspect", empty, rc=1))
        self.assertIn("no checkpoints", self.ballast("ls", empty))
        out = self.ballast("export", empty, "--to", os.path.join(self.tmp, "x.pt"), rc=1)
        self.assertIn("ballast ckpt ls", out)
        self.assertIn("usage", self.ballast("frobnicate", rc=2))


class CountFlags(unittest.TestCase):
    """Every count-like flag refuses a negative (or too large) value with a
    plain message naming the flag and the value, not CLI11's 309-digit range,
    and before anything starts (no master, no agent)."""

    SCRIPT = "train.py"

    def refused(self, argv, flag, want):
        p = subprocess.run([BIN, *argv], capture_output=True, text=True, timeout=30)
        err = p.stderr
        self.assertEqual(p.returncode, 2, (argv, p.stdout, err))
        self.assertIn(f"{flag} {want}", err, argv)
        self.assertLess(len(err), 400, err)  # one plain line (and the --help hint)
        self.assertNotRegex(err, r"\d{30}", err)
        return err

    def test_job_commands(self):
        # (flag, value, what the message says); launch and slurm share these
        # (cli/job_driver.cc), --spares and --start-nodes are their own.
        job = [("--nproc-per-node", "-1", "must be a positive count (got -1)"),
               ("--nproc_per_node", "0", "must be a positive count (got 0)"),
               ("--nproc-per-node", "99999999999", "must be a positive count, at most 2147483647 (got 99999999999)"),
               ("--max-restarts", "-1", "must be a count of 0 or more (got -1)"),
               ("--node-unit", "-2", "must be a positive count (got -2)"),
               ("--max-replacements", "-1", "must be a count of 0 or more (got -1)"),
               ("--port", "-1", "must be a port from 0 to 65535 (0: any free port) (got -1)"),
               ("--port", "70000", "must be a port from 0 to 65535 (0: any free port) (got 70000)"),
               ("--http-port", "-5", "must be a port from 0 to 65535 (0: any free port), or -1 for off (got -5)"),
               ("--hang-timeout", "-1", "must be a number of seconds >= 0 (got -1)"),
               ("--ckpt-replicas", "-1", "must be a count from 0 to 8 (0: off) (got -1)"),
               ("--max-rollbacks", "-1", "must be a count of 0 or more (got -1)"),
               ("--replica-check-every", "-10", "must be a count of 0 or more (got -10)"),
               ("--spares", "-1", "must be a count of 0 or more (got -1)")]
        for cmd in ("launch", "slurm"):
            for flag, value, want in job:
                with self.subTest(cmd=cmd, flag=flag, value=value):
                    name = flag.replace("_", "-")
                    self.refused([cmd, "--nodes", "2", flag, value, self.SCRIPT], name, want)
        self.refused(["launch", "--nodes", "2", "--start-nodes", "-1", self.SCRIPT], "--start-nodes",
                     "must be a positive count (got -1)")
        self.refused(["launch", "--nodes", "-1", self.SCRIPT], "--nodes", "'-1' is not valid: use N or MIN:MAX")

    def test_master(self):
        for flag, value, want in (("--max-restarts", "-1", "must be a count of 0 or more (got -1)"),
                                  ("--node-unit", "0", "must be a positive count (got 0)"),
                                  ("--port", "-1", "must be a port from 0 to 65535 (0: any free port) (got -1)"),
                                  ("--http-port", "65536",
                                   "must be a port from 0 to 65535 (0: any free port), or -1 for off (got 65536)"),
                                  ("--last-call", "-1", "must be a number of seconds >= 0 (got -1)"),
                                  ("--heartbeat-timeout", "-3", "must be a number of seconds > 0 (got -3)"),
                                  ("--wait-for-nodes", "-1", "must be a number of seconds >= 0 (got -1)"),
                                  ("--max-rollbacks", "-1", "must be a count of 0 or more (got -1)")):
            with self.subTest(flag=flag):
                self.refused(["master", "--nnodes", "1", flag, value], flag, want)
        self.refused(["master", "--nnodes", "-1"], "--nnodes", "'-1' is not valid: use N or MIN:MAX")

    def test_simulate(self):
        for flag, value, want in (("--gpus", "-8", "must be a positive count (got -8)"),
                                  ("--gpus-per-node", "0", "must be a positive count (got 0)"),
                                  ("--steps", "-1", "must be a count of 0 or more (got -1)"),
                                  ("--spares", "-1", "must be a count of 0 or more (got -1)"),
                                  ("--seed", "-1", "must be a count of 0 or more (got -1)"),
                                  ("--node-replacement", "-60", "must be a number of seconds >= 0 (got -60)"),
                                  ("--ballast-restart", "-1", "must be a number of seconds >= 0 (got -1)")):
            with self.subTest(flag=flag):
                self.refused(["simulate", flag, value], flag, want)

    def test_run(self):
        # `ballast run` parses torchrun's flags itself (agent/run_options.cc).
        for flag, value, want in (("--nproc-per-node", "-1", "must be at least 1 (got -1)"),
                                  ("--max-restarts", "-1", "must be >= 0 (got -1)"),
                                  ("--nnodes", "-1", "'-1' is not valid: use N or MIN:MAX"),
                                  ("--node-rank", "-1", "must be >= 0"),
                                  ("--node-unit", "0", "must be at least 1"),
                                  ("--master-port", "-1", "must be in 1..65535"),
                                  ("--hang-timeout", "-1", "must be >= 0 seconds"),
                                  ("--max-rollbacks", "-1", "must be >= 0")):
            with self.subTest(flag=flag):
                self.refused(["run", "--rdzv-endpoint", "127.0.0.1:1", flag, value, self.SCRIPT], flag + ":"
                             if flag != "--nnodes" else flag, want)


if __name__ == "__main__":
    unittest.main()
