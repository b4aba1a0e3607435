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
MATRIX = os.path.join(ROOT, "bench", "matrix_train.py")  # DDP until told to stop
sys.path.insert(0, os.path.join(ROOT, "examples"))
from train_events import read_events  # noqa: E402

# Differ between any two jobs, warm or cold.
# BALLAST_JOB_START: when the agent joined (save_every auto's job age).
PER_JOB = {"TORCHELASTIC_RUN_ID", "BALLAST_NODE_ID", "BALLAST_CKPT_SHM", "BALLAST_PROGRESS_SHM", "MASTER_PORT",
           "BALLAST_JOB_START"}


def log_reader(path):
    """A function that returns the file's text now."""
    def text():
        with open(path) as f:
            return f.read()
    return text


def said_after(text, first, then):
    """Whether `then` appears in text after `first` does."""
    start = text.find(first)
    return start >= 0 and text.find(then, start) >= 0


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
        self.assertIn("BALLAST_JOB_START", seen["env"])  # warm and cold alike
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

    def test_a_restart_in_a_fork_sees_the_start_a_cold_one_sees(self):
        """Rank 1's first start fails once the interpreters for the restart are
        ready; the restart's workers are forks of them (the default), the
        interpreters themselves (--no-warm-fork) or new processes
        (--no-warm-restart): the scripts see the same start."""
        seen = {}
        for mode, flags in (("cold", ("--no-warm-restart",)), ("fork", ()), ("nofork", ("--no-warm-fork",))):
            out_dir = os.path.join(self.tmp, mode)
            os.makedirs(out_dir)
            trigger = os.path.join(self.tmp, mode + ".fail")
            log_path = os.path.join(self.tmp, mode + ".log")
            with open(log_path, "w") as log:
                proc = subprocess.Popen([BIN, "run", "--standalone", "--nproc-per-node", "2", "--python", PYTHON,
                                         *flags, PROBE], stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp,
                                        env=dict(os.environ, OUT_DIR=out_dir, FAIL_FIRST=trigger),
                                        start_new_session=True)

            text = log_reader(log_path)

            def ready():
                return mode == "cold" or said_after(text(), "round 1: ", "warm interpreters ready")
            try:
                self.wait_for("the interpreters for the restart", ready, text)
                open(trigger, "w").close()
                proc.wait(timeout=120)
                log = text()
                self.assertEqual(proc.returncode, 0, log[-6000:])
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            taken = re.search(r"warm interpreters taken: (.*) node=\S+ round=2\b", log)
            if mode == "cold":
                self.assertIsNone(taken, log[-6000:])
                self.assertIn(", cold start", log)
            else:
                self.assertIsNotNone(taken, log[-6000:])
                self.assertIn("round 2: ", log)
                self.assertRegex(log, r"round 2: .*, warm \(2 of 2\) start")
                self.assertEqual(len(re.findall(r"\(pid \d+\): forked, ", taken.group(1))),
                                 2 if mode == "fork" else 0, taken.group(0))
            seen[mode] = {rank: self.probe(out_dir, rank, 1) for rank in (0, 1)}
            for rank in (0, 1):
                seen[mode][rank]["env"].pop("OUT_DIR")
                seen[mode][rank]["env"].pop("FAIL_FIRST")
        for rank in (0, 1):
            self.assertEqual(seen["fork"][rank], seen["cold"][rank], f"rank {rank}: a forked restart differs")
            self.assertEqual(seen["nofork"][rank], seen["cold"][rank], f"rank {rank}: a warm restart differs")

    def test_killed_worker_restarts_warm_and_resumes(self):
        out = os.path.join(self.tmp, "out")
        log_path = os.path.join(self.tmp, "train.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen([BIN, "run", "--standalone", "--nproc-per-node", "2", "--python", PYTHON, TRAIN,
                                     "--steps", "400", "--step-time", "0.03", "--out", out],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.tmp)
        try:
            text = log_reader(log_path)

            def ready_for_restart():
                # The interpreter the restart forks may be ready before the
                # round's first step (its preload ends soon after its forks).
                t = text()
                return "start timeline (round 1" in t and "warm interpreters ready" in t
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
                      r"init_process_group called \+\d+ ms, process group up \+\d+ ms, first step \+(\d+) ms", log)
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

    def wait_for(self, what, cond, text, timeout=120):
        """cond()'s first true value, polled; fails naming `what` (and the log) after timeout s."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            v = cond()
            if v:
                return v
            time.sleep(0.02)
        self.fail(f"no {what} within {timeout} s:\n{text()[-6000:]}")

    def test_killed_soon_after_the_first_step_and_again_after_the_restart_restarts_warm_with_ddp_loaded(self):
        """Faults early in a job and on a flapping node: a worker killed a
        second or more after the job's first step, and again right after the
        restart's first step, restarts warm both times, in interpreters that
        had torch and what DDP/FSDP import loaded when they were taken (the
        agent says so per local rank). A fresh cache: no earlier run's module
        list, so the first restart's interpreters have what the pool's DDP/FSDP
        hints name. The first kill waits for the agent's word that the next
        interpreters hold the DDP/FSDP modules (they import at idle priority:
        on a busy machine they take longer; on a quiet one it comes 1-3 s
        after the first step); the second does not: each restart's workers
        are forks of those interpreters, which stay. The test asserts what
        the log says they had, not the clock."""
        out = os.path.join(self.tmp, "out")
        log_path = os.path.join(self.tmp, "train.log")
        env = dict(os.environ, BALLAST_CACHE=os.path.join(self.tmp, "cache"))
        with open(log_path, "w") as log:
            # Trains until told to stop (the stop file), however long the waits.
            proc = subprocess.Popen([BIN, "run", "--standalone", "--nproc-per-node", "2", "--python", PYTHON, MATRIX,
                                     "--out", out, "--step-time", "0.03"],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.tmp,
                                    env=env)

        text = log_reader(log_path)

        def first_step(restart):
            """When every rank made its first step of attempt `restart` (None before)."""
            ts = []
            for rank in (0, 1):
                evs = read_events(out, rank)
                pids = {e["pid"] for e in evs if e["event"] == "start" and e["restart"] == restart}
                steps = [e["t"] for e in evs if e["event"] == "step" and e["pid"] in pids]
                if not steps:
                    return None
                ts.append(steps[0])
            return max(ts)

        def ddp_ready(round_):
            return re.search(r"warm interpreters for the next \(re\)start have torch and the DDP/FSDP modules "
                             rf"\(2 local ranks\) node=\S+ round={round_}\b", text())

        kills = []
        try:
            for restart, delay in ((0, 1.0), (1, 0.3)):
                round_ = restart + 1
                t_first = self.wait_for(f"first step of attempt {restart}", lambda: first_step(restart), text)
                if restart == 0:
                    # The second kill does not wait: the interpreters forked
                    # for the first restart stayed, with what they had.
                    self.wait_for(f"DDP/FSDP modules in the interpreters for the restart after round {round_}",
                                  lambda: ddp_ready(round_), text)
                while time.time() < t_first + delay:
                    time.sleep(0.01)
                victim = [e for e in read_events(out, 1) if e["event"] == "start"][-1]
                self.assertEqual(victim["restart"], restart)
                os.kill(victim["pid"], signal.SIGKILL)
                kills.append(time.time() - t_first)
            self.wait_for("first step after the second restart", lambda: first_step(2), text)
            with open(os.path.join(out, "stop.tmp"), "w") as f:
                f.write(str(max(e["step"] for r in (0, 1) for e in read_events(out, r) if e["event"] == "step") + 3))
            os.replace(os.path.join(out, "stop.tmp"), os.path.join(out, "stop"))
            proc.wait(timeout=120)
            log = text()
            self.assertEqual(proc.returncode, 0, log[-6000:])
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        print(f"\nkilled {kills[0]:.2f} s after the job's first step, {kills[1]:.2f} s after the restart's",
              flush=True)
        for round_ in (2, 3):
            m = re.search(rf"recovery timeline \(round {round_}, (.*?) start\): .*", log)
            self.assertIsNotNone(m, log[-6000:])
            self.assertEqual(m.group(1), "warm (2 of 2)", m.group(0))
            print(m.group(0), flush=True)
            taken = re.search(rf"warm interpreters taken: (.*) node=\S+ round={round_}\b", log)
            self.assertIsNotNone(taken, log[-6000:])
            print(taken.group(0), flush=True)
            for lr in (0, 1):
                rank = re.search(rf"local rank {lr} \(pid \d+\): ([^;]*)", taken.group(1))
                self.assertIsNotNone(rank, taken.group(0))
                self.assertRegex(rank.group(1), r"^forked, torch imported, DDP/FSDP modules preloaded, ",
                                 taken.group(0))
        for rank in (0, 1):
            evs = read_events(out, rank)
            self.assertTrue(any(e["event"] == "done" for e in evs), f"rank {rank} did not finish")
            self.assertEqual(sorted({e["restart"] for e in evs if e["event"] == "start"}), [0, 1, 2], evs)

    def test_the_next_run_preloads_what_the_workers_of_the_last_run_imported(self):
        """What the workers imported outlives the job (a file per python and
        script under BALLAST_CACHE): the next run's first interpreters preload
        it from the start, before anything is learned from its workers."""
        cache = os.path.join(self.tmp, "cache")
        env = {"BALLAST_CACHE": cache}
        rc, first = self.run_job(script=(TRAIN, "--steps", "40", "--step-time", "0.03", "--out",
                                         os.path.join(self.tmp, "out1")), env=env)
        self.assertEqual(rc, 0, first[-6000:])
        self.assertNotIn("an earlier run", first)
        kept = glob.glob(os.path.join(cache, "warm-modules", "*.txt"))
        self.assertEqual(len(kept), 1, kept)
        with open(kept[0]) as f:
            lines = f.read().splitlines()
        self.assertEqual(lines[0], "# ballast warm modules v1")
        self.assertEqual(lines[2], f"# target: {os.path.realpath(TRAIN)}")
        names = [n for n in lines if not n.startswith("#")]
        self.assertIn("torch", names)
        self.assertIn("torch.nn.parallel.distributed", names)  # what DDP needs, on either torch
        self.assertNotIn("train_events", names)  # the script's own modules never
        rc, second = self.run_job(script=(TRAIN, "--steps", "5", "--step-time", "0.03", "--out",
                                          os.path.join(self.tmp, "out2")), env=env)
        self.assertEqual(rc, 0, second[-6000:])
        m = re.search(r"warm interpreters preload the (\d+) modules the workers of an earlier run of (\S+) imported",
                      second)
        self.assertIsNotNone(m, second[-6000:])
        self.assertEqual(int(m.group(1)), len(names))
        self.assertEqual(m.group(2), os.path.realpath(TRAIN))


if __name__ == "__main__":
    unittest.main()
