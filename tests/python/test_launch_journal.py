"""`ballast launch --journal DIR`: the job's master runs in a child process
that the launcher restarts from its journal when it dies. Real processes,
real DDP on gloo with a flash checkpoint persisted every 2 steps.

  - The master process is SIGKILLed twice mid-training: the launcher restarts
    it on the same port, the agents reconnect, the workers keep training (one
    "start" event per rank, restart count 0), the job succeeds and `latest`
    names the newest complete step.
  - With the master in its own process, the launcher still hears of the
    nodes it loses: an agent that hangs (SIGSTOP) is lost by heartbeat
    timeout, and the launcher releases and replaces it; the job succeeds on
    the replacement.
  - A journal that holds another job is refused with a message that says so.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

from _util import wait_for

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("BALLAST_BIN", os.path.join(ROOT, "build", "bin", "ballast"))
PYTHON = os.environ.get("BALLAST_PYTHON", "/usr/bin/python3")
TRAIN = os.path.join(ROOT, "bench", "goodput_train.py")
sys.path.insert(0, os.path.join(ROOT, "examples"))
from train_events import read_events  # noqa: E402


class LaunchJournalTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ballast-ljournal-")
        self.out, self.ckpt = os.path.join(self.tmp, "out"), os.path.join(self.tmp, "ckpt")
        self.journal = os.path.join(self.tmp, "journal")
        os.makedirs(self.out)
        self.proc = None

    def tearDown(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def launch(self, steps, extra=(), env=None):
        log = open(os.path.join(self.tmp, "launch.log"), "a")
        self.proc = subprocess.Popen(
            [BIN, "launch", "--nodes", "2", "--nproc-per-node", "1", "--journal", self.journal, "--http-port", "-1",
             *extra, "--python", PYTHON, TRAIN, "--out", self.out, "--ckpt-dir", self.ckpt, "--ckpt", "ballast",
             "--steps", str(steps), "--step-time", "0.08", "--state-mb", "2", "--persist-every", "2"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.tmp,
            env={**os.environ, **(env or {})})
        log.close()

    def log(self):
        with open(os.path.join(self.tmp, "launch.log"), errors="replace") as f:
            return f.read()

    def steps(self, rank):
        return max([e["step"] for e in read_events(self.out, rank) if e["event"] == "step"], default=0)

    def master_pids(self):
        return [int(p) for p in re.findall(r"master process pid (\d+) \(incarnation", self.log())]

    def test_master_process_killed_twice_mid_training_is_restarted_and_the_workers_train_on(self):
        steps = 100
        self.launch(steps)
        for mark in (15, 55):
            wait_for(f"step {mark}", lambda: self.steps(0) >= mark, 90)
            before = len(self.master_pids())
            os.kill(self.master_pids()[-1], signal.SIGKILL)
            wait_for("the restarted master", lambda: len(self.master_pids()) > before, 30)
        self.proc.wait(timeout=120)
        log = self.log()
        self.assertEqual(self.proc.returncode, 0, log[-4000:])
        self.assertEqual(log.count("restarting it from the journal"), 2, log[-4000:])
        self.assertEqual(log.count("resumed the job from its journal"), 2, log[-4000:])
        self.assertIn("succeeded: 0 worker restart(s), 0 node replacement(s)", log)
        for rank in (0, 1):
            events = read_events(self.out, rank)
            self.assertEqual(len([e for e in events if e["event"] == "start"]), 1, f"rank {rank} restarted")
            self.assertEqual(events[-1]["event"], "done", rank)
            self.assertEqual(self.steps(rank), steps)
        with open(os.path.join(self.ckpt, "latest")) as f:
            latest = int(re.sub(r"\D", "", f.read()))
        complete = sorted(int(d.split("-")[1]) for d in os.listdir(self.ckpt)
                          if d.startswith("step-") and os.path.exists(os.path.join(self.ckpt, d, "COMPLETE")))
        self.assertEqual(latest, complete[-1])
        self.assertGreaterEqual(latest, steps - 10)
        for pid in self.master_pids():
            self.assertFalse(os.path.exists(f"/proc/{pid}") and
                             open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z",
                             f"master process {pid} left behind")

    def test_a_node_the_master_process_loses_is_replaced_by_the_launcher(self):
        self.launch(70, env={"BALLAST_HEARTBEAT_TIMEOUT_S": "2"})
        wait_for("step 10", lambda: self.steps(0) >= 10, 90)
        agent1 = int(re.search(r"local scheduler: started node-1 \(node rank 1, agent 1, pid (\d+)\)", self.log()).group(1))
        os.kill(agent1, signal.SIGSTOP)  # hung: alive, silent
        try:
            wait_for("node-1 replaced", lambda: "replacing it with node-1-2" in self.log(), 60)
        finally:
            try:
                os.kill(agent1, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=150)
        log = self.log()
        self.assertEqual(self.proc.returncode, 0, log[-4000:])
        self.assertIn("1 node replacement(s)", log)
        self.assertRegex(log, r"node-1 \(node rank 1[^)]*\) is gone \(heartbeat timeout\)")

    def test_a_journal_of_another_job_is_refused(self):
        self.launch(3)
        self.proc.wait(timeout=120)
        self.assertEqual(self.proc.returncode, 0, self.log()[-3000:])
        # Same journal, other settings: the journal's job is not silently reset.
        self.launch(3, extra=("--max-restarts", "7"))
        self.proc.wait(timeout=60)
        log = self.log()
        self.assertNotEqual(self.proc.returncode, 0, log[-3000:])
        self.assertIn("the journal holds job", log)


if __name__ == "__main__":
    unittest.main()
