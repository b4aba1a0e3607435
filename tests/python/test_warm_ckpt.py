"""Warm restarts in the configuration users run: 2 nodes x 2 workers under
`ballast launch`, real DDP (gloo), a flash checkpoint every step with peer
replicas at their default (1). A fault comes once every node's warm
interpreters are ready (the agents log it); afterwards every node of the
recovered world must start its workers warm ("warm (2 of 2)" in its recovery
timeline), and every rank must resume from the step it saved last, from
memory or a peer's replica, never from disk.

- a worker SIGKILLed: both nodes restart warm, every rank loads the kill step
  from its own memory;
- a node lost (its agent SIGKILLed, its shared memory removed): the survivor
  and the replacement start warm, the survivor's ranks load from memory, the
  replacement's from the replica the survivor holds; the same with a hot
  spare (`--spares 1`), whose interpreters preload what the training nodes'
  workers imported while it waits.

The same runs on the pinned torch 2.x (BALLAST_TORCH2_PYTHON, the venv `make`
builds), where a warm start also needs the modules the workers imported after
their start (DDP imports torch._dynamo) preloaded: the replacement gets the
list from the master, the others from their own workers.

Functional, not timed: the kind of start and the checkpoint source are
asserted, not the seconds.
"""

import os
import re
import subprocess
import time
import unittest

from _util import TestCase, ballast_bin, events, torch2_python, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = ballast_bin()
SCRIPT = os.path.join(HERE, "../integration/scripts/train_ckpt.py")
TORCH1 = "/usr/bin/python3"
WORLD, STEPS = 4, 400
TIMELINE = re.compile(r"recovery timeline \(round (\d+), (.*?) start\).* node=(\S+) round=\d+")



class WarmRestartWithCheckpoints(TestCase):
    def run_job(self, python, fault, spares=0):
        out = os.path.join(self.tmp, fault)
        os.makedirs(out)
        trigger = os.path.join(out, "trigger")
        log_path = os.path.join(out, "launch.log")
        argv = [BIN, "launch", "--python", python, "--nodes", "2", "--nproc-per-node", "2", "--max-restarts", "3",
                *(["--spares", str(spares)] if spares else []),
                SCRIPT, "--out", out, "--ckpt", os.path.join(out, "ckpt"), "--steps", str(STEPS),
                "--step-time", "0.02", "--trigger", trigger, "--kill-rank", "2"]
        if fault == "node-loss":
            argv.append("--kill-rank-node")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    env=dict(os.environ, OMP_NUM_THREADS="1"))
        try:
            def text():
                with open(log_path) as f:
                    return f.read()
            # Both agents' interpreters for the next start are ready (torch
            # and, after the first steps, what the workers imported).
            wait_for("every node's warm interpreters", lambda: len(set(re.findall(
                r"warm interpreters ready for the next \(re\)start \(2 local ranks, [1-9]\d* modules.* node=(\S+)",
                text()))) >= 2 + spares, 150)
            open(trigger, "w").close()
            proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log = text()
        self.assertEqual(proc.returncode, 0, log[-6000:])
        return out, log

    def check(self, out, log, fault):
        kind = "kill" if fault == "worker-kill" else "kill-node"
        killed = events(out, 2, kind)
        self.assertEqual(len(killed), 1, log[-6000:])
        kill_step = killed[0]["step"]
        # Every node of the recovered world started warm.
        starts = {node: (int(rnd), how) for rnd, how, node in TIMELINE.findall(log)}
        self.assertEqual(len(starts), 2, f"recovery timelines: {starts}\n{log[-6000:]}")
        for node, (rnd, how) in starts.items():
            self.assertEqual(how, "warm (2 of 2)", f"node {node}, round {rnd}\n{log[-6000:]}")
        self.assertNotIn("the environment the interpreter started with differs", log)
        # Every rank resumed from the step saved last, from memory (or the
        # replica, on the lost node's replacement), and finished.
        for rank in range(WORLD):
            load = events(out, rank, "load")[-1]
            want = "replica" if fault == "node-loss" and rank in (2, 3) else "memory"
            self.assertEqual((load["step"], load["source"]), (kill_step, want), f"rank {rank}\n{log[-6000:]}")
            done = events(out, rank, "done")
            self.assertEqual(len(done), 1, f"rank {rank}\n{log[-6000:]}")
            self.assertEqual(done[0]["world"], WORLD)
        # One set of final weights (DDP keeps the ranks equal).
        self.assertEqual(len({events(out, r, "done")[0]["sha256"] for r in range(WORLD)}), 1)

    def test_launch_passes_warm_modules_to_every_agent(self):
        bad = subprocess.run([BIN, "launch", "--nodes", "1", "--warm-modules", "numpy,not a module", SCRIPT],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
        self.assertEqual(bad.returncode, 2, bad.stdout)
        self.assertIn("--warm-modules: 'not a module' is not a Python module name", bad.stdout)
        # A module no interpreter can import reaches the agents: they say so
        # and turn warm starts off; the job itself runs, and no worker fails
        # (a worker whose interpreter was taken while still importing runs on).
        out = os.path.join(self.tmp, "modules")
        os.makedirs(out)
        p = subprocess.run([BIN, "launch", "--python", TORCH1, "--nodes", "2", "--nproc-per-node", "1",
                            "--warm-modules", "no_such_module_for_ballast", SCRIPT, "--out", out, "--ckpt",
                            os.path.join(out, "ckpt"), "--steps", "40", "--step-time", "0.05"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stdout[-6000:])
        self.assertNotIn("worker failed", p.stdout)
        self.assertEqual(len(set(re.findall(r"warm restart off for this node: the node's warm interpreter "
                                            r"could not import no_such_module_for_ballast.* node=(\S+)", p.stdout))),
                         2, p.stdout[-6000:])

    def test_worker_kill_restarts_both_nodes_warm(self):
        out, log = self.run_job(TORCH1, "worker-kill")
        self.check(out, log, "worker-kill")

    def test_node_loss_restarts_survivor_and_replacement_warm(self):
        out, log = self.run_job(TORCH1, "node-loss")
        self.check(out, log, "node-loss")

    def test_node_loss_with_a_hot_spare_restarts_the_new_world_warm(self):
        # `ballast launch --spares 1`: a third agent waits outside the world.
        # Its interpreters take in the modules the training nodes publish (the
        # run waits for all three nodes' "ready ... N modules" lines before the
        # fault). The lost node's place goes to the spare that waited longest
        # (node-2, not the lost node's own replacement node-1-2 even when that
        # joined before the loss was declared: it has node-1's lower node
        # rank), which starts warm and loads the lost ranks from the
        # survivor's replica; the replacement stays waiting.
        out, log = self.run_job(TORCH1, "node-loss", spares=1)
        self.check(out, log, "node-loss")
        self.assertRegex(log, r"spare node node-2 takes the place of node node-1 ")
        self.assertIn("starting 3 agent(s) (nodes 2 + 1 spare(s)", log)
        rounds = [int(r) for r in re.findall(r"round=(\d+) starts:", log)]
        self.assertEqual(rounds, [1, 2], "one new round for the loss, none for a node that joins as a spare")

    def test_torch2_worker_kill_restarts_both_nodes_warm(self):
        out, log = self.run_job(torch2_python(), "worker-kill")
        self.check(out, log, "worker-kill")

    def test_torch2_node_loss_restarts_survivor_and_replacement_warm(self):
        out, log = self.run_job(torch2_python(), "node-loss")
        self.check(out, log, "node-loss")


if __name__ == "__main__":
    unittest.main()
