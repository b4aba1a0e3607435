"""The job master survives its own crash: real processes, real DDP on gloo.

`ballast master --journal DIR` serves two `ballast run` agents training with
a flash checkpoint (persisted every 2 steps, so commits run all the time).
The test SIGKILLs the master at random moments - during the rendezvous,
mid-training, while a worker failure is being handled - and starts it again
with the same command line. Each time:

  - the workers keep training: no worker restarts (one "start" event per
    rank), no round change, restart count 0 at the end (1 in the job where a
    worker was killed too: exactly one restart);
  - the job finishes, every step completes, and `latest` names the newest
    step whose shards are all on disk.

`ballast master --journal` also restarts a master process that died by
itself (its supervisor); a test kills that process twice and checks nobody
has to step in. A further case cuts the journal's tail (a torn write) and corrupts it before a
restart: the master resumes from the last good record.

A rollback survives the master's crash: under `ballast launch --journal`, a
NaN loss at step 6 rolls the job back and drops every checkpoint step from 6
on, step 6's commit included; the master process is SIGKILLed right after
that decision. The restarted master must resume below the rollback: the
rollback round restarts from step 5, and the re-trained step 6 commits again
(a master that replayed step 6's old commit would take it for done).
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

from _util import free_port, wait_for

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("BALLAST_BIN", os.path.join(ROOT, "build", "bin", "ballast"))
PYTHON = os.environ.get("BALLAST_PYTHON", "/usr/bin/python3")
TRAIN = os.path.join(ROOT, "bench", "goodput_train.py")
sys.path.insert(0, os.path.join(ROOT, "examples"))
from train_events import read_events  # noqa: E402

TOKEN = "crash-test-token"
STEPS = 110


class MasterCrashTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ballast-mcrash-")
        self.procs = []
        self.seed = int(os.environ.get("BALLAST_TEST_SEED", str(int(time.time()))))
        self.rng = random.Random(self.seed)
        print(f"\nseed {self.seed} (BALLAST_TEST_SEED reproduces it)", flush=True)

    def tearDown(self):
        if os.environ.get("BALLAST_KEEP_TMP"):
            print(f"kept {self.tmp}")
            self.tmp = "/nonexistent"
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def spawn(self, argv, log_name, env=None):
        log = open(os.path.join(self.tmp, log_name), "a")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.tmp,
                             env={**os.environ, "BALLAST_TOKEN": TOKEN, **(env or {})})
        log.close()
        self.procs.append(p)
        return p

    def log(self, name):
        with open(os.path.join(self.tmp, name), errors="replace") as f:
            return f.read()

    # --- the job ---

    def start_master(self):
        self.master = self.spawn([BIN, "master", "--nnodes", "2", "--host", "127.0.0.1", "--advertise-host",
                                  "127.0.0.1", "--port", str(self.port), "--journal", self.journal,
                                  "--job-id", "crash", "--http-port", "-1"], "master.log")
        wait_for("the master listening", lambda: self.log("master.log").count(": job crash listening on") >= self.master_starts + 1,
                 30)
        self.master_starts += 1

    def kill_master_processes(self):
        # The supervisor and its master process (which dies with it, but
        # asynchronously: the journal must not be written after this returns).
        children = re.findall(r"master process pid (\d+) started", self.log("master.log"))
        os.kill(self.master.pid, signal.SIGKILL)
        self.master.wait()
        if children:
            child = int(children[-1])
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
            wait_for("the master process gone", lambda: not os.path.exists(f"/proc/{child}") or
                     open(f"/proc/{child}/stat").read().split(")")[-1].split()[0] == "Z", 10)

    def kill_master(self, why):
        self.kill_master_processes()
        self.kills.append(why)
        time.sleep(self.rng.uniform(0.2, 2.0))  # down for a while, as a crashed pod is
        self.start_master()

    def start_agent(self, rank, persist_every=2):
        return self.spawn([BIN, "run", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--nnodes", "2",
                           "--nproc-per-node", "1", "--node-rank", str(rank), "--local-addr", "127.0.0.1",
                           "--python", PYTHON, TRAIN, "--out", self.out, "--ckpt-dir", self.ckpt, "--ckpt", "ballast",
                           "--steps", str(STEPS), "--step-time", "0.08", "--state-mb", "2",
                           "--persist-every", str(persist_every)],
                          f"agent{rank}.log")

    def steps(self, rank):
        return max([e["step"] for e in read_events(self.out, rank) if e["event"] == "step"], default=0)

    def begin(self):
        self.port = free_port()
        self.journal = os.path.join(self.tmp, "journal")
        self.out, self.ckpt = os.path.join(self.tmp, "out"), os.path.join(self.tmp, "ckpt")
        os.makedirs(self.out)
        self.master_starts = 0
        self.kills = []
        self.start_master()

    def finish(self, agents, restarts):
        for a in agents:
            a.wait(timeout=120)
        self.master.wait(timeout=30)
        logs = "\n".join(self.log(n)[-3000:] for n in ("master.log", "agent0.log", "agent1.log"))
        for a in agents:
            self.assertEqual(a.returncode, 0, logs)
        self.assertEqual(self.master.returncode, 0, logs)
        self.assertIn(f"job crash succeeded ({restarts} restarts)", self.log("master.log"))
        for rank in (0, 1):
            events = read_events(self.out, rank)
            starts = [e for e in events if e["event"] == "start"]
            self.assertEqual(len(starts), 1 + restarts, (rank, starts, self.kills))
            self.assertEqual(events[-1]["event"], "done", rank)
            done_steps = sorted({e["step"] for e in events if e["event"] == "step"})
            self.assertEqual(done_steps[-1], STEPS)
            # A restart resumes after the step its checkpoint holds ("start" step N: step N is
            # in the checkpoint). A worker killed between saving step N and logging it leaves
            # N unlogged but done; any other gap is a step skipped.
            saved_unlogged = {e["step"] for e in starts if e["step"] > 0}
            self.assertEqual(set(range(done_steps[0], STEPS + 1)) - set(done_steps) - saved_unlogged, set(),
                             f"a step was skipped (restarts from {sorted(saved_unlogged)})")
        # `latest` names the newest step whose shards all reached the disk.
        with open(os.path.join(self.ckpt, "latest")) as f:
            latest = f.read().strip()
        complete = sorted(int(d.split("-")[1]) for d in os.listdir(self.ckpt)
                          if d.startswith("step-") and os.path.exists(os.path.join(self.ckpt, d, "COMPLETE")))
        self.assertTrue(complete, os.listdir(self.ckpt))
        self.assertEqual(int(re.sub(r"\D", "", latest)), complete[-1], (latest, complete))
        self.assertGreaterEqual(complete[-1], STEPS - 10)
        restarted = self.log("master.log").count("resumed the job from its journal")
        self.assertEqual(restarted, len(self.kills), self.kills)
        print(f"master killed {len(self.kills)} times ({', '.join(self.kills)}): the job finished with "
              f"{restarts} restart(s), latest {latest}", flush=True)

    def kill_mid_training(self, n, first=8, last=STEPS - 20):
        marks = sorted(self.rng.sample(range(first, last), n))
        for mark in marks:
            wait_for(f"step {mark}", lambda: self.steps(0) >= mark, 90)
            time.sleep(self.rng.uniform(0, 0.08))  # anywhere within the step, commits included
            self.kill_master(f"step {self.steps(0)}")

    def test_an_agent_the_master_stopped_still_writes_its_memory_to_disk_when_terminated(self):
        # A preemption deletes every pod of the job: one agent gets SIGTERM
        # first and leaves, the master stops the other's round (too few
        # nodes), and that agent's SIGTERM comes a moment later. Its workers
        # never asked for disk (the Checkpointer only named the folder), so
        # the stop wrote nothing; the exit must still write the newest step
        # it holds in memory (seen failing in kubernetes.test_kueue's
        # preemption: the resumed job started from step 0).
        self.begin()
        agents = [self.start_agent(r, persist_every=1000000) for r in (0, 1)]
        wait_for("both ranks at step 5", lambda: min(self.steps(0), self.steps(1)) >= 5, 120)
        os.kill(agents[0].pid, signal.SIGTERM)
        wait_for("the master stopping node 1's round",
                 lambda: "stopping workers: the master stops round" in self.log("agent1.log")
                 or "stopping workers: waiting:" in self.log("agent1.log"), 30)
        os.kill(agents[1].pid, signal.SIGTERM)
        for a in agents:
            self.assertEqual(a.wait(timeout=60), 128 + signal.SIGTERM, self.log("agent0.log") + self.log("agent1.log"))
        log1 = self.log("agent1.log")
        m = re.search(r"breakpoint save: step (\d+) of rank 1 persisted from memory \(the agent got SIGTERM", log1)
        self.assertIsNotNone(m, log1[-4000:])
        step = int(m.group(1))
        self.assertGreaterEqual(step, 4, log1[-4000:])
        self.assertTrue(os.path.exists(os.path.join(self.ckpt, f"step-{step}", "rank-1.ballast")), log1[-4000:])
        # Node 0 wrote its own at its SIGTERM, as before.
        self.assertRegex(self.log("agent0.log"), r"breakpoint save: step \d+ of rank 0 persisted from memory")

    def test_master_killed_during_rendezvous_and_training(self):
        self.begin()
        a0 = self.start_agent(0)
        wait_for("node 0 joined", lambda: "joined" in self.log("master.log"), 30)
        self.kill_master("rendezvous")  # one node in, the other not yet
        a1 = self.start_agent(1)
        self.kill_mid_training(4)
        self.finish([a0, a1], restarts=0)

    def test_master_killed_while_a_worker_failure_is_handled(self):
        self.begin()
        agents = [self.start_agent(0), self.start_agent(1)]
        self.kill_mid_training(2, last=50)
        wait_for("step 60", lambda: self.steps(0) >= 60, 90)
        pid = [e for e in read_events(self.out, 1) if e["event"] == "start"][-1]["pid"]
        os.kill(pid, signal.SIGKILL)
        time.sleep(self.rng.uniform(0, 0.15))  # the report in flight, held or decided
        self.kill_master("a worker failure being handled")
        self.kill_mid_training(1, first=75)  # and once more in the restarted round
        self.finish(agents, restarts=1)

    def test_the_supervisor_restarts_a_crashed_master_by_itself(self):
        # `ballast master --journal` runs the master in a child process and
        # restarts it when it dies: nobody has to start it again.
        self.begin()
        agents = [self.start_agent(0), self.start_agent(1)]
        for mark in sorted(self.rng.sample(range(10, STEPS - 30), 2)):
            wait_for(f"step {mark}", lambda: self.steps(0) >= mark, 90)
            pids = re.findall(r"master process pid (\d+) started", self.log("master.log"))
            os.kill(int(pids[-1]), signal.SIGKILL)  # a crash of the master process, not of its supervisor
            self.kills.append(f"step {self.steps(0)}, pid {pids[-1]}")
            wait_for("the restarted master", lambda: self.log("master.log").count(": job crash listening on") >=
                     self.master_starts + 1, 60)
            self.master_starts += 1
        self.finish(agents, restarts=0)
        self.assertEqual(self.log("master.log").count("restarting it from the journal"), 2)

    def test_torn_and_corrupt_journal_tail_recovers_to_the_last_good_record(self):
        self.begin()
        agents = [self.start_agent(0), self.start_agent(1)]
        for damage in ("torn", "corrupt"):
            wait_for("training", lambda: self.steps(0) >= 20 + 30 * (damage == "corrupt"), 90)
            self.kill_master_processes()
            log = os.path.join(self.journal, "journal.log")
            size = os.path.getsize(log)
            with open(log, "r+b") as f:
                if damage == "torn":
                    f.truncate(size - 5)  # the last record half written
                else:
                    f.seek(size - 3)
                    f.write(b"\xde\xad\xbe")  # bit rot in the last record
            self.kills.append(damage)
            self.start_master()
            self.assertRegex(self.log("master.log"), r"cut off \d+ bytes at the end of .*journal.log")
        self.finish(agents, restarts=0)
        self.assertIn("checksum does not match", self.log("master.log"))

    def test_master_killed_after_a_rollback_resumes_below_the_rollback_step(self):
        # 2 nodes x 2 workers of tests/integration/scripts/health_train.py:
        # every step flash-saved, every third persisted (3, 6, 9, 12), keep 3.
        # Rank 1's batch of step 6 is NaN: the NaN weights are saved at step
        # 6 (and persisted and usually committed) before the loss is reported;
        # the job rolls back to step 5, dropping every step from 6 on.
        script = os.path.join(ROOT, "tests", "integration", "scripts", "health_train.py")
        out, journal = os.path.join(self.tmp, "out"), os.path.join(self.tmp, "journal")
        os.makedirs(out)
        job = self.spawn([BIN, "launch", "--python", PYTHON, "--nodes", "2", "--nproc-per-node", "2",
                          "--journal", journal, "--http-port", "-1", script, "--out", out, "--step-time", "0.3",
                          "--nan-step", "6", "--bad-rank", "1"], "launch.log", env={"OMP_NUM_THREADS": "1"})
        # The rollback round is on disk before the master pushes it to the
        # agents: kill the master process once it did.
        wait_for("the rollback round", lambda: re.search(r"node=node-1 round=2 decision=start_round",
                                                         self.log("launch.log")), 120, interval=0.05)
        log = self.log("launch.log")
        self.assertIn("every checkpoint step from 6 on is dropped everywhere", log)
        pid = int(re.findall(r"master process pid (\d+) \(incarnation", log)[-1])
        os.kill(pid, signal.SIGKILL)
        job.wait(timeout=180)
        log = self.log("launch.log")
        self.assertEqual(job.returncode, 0, log[-8000:])
        self.assertEqual(log.count("resumed the job from its journal"), 1, log[-8000:])
        with open(os.path.join(out, "events.jsonl")) as f:
            events = [json.loads(line) for line in f if line.strip()]
        starts = [e for e in events if e["ev"] == "start"]
        # The rollback round resumed below the bad step, and only once.
        self.assertEqual([(e["round"], e["step"]) for e in starts], [(1, 0), (2, 5)], starts)
        done = events[-1]
        self.assertEqual((done["ev"], done["step"], done["finite"], done["latest"]), ("done", 14, True, 12), done)
        # The re-trained step 6 committed again: it is one of the 3 newest
        # complete steps (keep 3), not an incomplete leftover that retention
        # deleted (which a restarted master that replayed round 1's commit of
        # step 6, as if it still stood, leaves behind).
        ckpt = os.path.join(out, "ckpt")
        complete = sorted(int(d.split("-")[1]) for d in os.listdir(ckpt)
                          if d.startswith("step-") and os.path.exists(os.path.join(ckpt, d, "COMPLETE")))
        self.assertEqual(complete, [6, 9, 12], (os.listdir(ckpt), log[-8000:]))


if __name__ == "__main__":
    unittest.main()
