"""Chaos drills with step triggers under `ballast launch` (--chaos):
kill-worker, hang, kill-agent (a lost node), kill-master, slow (a runtime
straggler, 3 nodes), disk-full and a network partition (hosts in network
namespaces), each on a 2 nodes x 2 workers DDP job with flash checkpoints every step, peer replicas
and an ElasticSampler (tests/integration/scripts/health_train.py).

Each job must finish with its weights bitwise equal to a run without the
fault (nothing trained twice or skipped, no NaN), blame the injected rank or
node, resume from a step no older than the fault's, and end with a chaos
report saying what was injected and what the job did. The drills of training
health (nan, bitflip) are in test_health.py.
"""

import json
import os
import re
import subprocess
import time
import unittest

from _health_job import BIN, PYTHON, SCRIPT, HealthJob
from _netns import Lan


class ChaosDrills(HealthJob):
    def finished_like_the_clean_run(self, rc, log, events, clean):
        self.assertEqual(rc, 0, log[-8000:])
        done = events[-1]
        self.assertEqual((done["ev"], done["step"], done["finite"]), ("done", clean["step"], True), done)
        self.assertEqual(done["sha256"], clean["sha256"], "the drill must not change what the job trained")
        return [e for e in events if e["ev"] == "start"]

    def test_worker_kill_and_hang_at_a_step_restart_in_place_from_memory(self):
        clean = self.reference("")
        # Rank 1 (node 0) is SIGKILLed at step 5; in the restarted attempt
        # rank 2 (node 1) is SIGSTOPped at step 9 and found by --hang-timeout.
        rc, log, events, _ = self.launch("worker", "--hang-timeout", "3", "--chaos",
                                         "kill-worker:rank=1,at_step=5;hang:rank=2,at_step=9,restart=1")
        starts = self.finished_like_the_clean_run(rc, log, events, clean)
        self.assertRegex(log, r"chaos: kill-worker:rank=1,at_step=5 \(rank 1, pid \d+, at step \d+\): SIGKILL to "
                              r"worker rank 1 node=node-0")
        self.assertRegex(log, r"chaos: hang:rank=2,at_step=9,restart=1 \(rank 2, pid \d+, at step \d+\): SIGSTOP")
        self.assertEqual([s["source"] for s in starts], [None, "memory", "memory"], starts)
        self.assertGreaterEqual(starts[1]["step"], 5)  # nothing saved before the kill is lost
        self.assertGreaterEqual(starts[2]["step"], 9)
        self.assertRegex(log, r"chaos: injected kill-worker:rank=1,at_step=5;hang:rank=2,at_step=9,restart=1; the job "
                              r"responded:\n  [\d.]+ s, round 1: killed, rank 1 on node node-0 \(node rank 0\): killed "
                              r"by SIGKILL \(signal 9\) -> restart; .*\n  [\d.]+ s, round 2: hang, rank 2 on node node-1 "
                              r"\(node rank 1\): hung \(no progress\)", log[-12000:])
        self.assertIn("blaming rank 2 on node node-1 (it did not answer the stack dump", log)
        self.assertIn("2 failures (1 hang, 1 killed)", log)
        # Node 0's ranks only wait for rank 2 in a collective: when its agent
        # sees them hung before rank 2 is killed, it kills none of them (a kill
        # there would make node 1's ranks crash, a report that can beat node 1's).
        for line in re.findall(r"worker hung: no progress .* node=node-0 .*", log):
            self.assertIn("left running: it waits in a collective", line)

    def test_a_node_lost_at_a_step_is_replaced_and_resumes_from_replicas(self):
        clean = self.reference("")
        rc, log, events, _ = self.launch("node", "--chaos", "kill-agent:node=1,at_step=5")
        starts = self.finished_like_the_clean_run(rc, log, events, clean)
        self.assertRegex(log, r"chaos: kill-agent:node=1,at_step=5 \(its workers at step \d+\): SIGKILL to this agent")
        self.assertEqual(len(starts), 2, starts)
        # The replacement seeds ranks 2 and 3 from node 0's replicas of them.
        # The world resumes from the newest step every rank holds in memory
        # (node 0's two newest steps, those replicas) when it is newer than the
        # last persisted step (3 at least), else from that step. The replicas trail node
        # 1's steps by the replication lag (a poll every 25 ms and a copy,
        # against steps of ~20 ms here); on a loaded machine node 0 can be two
        # steps past them, and the step on disk is then the newest step every
        # rank can restore. Either way nothing persisted is lost, and the
        # weights end as in the clean run (above).
        copied = [int(s) for s in re.findall(r"rank [23] step (\d+) copied from the replica on node node-0", log)]
        self.assertEqual(len(copied), 2, log[-12000:])
        if starts[1]["source"] == "memory":
            self.assertIn(starts[1]["step"], range(3, min(copied) + 1), (copied, log[-12000:]))
        else:  # a persisted step (every third)
            self.assertEqual(starts[1]["source"], "disk", log[-12000:])
            self.assertTrue(starts[1]["step"] >= 3 and starts[1]["step"] % 3 == 0, (starts[1], log[-12000:]))
        self.assertRegex(log, r"the job responded:\n  [\d.]+ s, round 1: node-lost, node node-1 \(node rank 1\)")

    def test_the_master_killed_at_a_step_costs_no_worker_restart(self):
        # Periodic progress reaches the master every 2 s (20 steps here): the
        # agents report their step the moment it reaches 6, so the kill comes
        # at step 6, not at the first periodic report after it (~step 21).
        args = ["--steps", "40", "--step-time", "0.1"]
        rc, log, events, out = self.launch("master", "--journal", os.path.join(self.tmp, "journal"), "--chaos", "kill-master:at_step=6",
                                           script_args=args)
        self.assertEqual(rc, 0, log[-8000:])
        for node in ("node-0", "node-1"):
            m = re.search(r"chaos: kill-master:at_step=6 \(its workers at step (\d+)\): reporting this node's step to "
                          rf"the master now node={node}", log)
            self.assertIsNotNone(m, log[-8000:])
            self.assertIn(int(m.group(1)), range(6, 10), m.group(0))  # the agent looks every 50 ms
        m = re.search(r"chaos: kill-master \(every training node at step (\d+) or later\): SIGKILL to the master "
                      r"process", log)
        self.assertIsNotNone(m, log[-8000:])
        self.assertIn(int(m.group(1)), range(6, 10), m.group(0))
        self.assertIn("restarting it from the journal", log)
        self.assertIn("the job master restarted and resumed the job from its journal", log)
        starts = [e for e in events if e["ev"] == "start"]
        self.assertEqual(len(starts), 1, starts)  # the workers never restarted
        self.assertEqual((events[-1]["step"], events[-1]["finite"]), (40, True))
        self.assertIn("the master process died 1 time(s) and was restarted from its journal (worker restarts in "
                      "the whole job: 0)", log)

    def test_a_runtime_straggler_is_excluded_and_replaced(self):
        # 3 nodes (a straggler is compared with the median of the others):
        # rank 1's forward passes take 6x as long from step 10 on. Its node's
        # compute time stands out (the step time is the same on every rank),
        # and --exclude-stragglers replaces it after 3 checks in a row.
        args = ["--steps", "150", "--step-time", "0.03"]
        shape = dict(nodes=3, nproc=1)
        clean = self.reference("", script_args=args, **shape)
        rc, log, events, _ = self.launch("slow", "--exclude-stragglers", "--chaos", "slow:rank=1,factor=6,at_step=10",
                                         script_args=args, **shape)
        starts = self.finished_like_the_clean_run(rc, log, events, clean)
        self.assertIn("ballast chaos: slow: rank 1's forward passes take 6x as long from step 10 on", log)
        self.assertRegex(log, r"node=node-1 round=1 straggler: compute time per forward pass [\d.e-]+ s > 2 x the median")
        self.assertRegex(log, r"node-1 excluded from the job: a straggler at runtime \(--exclude-stragglers\): "
                              r"compute time per forward pass .* for 3 checks in a row")
        self.assertRegex(log, r"replacing it with node-1-2")
        self.assertEqual(len(starts), 2, starts)
        self.assertEqual(starts[1]["source"], "memory")
        self.assertGreater(starts[1]["step"], 10)
        self.assertRegex(log, r"the job responded:\n  [\d.]+ s, round 1: straggler, node node-1 \(node rank 1\)")
        self.assertNotIn("node-0 excluded", log)
        self.assertNotIn("node-2 excluded", log)

    def test_a_full_disk_costs_no_training_and_later_steps_are_written(self):
        # Node 1's disk is full for 4 shard writes from step 4 (steps 6 and 9
        # persist on node 0 only), and rank 2 is killed at step 10: the job
        # restarts from memory, trains on, and step 12 is written everywhere.
        clean = self.reference("")
        rc, log, events, _ = self.launch("disk", "--chaos",
                                         "disk-full:node=1,at_step=4,writes=4;kill-worker:rank=2,at_step=10")
        starts = self.finished_like_the_clean_run(rc, log, events, clean)
        self.assertRegex(log, r"cannot persist checkpoint step 6 to \S+: RESOURCE_EXHAUSTED: No space left on device "
                              r"\(chaos disk-full, \d more failing write\(s\)\) \(attempt 1, retrying in 1 s\) "
                              r"node=node-1 rank=[23]")
        self.assertRegex(log, r"checkpoint write failed on node node-1 \(node rank 1, host [^)]+\) rank [23]: cannot "
                              r"write checkpoint step 6")
        self.assertEqual(len(starts), 2, starts)
        self.assertEqual(starts[1]["source"], "memory")
        self.assertGreaterEqual(starts[1]["step"], 10)
        self.assertEqual(events[-1]["latest"], 12)  # the disk is fine again
        self.assertRegex(log, r"the job responded:\n  [\d.]+ s, round 1: killed, rank 2 on node node-1 .*\n  4 "
                              r"checkpoint write\(s\) failed \(the agents retry them\); training went on")

    def test_a_network_partition_loses_the_node_and_a_spare_takes_its_place(self):
        # Hosts in network namespaces (_netns.Lan): the master on host 0,
        # nodes 0 and 1 on hosts 1 and 2, a spare on host 3 (started once the
        # world trains). Node 1's agent takes its own link down for 8 s at
        # step 15: the master loses its heartbeats, the spare takes its place
        # and the world resumes from memory; the healed node waits as a spare
        # until the job ends.
        args = ["--steps", "60", "--step-time", "0.1"]
        clean = self.reference("", script_args=args)
        out = os.path.join(self.tmp, "partition")
        os.makedirs(out)
        env = dict(os.environ, BALLAST_TOKEN="drill", OMP_NUM_THREADS="1",
                   BALLAST_CHAOS="partition:node=1,at_step=15,for=8")
        logs = {}

        def run(lan, host, argv, name):
            logs[name] = os.path.join(out, name + ".log")
            with open(logs[name], "w") as f:
                return lan.popen(host, argv, stdout=f, stderr=subprocess.STDOUT, env=env)

        with Lan(4) as lan:
            master = run(lan, 0, [BIN, "master", "--nnodes", "2", "--port", "29400"], "master")
            agent = [BIN, "run", "--rdzv-endpoint", f"{lan.addr(0)}:29400", "--nnodes", "2", "--nproc-per-node",
                     "2", "--python", PYTHON]
            procs = [master]
            for host in (1, 2, 3):
                if host == 3:  # the spare joins once the world trains
                    deadline = time.time() + 120
                    while not os.path.exists(os.path.join(out, "events.jsonl")) and time.time() < deadline:
                        time.sleep(0.1)
                procs.append(run(lan, host, agent + ["--node-rank", str(host - 1), SCRIPT, "--out", out, *args],
                                 f"node{host - 1}"))
            rcs = []
            for p in procs:
                try:
                    rcs.append(p.wait(timeout=180))
                except subprocess.TimeoutExpired:
                    rcs.append("hung")
        text = {n: open(f).read() for n, f in logs.items()}
        everything = "".join(f"\n--- {n} ---\n{t[-3000:]}" for n, t in text.items())
        self.assertEqual(rcs, [0, 0, 0, 0], everything)
        self.assertRegex(text["node1"], r"chaos: partition:node=1,at_step=15,for=8 \(its workers at step \d+\): "
                                        r"network interface eth0 \(10\.66\.0\.3\) down for 8 s")
        self.assertIn("up again", text["node1"])
        self.assertRegex(text["master"], r"node=host2-\S+ round=1 lost: heartbeat timeout \(a member of the round\)")
        self.assertRegex(text["master"], r"spare node host3-\S+ takes the place of node host2-")
        self.assertIn("surplus node", text["node1"])  # healed, it waited as a spare
        with open(os.path.join(out, "events.jsonl")) as f:
            events = [json.loads(line) for line in f if line.strip()]
        starts = self.finished_like_the_clean_run(0, everything, events, clean)
        self.assertEqual(len(starts), 2, starts)
        self.assertEqual(starts[1]["source"], "memory")
        self.assertGreaterEqual(starts[1]["step"], 12)

    def test_bad_drills_get_a_clear_error(self):
        for spec, want in (("kill-worker:rank=1", "kill-worker needs exactly one trigger, after=SECONDS or "
                                                   "at_step=STEP"),
                           ("hang:rank=1,after=2,at_step=3", "hang needs exactly one trigger"),
                           ("kill-master:after=3", "--chaos kill-master needs --journal DIR"),
                           ("slow:rank=1,factor=0.5,at_step=3", "slow factor=0.5 is not a valid number > 1"),
                           ("partition:node=0,after=1,for=2", "runs every node on this machine's loopback"),
                           ("slowness:rank=1", 'unknown fault kind "slowness"')):
            p = subprocess.run([BIN, "launch", "--nodes", "1", "--chaos", spec, SCRIPT], capture_output=True,
                               text=True, timeout=30)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn(want, p.stderr)


if __name__ == "__main__":
    unittest.main()
