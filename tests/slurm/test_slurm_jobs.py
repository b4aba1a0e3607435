"""`ballast slurm` on a real Slurm: slurmctld and one slurmd per node, each node
in its own network namespace with its own IP and host name (slurm_cluster.py).
Real DDP training on gloo, submitted with sbatch; faults are real: a node's
slurmd and every process on it SIGKILLed, its link taken down.

Each test gets a fresh cluster (it starts in about a second), so a node a test
kills never leaks into the next one.
"""
import glob
import json
import os
import re
import subprocess
import sys
import time
import unittest

from slurm_cluster import SlurmCluster

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from _util import wait_for  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
BIN = os.path.abspath(os.environ.get("BALLAST_BIN", os.path.join(ROOT, "build/bin/ballast")))
PYTHON = os.environ.get("BALLAST_PYTHON", "/usr/bin/python3")
EXAMPLES = os.path.abspath(os.path.join(ROOT, "examples"))
TOKEN = "slurm-test-token"
PORT = 29500  # in the batch host's own network namespace
CKPT_SCRIPT = os.path.abspath(os.path.join(ROOT, "tests/integration/scripts/train_ckpt.py"))


def events(out_dir, kind=None):
    """Every JSON event the ranks wrote (train_ddp.py / train_ckpt.py)."""
    evs = []
    for path in sorted(glob.glob(os.path.join(out_dir, "rank*.jsonl"))):
        rank = int(re.search(r"rank(\d+)\.jsonl$", path).group(1))
        with open(path) as f:
            for line in f:
                if line.strip():
                    e = json.loads(line)
                    e.setdefault("rank", rank)
                    if kind is None or e["event"] == kind:
                        evs.append(e)
    return evs


