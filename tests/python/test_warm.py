"""Warm restart end to end: pre-started interpreters (torch imported) run the
workers, scripts cannot tell a warm start from a cold one, and a restart
after a worker is killed starts warm, in a fraction of a cold start's time."""
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BIN = os.environ.get("BALLAST_BIN", os.path.join(ROOT, "build", "bin", "ballast"))
PYTHON = os.environ.get("BALLAST_PYTHON", "/usr/bin/python3")
PROBE = os.path.join(ROOT, "tests", "integration", "scripts", "start_probe.py")
TRAIN = os.path.join(ROOT, "examples", "train_ddp.py")
sys.path.insert(0, os.path.join(ROOT, "examples"))
from train_events import read_events  # noqa: E402

# Differ between any two jobs, warm or cold.
PER_JOB = {"TORCHELASTIC_RUN_ID", "BALLAST_NODE_ID", "BALLAST_CKPT_SHM", "BALLAST_PROGRESS_SHM", "MASTER_PORT"}


class WarmRestart(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ballast-warm-")

    def run_job(self, *flags, script=(PROBE,), env=None, timeout=120):
        log = os.path.join(self.tmp, f"run-{len(os.listdir(self.tmp))}.log")
        with open(log, "w") as out:
            p = subprocess.run([BIN, "run", "--standalone", "--nproc-per-node", "2", "--python", PYTHON, *flags,
                                *script], stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                               env=dict(os.environ, **(env or {})), cwd=self.tmp)
        with open(log) as f:
            return p.returncode, f.read()

    def probe(self, out_dir, rank, restart):
        with open(os.path.join(out_dir, f"start-rank{rank}-{restart}.json")) as f:
            seen = json.load(f)
        seen["env"] = {k: v for k, v in seen["env"].items() if k not in PER_JOB}
        seen["open_fds"] = [fd for fd in seen["open_fds"] if fd < 512]
        return seen

    def test_scripts_see_the_same_start_warm_and_cold(self):
        cold_dir, warm_dir = os.path.join(self.tmp, "cold"), os.path.join(self.tmp, "warm")
        os.makedirs(cold_dir)
        os.makedirs(warm_dir)
        rc, cold_log = self.run_job("--no-warm-restart", env={"OUT_DIR": cold_dir})
        self.assertEqual(rc, 0, cold_log)
        self.assertIn(", cold start", cold_log)
        rc, warm_log = self.run_job(env={"OUT_DIR": warm_dir})
        self.assertEqual(rc, 0, warm_log)
        self.assertIn(", warm (2 of 2) start", warm_log)
        for rank in (0, 1):
            cold = self.probe(cold_dir, rank, 0)
            warm = self.probe(warm_dir, rank, 0)
            cold["env"].pop("OUT_DIR")
            warm["env"].pop("OUT_DIR")
            self.assertEqual(warm, cold, f"rank {rank}: a warm start differs from a cold one")
            self.assertEqual(warm["name"], "__main__")
            self.assertEqual(warm["argv"], [PROBE])

    def test_killed_worker_restarts_warm_and_resumes(self):
        out = os.path.join(self.tmp, "out")
        log_path = os.path.join(self.tmp, "train.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen([BIN, "run", "--standalone", "--nproc-per-node", "2", "--python", PYTHON, TRAIN,
                                     "--steps", "400", "--step-time", "0.03", "--out", out],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.tmp)
        try:
            def text():
                with open(log_path) as f:
                    return f.read()
            def ready_for_restart():
                t = text()
                started = t.find("start timeline (round 1")
                return started >= 0 and t.find("warm interpreters ready", started) >= 0
            deadline = time.time() + 90
            # The round trains, and the interpreters for the next restart are ready.
            while not ready_for_restart() and time.time() < deadline:
                time.sleep(0.1)
            self.assertTrue(ready_for_restart(), text())
            starts = [e for e in read_events(out, 1) if e["event"] == "start"]
            os.kill(starts[-1]["pid"], signal.SIGKILL)
            proc.wait(timeout=120)
            log = text()
            self.assertEqual(proc.returncode, 0, log)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        m = re.search(r"recovery timeline \(round 2, warm \(2 of 2\) start\): worker failure seen 0 ms, "
                      r"round decision \+\d+ ms, old workers stopped \+\d+ ms, new workers started \+\d+ ms, "
                      r"process group up \+\d+ ms, first step \+(\d+) ms", log)
        self.assertIsNotNone(m, log)
        print(f"\n{m.group(0)}", flush=True)
        # The job's summary: the master's goodput accountant saw the steps,
        # the restart and the steps redone, and its parts add up to the wall.
        s = re.search(r"summary: goodput ([0-9.]+)% of ([0-9.]+) s \(([^)]*)\); 1 worker restart", log)
        self.assertIsNotNone(s, log)
        parts = dict((name, float(sec)) for name, sec in re.findall(r"(\w+) ([0-9.]+) s", s.group(3)))
        self.assertGreater(parts.get("productive", 0), 0, s.group(0))
        self.assertGreater(parts.get("restart", 0), 0, s.group(0))
        self.assertAlmostEqual(sum(parts.values()), float(s.group(2)), delta=0.4)
        self.assertAlmostEqual(float(s.group(1)) / 100, parts["productive"] / float(s.group(2)), delta=0.01)
        for rank in (0, 1):
            evs = read_events(out, rank)
            self.assertTrue(any(e["event"] == "done" for e in evs), f"rank {rank} did not finish")
            restarted = [e for e in evs if e["event"] == "start" and e["restart"] == 1]
            self.assertEqual(len(restarted), 1, evs)
            self.assertGreater(restarted[0]["step"], 0, "resumed from the checkpoint")


if __name__ == "__main__":
    unittest.main()
