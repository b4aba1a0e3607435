"""`ballast ray run` on a real Ray cluster (PyPI's ray, pinned: scripts/ray-venv.sh).

A head (no CPUs: no agent lands there) and 3 nodes of 1 CPU started with
ray.cluster_utils on this machine, inside a network namespace that has only
loopback (the test re-executes itself under `unshare -n`: Ray would bind the
machine's routable address otherwise). Ray's health checks every 200 ms, so a
removed node is reported dead in about half a second.

The jobs: 2 nodes x 2 workers of DDP (tests/integration/scripts/health_train.py:
flash checkpoints every step with peer replicas, the ElasticSampler, progress
reports with the loss), each agent an actor on its own Ray node.
  - a worker killed: restarted in place, from memory; Ray does nothing;
  - a node removed without grace mid-training: its agent and workers die with it,
    Ray reports it dead, the job's replacement goes to the free third node, and
    every rank resumes the agreed step (the lost node's from its peer's replica):
    the final weights equal a fault-free run's, bit for bit;
  - the same with a hot spare (--spares 1) waiting on a third node: it takes
    the lost node's place in the next round;
  - a node removed with no Ray node free: the job goes on with MIN nodes; a node
    added later takes the pending replacement and the job scales back up, and
    every epoch's samples are trained exactly once (test_sampler_elastic's check);
  - the driver killed with SIGKILL: nothing of the job is left on any node;
  - `ray job submit` through the dashboard's Jobs API (a worker killed: the job
    succeeds, `ray job logs` has every node's lines), and `ray job stop`;
  - the Python API, ballast.ray.run(), with the master in the driver (--master-on driver);
  - the master's actor killed (SIGKILL to its process, as the OOM killer would, and a chaos kill-master
    through Ray's API in the submitted job): Ray restarts it on the head, it resumes the job from its
    journal on the same port, the agents reconnect, and the workers train on with no restart.
Every job but the Python API's runs its master as an actor on the head (the default). After every job, no
process of it (agent, worker or master) remains, nor the master's journal directory.
"""
import contextlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "../integration/scripts/health_train.py")
SAMPLER_SCRIPT = os.path.join(HERE, "scripts", "sampler_train.py")
BALLAST = os.environ.get("BALLAST_BIN", os.path.join(HERE, "../../build/bin/ballast"))
NETNS_MARK = "BALLAST_TEST_RAY_NETNS"

from _ray_cluster import HEALTH, STORE, agent_ray_node, enter_loopback_netns, job_processes, read_jsonl  # noqa: E402

if __name__ == "__main__":
    enter_loopback_netns(NETNS_MARK)

import ray  # noqa: E402
from test_sampler_elastic import BATCH, EPOCHS, SIZE, check_lineage, read_events  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402


# The node tests remove a node once some rank logged step 8. Its ranks' newest step may not have reached
# its replica holder yet (the agent sends a committed step a moment after the save; a node that dies at
# once, its agent with its raylet, takes the unsent one along), so the world resumes step 7 or later:
# never older than one save behind, from memory and replicas, never from disk.
LOST_NODE_FLOOR = 7