class SlurmJobTest(unittest.TestCase):
    NODES = 4

    def setUp(self):
        self.cluster = SlurmCluster(nodes=self.NODES).start()
        self.addCleanup(self.cluster.stop)
        self.dir = self.cluster.workdir
        self.out = os.path.join(self.dir, "out")
        os.makedirs(self.out, exist_ok=True)

    def submit(self, nodes, ballast_args, script_args, env=None):
        """sbatch -N nodes --no-kill running `ballast slurm BALLAST_ARGS SCRIPT_ARGS`."""
        self.log_path = os.path.join(self.dir, "job.out")
        script = os.path.join(self.dir, "job.sbatch")
        with open(script, "w") as f:
            f.write("#!/bin/sh\n")
            f.write("exec " + " ".join([BIN, "slurm", "--python", PYTHON, "--port", str(PORT), *ballast_args,
                                        *script_args]) + "\n")
        os.chmod(script, 0o755)
        self.job = self.cluster.sbatch(script, args=["-N", str(nodes), "--no-kill", "-o", self.log_path,
                                                     "-D", self.dir],
                                       env=dict(env or {}, BALLAST_TOKEN=TOKEN))
        return self.job

    def job_log(self):
        try:
            with open(self.log_path) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def wait_done(self, timeout=240):
        try:
            state = self.cluster.wait_job(self.job, timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- job output ---\n{self.job_log()}") from None
        return state

    def wait_step(self, step, ranks, timeout=120):
        """Until each of `ranks` ranks logged a step >= step."""
        def reached():
            best = {}
            for e in events(self.out, "step"):
                best[e["rank"]] = max(best.get(e["rank"], 0), e["step"])
            return len([r for r, s in best.items() if s >= step]) >= ranks
        try:
            wait_for(f"{ranks} ranks at step {step}", reached, timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- job output ---\n{self.job_log()}") from None

    def agent_starts(self, node):
        return len(re.findall(rf"started the agent of node rank \d+ on {node} ", self.job_log()))

    def assert_finished(self, steps, world):
        done = events(self.out, "done")
        log = self.job_log()
        self.assertEqual(len(done), world, log)
        self.assertEqual(sorted(e["rank"] for e in done), list(range(world)), log)
        self.assertTrue(all(e["step"] == steps and e["world"] == world for e in done), (done, log))
        self.assertIn("succeeded", log)

    def train(self, steps, step_time):
        return [os.path.join(EXAMPLES, "train_ddp.py"), "--steps", str(steps), "--step-time", str(step_time),
                "--out", self.out]


class BadInput(SlurmJobTest):
    NODES = 2

    def test_outside_an_allocation_or_with_too_few_nodes_it_says_what_to_submit(self):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
        p = subprocess.run([BIN, "slurm", "--nodes", "2", "--nproc-per-node", "1", "train.py"], env=env,
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("not inside a Slurm allocation (no SLURM_JOB_ID)", p.stderr)
        self.assertIn("sbatch -N NODES --no-kill", p.stderr)
        # 2 nodes allocated, 2 + 1 spare asked for: the job fails at once, saying so.
        self.submit(2, ["--nodes", "2", "--spares", "1", "--nproc-per-node", "1"], self.train(2, 0.1))
        self.assertEqual(self.wait_done(60), "FAILED", self.job_log())
        self.assertIn("--nodes 2 --spares 1 needs 3 nodes, but Slurm job", self.job_log())
        self.assertIn("submit with `sbatch -N 3 --no-kill`", self.job_log())
        self.assertEqual(self.cluster.job_exit_code(self.job), "2:0")


class LostNodes(SlurmJobTest):
    def test_killed_node_is_replaced_by_the_hot_spare_and_never_reused(self):
        self.submit(4, ["--nodes", "3", "--spares", "1", "--nproc-per-node", "2"], self.train(30, 0.3))
        self.wait_step(4, ranks=6)
        # `ballast status` (run on n1, as a step of the job) names nodes by
        # their Slurm node names and shows the one waiting outside the world
        # as the spare.
        status = self.cluster.run(["srun", f"--jobid={self.job}", "--overlap", "-N1", "-n1", "-w", "n1", BIN,
                                   "status", "--master", f"{self.cluster.addr('n1')}:{PORT}"],
                                  env=dict(os.environ, **self.cluster.env, BALLAST_TOKEN=TOKEN), check=False)
        self.assertEqual(status.returncode, 0, status.stdout + status.stderr)
        rows = {line.split()[0]: line.split()[2] for line in status.stdout.splitlines()
                if re.match(r"\s+n\d\s+10\.67\.", line)}
        # The first round waited for every started node: node ranks 0-2 train,
        # rank 3 (n4) is the spare.
        self.assertEqual(rows, {"n1": "training", "n2": "training", "n3": "training", "n4": "spare"}, status.stdout)
        spare, victim = "n4", "n2"
        self.cluster.kill_node(victim)
        killed_at = time.time()
        self.assertEqual(self.wait_done(), "COMPLETED", self.job_log())
        log = self.job_log()
        self.assert_finished(30, world=6)
        # The spare's agent was started once, at the start; the victim's too:
        # its node is never used again.
        self.assertEqual(self.agent_starts(victim), 1, log)
        self.assertEqual(self.agent_starts(spare), 1, log)
        self.assertRegex(log, rf"node {victim} \(node rank \d\) is gone")
        # Said as a promotion: the world stays at 3 nodes, the allocation had its spare.
        self.assertIn(f"spare node {spare} takes the place of node {victim} (the world stays at 3 nodes)", log)
        self.assertNotIn("scale down to 3 nodes", log)
        self.assertNotIn("sbatch -N MAX+SPARES", log)
        last_round = max(e["round"] for e in events(self.out, "start"))
        self.assertGreater(last_round, 1, log)
        self.assertLess(time.time() - killed_at, 240)

    def test_master_process_killed_is_restarted_from_its_journal_and_the_agents_train_on(self):
        journal = os.path.join(self.dir, "journal")
        self.submit(3, ["--nodes", "2", "--spares", "1", "--nproc-per-node", "1", "--journal", journal],
                    self.train(40, 0.2))
        self.wait_step(5, ranks=2)
        pids = re.findall(r"master process pid (\d+) \(incarnation 1\)", self.job_log())
        self.assertEqual(len(pids), 1, self.job_log())
        os.kill(int(pids[0]), 9)  # the master crashes; the batch step (its driver) lives on
        wait_for("the restarted master", lambda: "(incarnation 2)" in self.job_log(), 30)
        self.assertEqual(self.wait_done(), "COMPLETED", self.job_log())
        log = self.job_log()
        self.assert_finished(40, world=2)
        self.assertIn("restarting it from the journal", log)
        self.assertIn("resumed the job from its journal", log)
        # No worker restart, no agent started again: the agents kept training.
        self.assertEqual(len(events(self.out, "start")), 2, log)
        for node in ("n1", "n2", "n3"):
            self.assertEqual(self.agent_starts(node), 1, log)

    def test_without_a_spare_the_job_scales_down_and_finishes(self):
        self.submit(3, ["--nodes", "2:3", "--nproc-per-node", "2"], self.train(30, 0.3))
        self.wait_step(4, ranks=6)
        self.cluster.kill_node("n3")
        self.assertEqual(self.wait_done(), "COMPLETED", self.job_log())
        self.assert_finished(30, world=4)
        log = self.job_log()
        self.assertIn("no free node left in Slurm job", log)
        self.assertEqual(self.agent_starts("n3"), 1, log)


class PreflightCheck(SlurmJobTest):
    NODES = 4

    def test_node_failing_the_check_is_swapped_for_the_spare_and_drained(self):
        # 4 nodes are checked together (the spare too): enough to find the
        # faulty one (with 2 or 3 every grouping pairs it with the others).
        self.submit(4, ["--nodes", "3", "--spares", "1", "--nproc-per-node", "1", "--network-check",
                        "--drain-bad-nodes", "--chaos", "check-fail:node=1"], self.train(6, 0.1))
        self.assertEqual(self.wait_done(), "COMPLETED", self.job_log())
        log = self.job_log()
        self.assert_finished(6, world=3)
        # Node rank 1 (n2) failed the check before training: only one world
        # ever trained, on n1, n3 and the spare n4.
        self.assertEqual(len({e["round"] for e in events(self.out, "start")}), 1, log)
        self.assertEqual({e["world"] for e in events(self.out, "start")}, {3}, log)
        self.assertIn("pre-flight check of 4 nodes (new: n1, n2, n3, n4)", log)
        self.assertIn("n2", re.search(r".*excluded.*", log).group(0), log)
        self.assertEqual(self.agent_starts("n2"), 1, log)
        self.assertIn("drained node n2 in Slurm", log)
        self.assertIn("drain", self.cluster.node_state("n2"))


class Partition(SlurmJobTest):
    NODES = 3

    def test_partitioned_node_is_lost_before_slurm_marks_it_down_and_leaves_no_orphan(self):
        self.submit(3, ["--nodes", "2:3", "--nproc-per-node", "1"], self.train(40, 0.3))
        self.wait_step(4, ranks=3)
        cut_at = time.time()
        self.cluster.link("n3", up=False)
        lost_at = None
        slurm_down_at = None
        deadline = time.time() + 60
        while time.time() < deadline and (lost_at is None or slurm_down_at is None):
            if lost_at is None and re.search(r"node n3 \(node rank 2\) is gone", self.job_log()):
                lost_at = time.time()
            if slurm_down_at is None and "down" in self.cluster.node_state("n3"):
                slurm_down_at = time.time()
            time.sleep(0.2)
        self.assertIsNotNone(lost_at, self.job_log())
        self.assertIsNotNone(slurm_down_at, self.job_log())
        print(f"partition: ballast lost n3 after {lost_at - cut_at:.1f} s, Slurm marked it down after "
              f"{slurm_down_at - cut_at:.1f} s", file=sys.stderr)
        self.assertLess(lost_at, slurm_down_at, self.job_log())
        self.assertEqual(self.wait_done(), "COMPLETED", self.job_log())
        self.assert_finished(40, world=2)
        self.cluster.link("n3", up=True)
        # The partitioned node's step was cancelled: once it hears Slurm again,
        # nothing of the job runs there (slurmd itself stays).
        def no_orphans():
            left = [c[:80] for _, c in self.cluster.processes("n3") if "slurmd" not in c.split(" ")[0]]
            return not left or print(f"still on n3: {left}", file=sys.stderr)
        wait_for("no process of the job left on n3", no_orphans, timeout=60, interval=1)


class FlashCheckpoint(SlurmJobTest):
    NODES = 3
    STEPS = 12

    def run_reference(self):
        ref = os.path.join(self.dir, "ref")
        os.makedirs(ref)
        p = subprocess.run([BIN, "launch", "--python", PYTHON, "--nodes", "2", "--nproc-per-node", "2",
                            CKPT_SCRIPT, "--out", ref, "--ckpt", os.path.join(ref, "ckpt"), "--steps",
                            str(self.STEPS)], capture_output=True, text=True, timeout=240)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return {e["rank"]: e["sha256"] for e in events(ref, "done")}

    def test_survivors_restore_from_memory_replacement_from_disk_bitwise_equal(self):
        want = self.run_reference()
        self.assertEqual(len(want), 4)
        self.submit(3, ["--nodes", "2", "--spares", "1", "--nproc-per-node", "2", "--ckpt-replicas", "0"],
                    [CKPT_SCRIPT, "--out", self.out, "--ckpt", os.path.join(self.dir, "ckpt"), "--steps",
                     str(self.STEPS), "--step-time", "0.4"])
        self.wait_step(4, ranks=4)
        self.cluster.kill_node("n2")
        self.assertEqual(self.wait_done(), "COMPLETED", self.job_log())
        log = self.job_log()
        done = {e["rank"]: e["sha256"] for e in events(self.out, "done")}
        self.assertEqual(done, want, log)
        # A node loss is not a worker restart (TORCHELASTIC_RESTART_COUNT
        # stays 0): each rank loaded twice, at the start and in round 2.
        loads = {}
        for e in sorted(events(self.out, "load"), key=lambda e: e["t"]):
            loads.setdefault(e["rank"], []).append(e["source"])
        self.assertEqual({r: len(v) for r, v in loads.items()}, {0: 2, 1: 2, 2: 2, 3: 2}, log)
        sources = {r: v[-1] for r, v in loads.items()}
        # n1 (ranks 0, 1) survived: memory; the spare n3 took n2's ranks: disk.
        self.assertEqual(sources, {0: "memory", 1: "memory", 2: "disk", 3: "disk"}, log)


if __name__ == "__main__":
    unittest.main()
