"""Addresses that work across hosts: a master and agents on different hosts.

Each host is a network namespace with its own IP and host name and no DNS
(_netns.Lan), as a new user would try it: a master on one host and an agent
on each of two others, `ballast run --rdzv-endpoint MASTER_IP:PORT ...`.
Before the fix, the workers got node 0's host name as MASTER_ADDR, the other
host could not resolve it, and the job hung in init_process_group.
"""
import glob
import json
import os
import re
import subprocess
import time
import unittest

from _netns import Lan
from _util import TestCase

BIN = os.environ.get("BALLAST_BIN", os.path.join(os.path.dirname(__file__), "../../build/bin/ballast"))
PYTHON = os.environ.get("BALLAST_PYTHON", "/usr/bin/python3")
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../examples")
TOKEN = "crosshost-token"
PORT = 29400


class CrossHost(TestCase):
    def start_master(self, lan, nnodes):
        with open(os.path.join(self.tmp, "master.log"), "w") as out:
                return lan.popen(0, [BIN, "master", "--nnodes", nnodes, "--port", str(PORT), "--token", TOKEN],
                             stdout=out, stderr=subprocess.STDOUT)

    def start_agent(self, lan, host, node_rank, extra=(), script=None, env_extra=None):
        env = dict(os.environ, BALLAST_TOKEN=TOKEN, **(env_extra or {}))
        script = script or [os.path.join(EXAMPLES, "train_ddp.py"), "--steps", "6", "--step-time", "0.05",
                            "--out", os.path.join(self.tmp, "out")]
        with open(os.path.join(self.tmp, f"agent{node_rank}.log"), "w") as out:
            return lan.popen(host, [BIN, "run", "--rdzv-endpoint", f"{lan.addr(0)}:{PORT}", "--nnodes", "2",
                                    "--nproc-per-node", "2", "--node-rank", str(node_rank), "--python", PYTHON,
                                    *extra, *script],
                             stdout=out, stderr=subprocess.STDOUT, env=env)

    def log(self, name):
        with open(os.path.join(self.tmp, name)) as f:
            return f.read()

    def logs(self):
        return "".join(f"\n--- {n} ---\n{self.log(n)}" for n in ("master.log", "agent0.log", "agent1.log")
                       if os.path.exists(os.path.join(self.tmp, n)))

    def wait_all(self, procs, timeout):
        deadline = time.time() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.fail(f"the job did not finish within {timeout} s (hung?){self.logs()}")
        return [p.returncode for p in procs]

    def test_agents_on_two_hosts_without_dns_train_to_the_end(self):
        with Lan(3) as lan:
            master = self.start_master(lan, "2")
            time.sleep(0.5)
            agents = [self.start_agent(lan, 1, 0), self.start_agent(lan, 2, 1)]
            rcs = self.wait_all([*agents, master], timeout=150)
            self.assertEqual(rcs, [0, 0, 0], self.logs())
        # MASTER_ADDR is node 0's IP on the LAN, not its host name.
        self.assertRegex(self.log("agent0.log"), rf"MASTER_ADDR={re.escape(lan.addr(1))}:\d+")
        self.assertRegex(self.log("agent1.log"), rf"MASTER_ADDR={re.escape(lan.addr(1))}:\d+")
        self.assertNotIn("MASTER_ADDR=host1", self.log("agent1.log"))
        # gloo was pointed at the LAN interface: the host names resolve nowhere.
        self.assertIn("GLOO_SOCKET_IFNAME=eth0", self.log("agent1.log"))
        done = []
        for path in glob.glob(os.path.join(self.tmp, "out", "rank*.jsonl")):
            with open(path) as f:
                done += [e for e in map(json.loads, f) if e["event"] == "done"]
        self.assertEqual(sorted(e["step"] for e in done), [6, 6, 6, 6], self.logs())

    def test_unreachable_master_addr_fails_fast_naming_the_node_and_the_fix(self):
        with Lan(3) as lan:
            master = self.start_master(lan, "2")
            time.sleep(0.5)
            t0 = time.time()
            # Node 0 announces its host name, which no other host resolves.
            agents = [self.start_agent(lan, 1, 0, extra=("--local-addr", "host1")), self.start_agent(lan, 2, 1)]
            rcs = self.wait_all([*agents, master], timeout=120)
            elapsed = time.time() - t0
        self.assertEqual(rcs, [1, 1, 1], self.logs())
        if os.environ.get("SHOW"):
            print(self.logs())
        master_log = self.log("master.log")
        self.assertIn("cannot reach the round's MASTER_ADDR host1:", master_log)
        self.assertIn("cannot resolve 'host1'", master_log)
        self.assertIn("Pass `--local-addr ADDR`", master_log)
        self.assertRegex(master_log, r"node rank \d \(node host\d-\d+-[0-9a-f]+, host ")
        # One retry (network failures get one), then the job fails: seconds, not the minutes of a hang.
        self.assertLess(elapsed, 90, self.logs())

    def test_node_whose_ranks_never_reach_the_store_fails_the_round_naming_it(self):
        # Node 1's workers never call init_process_group (stuck before it):
        # node 0's torch store waits for them, and without the watch so would
        # the job, for torch's 30 minutes.
        script = os.path.join(self.tmp, "stuck.py")
        with open(script, "w") as f:
            f.write("import os, time\n"
                    "import torch.distributed as dist\n"
                    "if os.environ['GROUP_RANK'] == '1':\n"
                    "    time.sleep(3600)\n"
                    "dist.init_process_group('gloo')\n")
        fast = {"BALLAST_STORE_CONNECT_TIMEOUT_S": "3"}
        with Lan(3) as lan:
            master = self.start_master(lan, "2")
            time.sleep(0.5)
            agents = [self.start_agent(lan, 1, 0, script=[script], env_extra=fast),
                      self.start_agent(lan, 2, 1, script=[script], env_extra=fast)]
            rcs = self.wait_all([*agents, master], timeout=120)
        self.assertEqual(rcs, [1, 1, 1], self.logs())
        self.assertRegex(self.log("master.log"),
                         r"the process group did not form: no rank of group rank 1 \(node host2-\d+-[0-9a-f]+, "
                         rf"host {re.escape(lan.addr(2))}, ranks 2-3\) reached the torch store at MASTER_ADDR "
                         rf"{re.escape(lan.addr(1))}:\d+ within 3 s")
        self.assertIn("store-timeout failures are retried at most 1 time(s)", self.log("master.log"))


if __name__ == "__main__":
    unittest.main()