class RayJobs(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if os.environ.get(NETNS_MARK) != "1":
            raise RuntimeError("run test_ray.py as a script (python test_ray.py): it enters a loopback-only "
                               "network namespace first")
        out = os.environ.get("BALLAST_TEST_OUTPUT")
        if out:  # a fresh build dir has none until some suite makes it: this one may run first
            os.makedirs(out, exist_ok=True)
        cls.tmp = tempfile.mkdtemp(prefix="ballast-ray-", dir=out)
        cls.python = sys.executable
        t0 = time.monotonic()
        cls.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "object_store_memory": STORE, "_system_config": HEALTH,
            "include_dashboard": True, "dashboard_port": 0})  # the Jobs API (`ray job submit`)
        cls.nodes = [cls.cluster.add_node(num_cpus=1, object_store_memory=STORE) for _ in range(3)]
        cls.cluster.wait_for_nodes()
        print(f"test_ray: a Ray head and 3 nodes up in {time.monotonic() - t0:.1f} s at {cls.cluster.address}",
              flush=True)
        cls.env = dict(os.environ, RAY_ADDRESS=cls.cluster.address, RAY_USAGE_STATS_ENABLED="0")
        # The reference: the same job without a fault (and without Ray).
        cls.clean = cls.run_launch("clean")

    @classmethod
    def tearDownClass(cls):
        cls.cluster.shutdown()

    @classmethod
    def run_launch(cls, name):
        out = os.path.join(cls.tmp, name)
        os.makedirs(out)
        p = subprocess.run([BALLAST, "launch", "--python", cls.python, "--nodes", "2", "--nproc-per-node", "2",
                            SCRIPT, "--out", out, "--steps", "24", "--persist-every", "0"],
                           env=cls.env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
        return read_jsonl(os.path.join(out, "events.jsonl"))[-1]

    def start_job(self, name, nodes, *flags, steps=24, step_time=0.02, persist_every=0, nproc=2):
        out = os.path.join(self.tmp, name)
        os.makedirs(out)
        log = open(os.path.join(out, "driver.log"), "w")
        p = subprocess.Popen([BALLAST, "ray", "run", "--python", self.python, "--nodes", nodes,
                              "--nproc-per-node", str(nproc), *flags, SCRIPT, "--out", out, "--steps", str(steps),
                              "--persist-every", str(persist_every), "--log-weights", "--step-time", str(step_time)],
                             env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return p, out

    def finish(self, p, out, timeout=300):
        try:
            rc = p.wait(timeout=timeout)
        finally:
            if p.poll() is None:
                p.kill()
        with open(os.path.join(out, "driver.log")) as f:
            log = f.read()
        self.assertNoneLeft(out)
        self.assertMasterGone(log)
        return rc, log, read_jsonl(os.path.join(out, "events.jsonl")), read_jsonl(os.path.join(out, "starts.jsonl"))

    def assertNoneLeft(self, out, within=15):
        deadline = time.monotonic() + within
        while job_processes(out) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.assertEqual(job_processes(out), [], "processes of the job outlived it")

    def assertMasterGone(self, log, within=15):
        """The master's process (its command line names the job id) is gone, and its default journal with it."""
        job = re.search(r"job (ballast-[0-9a-f]+): master on", log)
        self.assertIsNotNone(job, log[-3000:])
        self.assertNoneLeft(f"--job-id {job.group(1)}", within)
        self.assertFalse(os.path.exists(f"/tmp/{job.group(1)}.journal"), "the master's journal outlived the job")

    def wait_step(self, out, step, p, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            steps = [e["step"] for e in read_jsonl(os.path.join(out, "events.jsonl")) if e["ev"] == "weights"]
            if steps and steps[-1] >= step:
                return steps[-1]
            self.assertIsNone(p.poll(), "the job ended early")
            time.sleep(0.05)
        self.fail(f"the job did not reach step {step} within {timeout} s")

    def assertResumedTogetherAsTheCleanRun(self, starts, events, at_least):
        """Every rank of the later rounds resumed one state (step >= at_least) from memory or a peer's replica,
        and the job ended with the clean run's weights; when training went on after the fault."""
        resumed = [s for s in starts if s["round"] > 1]
        self.assertEqual(len({s["rank"] for s in resumed}), 4, starts)
        self.assertEqual(len({(s["step"], s["sha256"]) for s in resumed}), 1, "the ranks resumed different states")
        self.assertGreaterEqual(resumed[0]["step"], at_least, starts)
        self.assertTrue(all(s["source"] in ("memory", "replica") for s in resumed), starts)
        self.assertEqual((events[-1]["ev"], events[-1]["step"]), ("done", 24))
        self.assertEqual(events[-1]["sha256"], self.clean["sha256"])
        return min(e["t"] for e in events if e["ev"] == "weights" and e["round"] > 1)

    def remove(self, node_id):
        """Removes a Ray node without grace: its raylet and every process of it are killed."""
        node = next((n for n in self.nodes if n.node_id == node_id), None)
        self.assertIsNotNone(node, f"Ray node {node_id} is not one of the test's")
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)

    def test_1_a_killed_worker_restarts_in_place(self):
        p, out = self.start_job("worker", "2", "--chaos", "kill-worker:rank=1,at_step=12")
        rc, log, events, starts = self.finish(p, out)
        self.assertEqual(rc, 0, log[-6000:])
        self.assertEqual([s["source"] for s in events if s["ev"] == "start"], [None, "memory"], log[-3000:])
        self.assertEqual(events[-1]["sha256"], self.clean["sha256"])
        self.assertIn("0 node replacement(s)", log)
        # Every agent's lines reach the driver, named by the node and its rank.
        self.assertIn("(node-0 node-rank=0", log)
        self.assertIn("(node-1 node-rank=1", log)
        self.assertIn("summary: goodput", log)

    def test_2_a_lost_node_is_replaced_on_a_free_ray_node(self):
        p, out = self.start_job("node", "2", step_time=0.3)
        self.wait_step(out, 8, p)
        victim = agent_ray_node(out, 1)
        self.assertIsNotNone(victim, "no agent of node rank 1 runs")
        t_remove = time.time()
        self.remove(victim)
        rc, log, events, starts = self.finish(p, out)
        self.assertEqual(rc, 0, log[-6000:])
        self.assertIn("died (Ray's health check)", log)
        self.assertIn("1 node replacement(s)", log)
        first_after = self.assertResumedTogetherAsTheCleanRun(starts, events, at_least=LOST_NODE_FLOOR)
        early = "hung up its connection to the master: starting node-1-2 now" in log
        print(f"test_ray: node removed at step >= 8, training again {first_after - t_remove:.2f} s later "
              f"({'an early' if early else 'a'} replacement)", flush=True)

    def test_2b_a_hot_spare_takes_a_lost_nodes_place(self):
        # A third Ray node for the spare's agent (test_2's replacement took the last free one); after the
        # removal two are left, as test_3 expects.
        self.nodes.append(self.cluster.add_node(num_cpus=1, object_store_memory=STORE))
        self.cluster.wait_for_nodes()
        p, out = self.start_job("spare", "2", "--spares", "1", "--cpus-per-node", "1", step_time=0.3)
        self.wait_step(out, 8, p)
        victim = agent_ray_node(out, 1)
        self.assertIsNotNone(victim, "no agent of node rank 1 runs")
        self.assertIsNotNone(agent_ray_node(out, 2), "no spare's agent runs")
        t_remove = time.time()
        self.remove(victim)
        rc, log, events, starts = self.finish(p, out)
        self.assertEqual(rc, 0, log[-6000:])
        # The waiting spare is in the next round at once: no new Ray node is needed for it.
        self.assertIn("spare node node-2 takes the place of node node-1", log, log[-4000:])
        first_after = self.assertResumedTogetherAsTheCleanRun(starts, events, at_least=LOST_NODE_FLOOR)
        print(f"test_ray: node removed with a hot spare waiting, training again {first_after - t_remove:.2f} s "
              "later", flush=True)

    def test_3_with_no_free_node_the_job_shrinks_and_grows_back(self):
        # Two Ray nodes are left, both taken by the job: a lost one cannot be replaced until one is added.
        # The script is test_sampler_elastic's (1 worker per node, each step persisted: a node that joins
        # later takes rank 0's replicated state), which logs every sample each rank trains.
        self.assertEqual(len(self.nodes), 2)
        out = os.path.join(self.tmp, "shrink")
        os.makedirs(out)
        log = open(os.path.join(out, "driver.log"), "w")
        p = subprocess.Popen([BALLAST, "ray", "run", "--python", self.python, "--nodes", "1:2",
                              "--nproc-per-node", "1", SAMPLER_SCRIPT, "--out", out, "--epochs", str(EPOCHS),
                              "--size", str(SIZE), "--batch", str(BATCH), "--step-time", "0.1"],
                             env=dict(self.env, BALLAST_RAY_PENDING_S="1"), stdout=log, stderr=subprocess.STDOUT)
        log.close()

        def rounds():
            return {e["round"] for e in read_events(out) if e["ev"] == "train"}

        deadline = time.monotonic() + 120
        while not rounds() and time.monotonic() < deadline:
            self.assertIsNone(p.poll(), "the job ended early")
            time.sleep(0.1)
        time.sleep(1)
        victim = agent_ray_node(out, 1)
        self.assertIsNotNone(victim)
        self.remove(victim)
        # Training goes on with one node before a Ray node is added.
        while len(rounds()) < 2 and time.monotonic() < deadline:
            self.assertIsNone(p.poll(), "the job ended early")
            time.sleep(0.1)
        time.sleep(2)
        self.nodes.append(self.cluster.add_node(num_cpus=1, object_store_memory=STORE))
        rc, log, _, _ = self.finish(p, out)
        self.assertEqual(rc, 0, log[-6000:])
        self.assertIn("has not started: no free Ray node", log, log[-3000:])
        lineage, redone = check_lineage(self, out)
        worlds = [w for _, w, _, _, _ in lineage]
        self.assertEqual((worlds[0], worlds[-1]), (2, 2), lineage)
        self.assertIn(1, worlds, lineage)
        print(f"test_ray: lineage (round, world, steps): {[(r, w, lo, hi) for r, w, lo, hi, _ in lineage]}; "
              f"{redone} rank-step(s) redone", flush=True)

    def test_4_a_killed_driver_leaves_nothing_behind(self):
        p, out = self.start_job("driver", "2", steps=200, step_time=0.3)
        self.wait_step(out, 3, p)
        self.assertTrue(job_processes(out))
        p.send_signal(signal.SIGKILL)
        p.wait()
        self.assertNoneLeft(out, within=30)
        with open(os.path.join(out, "driver.log")) as f:
            job = re.search(r"job (ballast-[0-9a-f]+): master on", f.read()).group(1)
        self.assertNoneLeft(f"--job-id {job}", within=30)

    def submit(self, name, *args):
        """Submits `ballast ray run ARGS` through the dashboard's Jobs API, as `ray job submit -- ...` does."""
        from ray.job_submission import JobSubmissionClient
        out = os.path.join(self.tmp, name)
        os.makedirs(out)
        client = JobSubmissionClient("http://" + self.cluster.head_node.address_info["webui_url"])
        env = {k: v for k, v in self.env.items() if k in ("PYTHONPATH", "BALLAST_PYTHON", "OMP_NUM_THREADS")}
        entry = " ".join(shlex.quote(a) for a in [BALLAST, "ray", "run", "--python", self.python, *args, "--out", out])
        return client, client.submit_job(entrypoint=entry, runtime_env={"env_vars": env}), out

    def wait_job(self, client, job, timeout=180):
        from ray.job_submission import JobStatus
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = client.get_job_status(job)
            if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
                return status, client.get_job_logs(job)
            time.sleep(0.3)
        self.fail(f"Ray job {job} did not end within {timeout} s: {client.get_job_logs(job)[-3000:]}")

    def test_5_ray_job_submit_and_ray_job_stop(self):
        from ray.job_submission import JobStatus
        # A worker killed, and the master's actor killed through Ray's API (ray.kill: Ray restarts it).
        client, job, out = self.submit("submitted", "--nodes", "2", "--nproc-per-node", "1", "--chaos",
                                       "kill-worker:rank=1,at_step=6;kill-master:at_step=9", SCRIPT, "--steps", "14",
                                       "--persist-every", "0")
        status, logs = self.wait_job(client, job)
        self.assertEqual(status, JobStatus.SUCCEEDED, logs[-4000:])
        # `ray job logs` shows the agents' lines (named by Ray with the node and its node rank), the master's
        # and the summary.
        self.assertIn("(node-1 node-rank=1", logs)
        self.assertIn("1 worker restart(s)", logs)
        self.assertIn("the job master restarted and resumed the job from its journal", logs)
        self.assertIn("the master process died 1 time(s)", logs)
        self.assertMasterGone(logs)
        self.assertEqual([e["source"] for e in read_jsonl(os.path.join(out, "events.jsonl")) if e["ev"] == "start"],
                         [None, "memory"])
        self.assertNoneLeft(out)

        client, job, out = self.submit("stopped", "--nodes", "2", "--nproc-per-node", "1", SCRIPT, "--steps", "400",
                                       "--persist-every", "0", "--log-weights", "--step-time", "0.3")
        deadline = time.monotonic() + 120
        while not any(e["ev"] == "weights" for e in read_jsonl(os.path.join(out, "events.jsonl"))):
            self.assertLess(time.monotonic(), deadline, client.get_job_logs(job)[-3000:])
            time.sleep(0.2)
        self.assertTrue(job_processes(out))
        client.stop_job(job)
        status, logs = self.wait_job(client, job, timeout=60)
        self.assertEqual(status, JobStatus.STOPPED, logs[-3000:])
        self.assertNoneLeft(out)

    def test_6_the_python_api(self):
        import ballast.ray
        out = os.path.join(self.tmp, "api")
        os.makedirs(out)
        result = ballast.ray.run(SCRIPT, ["--out", out, "--steps", "8", "--persist-every", "0"], nodes="1:2",
                                 nproc_per_node=1, cpus_per_node=1, max_restarts=2, master_on="driver", env=self.env)
        self.assertEqual(result.exit_code, 0)
        self.assertRegex(result.summary or "", r"^job ballast-\w+ summary: goodput ")
        self.assertEqual(read_jsonl(os.path.join(out, "events.jsonl"))[-1]["step"], 8)
        self.assertNoneLeft(out)
        # Bad flags: the command's usage error, exit code 2.
        self.assertEqual(ballast.ray.run(SCRIPT, nodes="2", no_such_flag=1, env=self.env).exit_code, 2)
        # A master node that is not in the cluster: a clear error, nothing started.
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            result = ballast.ray.run(SCRIPT, ["--out", out], nodes="1", master_on="10.9.9.9", env=self.env)
        self.assertEqual(result.exit_code, 1, said.getvalue()[-3000:])
        self.assertIn("no alive Ray node is '10.9.9.9'", said.getvalue())
        self.assertEqual(ballast.ray.flags_to_argv({"nproc_per_node": 8, "network_check": True, "chaos": None,
                                                    "ray_resources": '{"a": 1}'}),
                         ["--nproc-per-node", "8", "--network-check", "--ray-resources", '{"a": 1}'])

    def test_7_the_master_actor_killed(self):
        # The master's actor (on the head, the default) SIGKILLed mid-training, as the OOM killer would: Ray
        # restarts it there, its master resumes the job from the journal on the same port, the agents reconnect.
        p, out = self.start_job("master", "2", step_time=0.2)
        self.wait_step(out, 6, p)
        with open(os.path.join(out, "driver.log")) as f:
            job = re.search(r"job (ballast-[0-9a-f]+): master on", f.read()).group(1)
        masters = job_processes(f"--job-id {job}")
        self.assertEqual(len(masters), 1, masters)
        with open(f"/proc/{masters[0][0]}/stat") as f:
            actor = int(f.read().rsplit(")", 1)[1].split()[1])  # its parent: the actor's process
        t_kill = time.time()
        os.kill(actor, signal.SIGKILL)
        rc, log, events, starts = self.finish(p, out)
        self.assertEqual(rc, 0, log[-6000:])
        self.assertIn("the job master restarted and resumed the job from its journal", log)
        self.assertIn("(incarnation 2)", log)
        # The workers trained on: one start each, no restart, the clean run's weights.
        self.assertEqual([s["round"] for s in starts], [1] * 4, starts)
        self.assertIn("0 worker restart(s), 0 node replacement(s)", log)
        self.assertEqual((events[-1]["ev"], events[-1]["step"]), ("done", 24))
        self.assertEqual(events[-1]["sha256"], self.clean["sha256"])
        back = re.search(r"\[ballast master (\d\d):(\d\d):(\d\d\.\d+)\] warning job=\S+ the job master restarted", log)
        killed = time.localtime(t_kill)
        since = (int(back.group(1)) * 3600 + int(back.group(2)) * 60 + float(back.group(3))
                 - (killed.tm_hour * 3600 + killed.tm_min * 60 + killed.tm_sec + t_kill % 1))
        print(f"test_ray: the master's actor killed at step >= 6: its next incarnation resumed the job from the "
              f"journal {since:.2f} s later; 0 worker restarts", flush=True)


if __name__ == "__main__":
    unittest.main()
