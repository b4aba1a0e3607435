"""ElasticJobs end to end on a real API server: `kubectl apply -f deploy/`
installs the operator, a job trains real DDP on gloo in worker pods that the
master creates, and failures are handled the Kubernetes way.

The scenarios of DLRover's published chaos experiments and its users' pain
points: a worker pod deleted mid-training is replaced and the job Succeeds;
a node that goes NotReady has its pod replaced elsewhere; a node failing the
pre-flight check is replaced away from that host; a replacement that stays
Pending does not hold the job (it scales down to MIN, and up when the pod
runs); the master pod killed mid-training is recreated and the job finishes;
the master process killed in its pod (a crash, the OOM killer) is restarted
there from its journal and the same worker pods train on without a restart;
deleting the job deletes everything it made.
"""
import os
import signal
import time
import unittest

from _jobs import JobTestCase, done_ranks, min_step, sleep_job, train_job, wait_steps, worlds_seen


def all_pids():
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def parent_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


class ElasticJobTest(JobTestCase):

    def assert_no_failed_pods_left(self, j):
        failed = [p["metadata"]["name"] for p in j.pods() if p["status"].get("phase") == "Failed"]
        self.assertEqual(failed, [], j.debug())

    def test_deleted_worker_pod_is_replaced_and_the_job_succeeds(self):
        j = self.harness("chaos")
        j.apply(train_job("chaos", self.ns, self.out, nodes="4", steps=40, step_time=0.15))
        self.k.wait(lambda: len(j.running()) == 4, 60, "4 worker pods Running")
        wait_steps(self.k, self.out, range(4), 5, 90)
        victim = next(p for p in j.running() if p["metadata"]["labels"]["ballast.dev/node-rank"] == "2")
        victim_name = victim["metadata"]["name"]
        self.k.kubectl("-n", self.ns, "delete", "pod", victim_name, "--wait=false")
        st = j.wait_phase("Succeeded", 180)
        self.assertEqual(done_ranks(self.out, 4), [0, 1, 2, 3], j.debug())
        names = [p["metadata"]["name"] for p in j.pods()]
        self.assertNotIn(victim_name, names, "the deleted pod is gone")
        self.assertIn("chaos-worker-2-2", names, "a new incarnation of node rank 2")
        self.assertEqual(st["replacements"], 1)
        self.assertEqual(st["restarts"], 0, "a lost pod is a membership change, not a restart")
        self.assertIn("NodeReplaced", j.reasons())
        self.assertEqual(len(j.pods()), 4, j.debug())
        self.assert_no_failed_pods_left(j)

    def test_node_not_ready_gets_its_pod_replaced_on_another_node(self):
        j = self.harness("notready")
        j.apply(train_job("notready", self.ns, self.out, nodes="3", steps=50, step_time=0.15))
        self.k.wait(lambda: len(j.running()) == 3, 60, "3 worker pods Running")
        wait_steps(self.k, self.out, range(3), 5, 90)
        victim = next(p for p in j.running() if p["metadata"]["labels"]["ballast.dev/node-rank"] == "1")
        node = victim["spec"]["nodeName"]
        self.addCleanup(lambda: self.k.control("POST", f"/nodes/{node}/recover"))
        self.k.control("POST", f"/nodes/{node}/fail")  # NotReady, its processes killed
        replacement = self.k.wait(
            lambda: next((p for p in j.running() if p["metadata"]["name"] == "notready-worker-1-2"), None), 60,
            "the replacement of node rank 1 Running")
        self.assertNotEqual(replacement["spec"]["nodeName"], node, "not on the NotReady node")
        j.wait_phase("Succeeded", 180)
        self.assertEqual(done_ranks(self.out, 3), [0, 1, 2], j.debug())
        # The pod on the dead node does not linger (its kubelet never confirms the deletion).
        self.k.wait(lambda: victim["metadata"]["name"] not in [p["metadata"]["name"] for p in j.pods()], 30,
                    "the pod on the NotReady node force-deleted")

    def test_node_failing_the_preflight_check_is_replaced_on_another_host(self):
        j = self.harness("precheck")
        # Four nodes: the check pairs them twice, so a failure is pinned to one node.
        j.apply(train_job("precheck", self.ns, self.out, nodes="4", steps=10, step_time=0.1, networkCheck=True,
                          env={"BALLAST_CHAOS": "check-fail:node=1"}))
        st = j.wait_phase("Succeeded", 240)
        pods = {p["metadata"]["name"]: p for p in j.pods()}
        self.assertIn("precheck-worker-1-2", pods, j.debug())
        self.assertNotIn("precheck-worker-1-1", pods, "the excluded node's pod is gone")
        excluded = [e for e in j.events() if e["reason"] == "NodeExcluded"]
        self.assertTrue(excluded, j.debug())
        bad_host = excluded[0]["message"].split("avoid host ")[-1].strip()
        replacement = pods["precheck-worker-1-2"]
        self.assertNotEqual(replacement["spec"]["nodeName"], bad_host)
        terms = replacement["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        self.assertIn({"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [bad_host]},
                      terms[0]["matchExpressions"])
        self.assertEqual(st["replacements"], 1)
        self.assertEqual(done_ranks(self.out, 4), [0, 1, 2, 3], j.debug())

    def test_pending_replacement_scales_down_to_min_then_up_when_it_runs(self):
        j = self.harness("pending")
        j.apply(train_job("pending", self.ns, self.out, nodes="2:3", steps=90, step_time=0.2,
                          pendingTimeoutSeconds=3))
        self.k.wait(lambda: len(j.running()) == 3, 60, "3 worker pods Running")
        wait_steps(self.k, self.out, range(3), 5, 90)
        nodes = [n["metadata"]["name"] for n in self.k.api("GET", "/api/v1/nodes")["items"]]
        for n in nodes:  # nothing can be scheduled any more
            self.k.kubectl("cordon", n)
        self.addCleanup(lambda: [self.k.kubectl("uncordon", n, check=False) for n in nodes])
        victim = next(p for p in j.running() if p["metadata"]["labels"]["ballast.dev/node-rank"] == "2")
        self.k.kubectl("-n", self.ns, "delete", "pod", victim["metadata"]["name"], "--wait=false")
        # The replacement stays Pending; the job goes on with MIN nodes.
        self.k.wait(lambda: "NodePending" in j.reasons(), 60, "a NodePending event")
        self.assertEqual(j.status().get("phase"), "Running", j.debug())
        self.k.wait(lambda: j.status().get("nodes") == 2, 30, "the job at 2 nodes")
        before = min_step(self.out, range(2))
        wait_steps(self.k, self.out, range(2), before + 5, 60, "(training on at MIN)")
        pending = [p for p in j.pods() if p["status"].get("phase") == "Pending"]
        self.assertEqual([p["metadata"]["name"] for p in pending], ["pending-worker-2-2"], j.debug())
        self.k.kubectl("uncordon", nodes[0])
        self.k.wait(lambda: j.status().get("nodes") == 3, 60, "scaled back up to 3 nodes")
        st = j.wait_phase("Succeeded", 240)
        self.assertEqual(worlds_seen(self.out, 3)[-1], 3, "the last round had 3 workers again")
        self.assertEqual(st["restarts"], 0)
        reasons = j.reasons()
        self.assertIn("ScaledDown", reasons)
        self.assertIn("ScaledUp", reasons)

    def test_master_pod_killed_mid_training_is_recreated_and_the_job_finishes(self):
        j = self.harness("masterkill")
        j.apply(train_job("masterkill", self.ns, self.out, nodes="2", steps=60, step_time=0.15))
        self.k.wait(lambda: len(j.running()) == 2, 60, "2 worker pods Running")
        wait_steps(self.k, self.out, range(2), 5, 90)
        master = j.running("master")[0]
        pids = [p for p in self.k.control("GET", "/pods") if p["name"] == master["metadata"]["name"]][0]["pids"]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        st = j.wait_phase("Succeeded", 240)
        self.assertEqual(st["masterRestarts"], 1, j.debug())
        self.assertEqual(st["masterGeneration"], 2, j.debug())
        self.assertEqual(j.reasons().count("MasterRestarted"), 1, "one dead master, one new one")
        self.assertEqual(done_ranks(self.out, 2), [0, 1], j.debug())
        masters = sorted(p["metadata"]["name"] for p in j.pods("master"))
        self.assertEqual(masters, ["masterkill-master-2"], "the dead master's pod was replaced, not kept")
        self.assert_no_failed_pods_left(j)

    def test_master_process_killed_is_restarted_in_its_pod_and_the_workers_train_on(self):
        j = self.harness("masterproc")
        j.apply(train_job("masterproc", self.ns, self.out, nodes="2", steps=60, step_time=0.15))
        self.k.wait(lambda: len(j.running()) == 2, 60, "2 worker pods Running")
        wait_steps(self.k, self.out, range(2), 5, 90)
        workers = sorted(p["metadata"]["name"] for p in j.pods())
        master = j.running("master")[0]["metadata"]["name"]
        supervisor = [p for p in self.k.control("GET", "/pods") if p["name"] == master][0]["pids"]
        children = [pid for pid in all_pids() if parent_of(pid) in supervisor]
        self.assertEqual(len(children), 1, f"one master process under the supervisor {supervisor}: {children}")
        os.kill(children[0], signal.SIGKILL)  # a crash or the OOM killer: the pod stays
        killed_at = min_step(self.out, range(2))
        self.k.wait(lambda: "MasterResumed" in j.reasons(), 60, "the master resumed from its journal")
        st = j.wait_phase("Succeeded", 240)
        self.assertEqual(done_ranks(self.out, 2), [0, 1], j.debug())
        self.assertEqual(st.get("masterRestarts", 0), 0, "the pod was not replaced: " + j.debug())
        self.assertEqual(st["masterGeneration"], 1, j.debug())
        self.assertEqual(st["restarts"], 0, "no worker restart: " + j.debug())
        self.assertEqual(sorted(p["metadata"]["name"] for p in j.pods()), workers,
                         "the same worker pods trained to the end: " + j.debug())
        from _jobs import read_events
        for rank in range(2):
            starts = [e for e in read_events(self.out, rank) if e["event"] == "start"]
            self.assertEqual(len(starts), 1, f"rank {rank} started once (killed at step {killed_at})")
        self.assertNotIn("MasterRestarted", j.reasons())
        self.assertEqual(j.reasons().count("Started"), 1, "one Started event: " + j.debug())
        self.assert_no_failed_pods_left(j)

    def test_suspended_job_stops_its_pods_and_resumes_from_its_checkpoint(self):
        j = self.harness("suspend")
        j.apply(train_job("suspend", self.ns, self.out, nodes="2", steps=60, step_time=0.15))
        self.k.wait(lambda: len(j.running()) == 2, 60, "2 worker pods Running")
        wait_steps(self.k, self.out, range(2), 5, 90)
        self.k.kubectl("-n", self.ns, "patch", "elasticjob", "suspend", "--type=merge", "-p",
                       '{"spec": {"suspend": true}}')
        j.wait_phase("Suspended", 60)

        def live_pods():
            return [p["metadata"]["name"] for p in self.k.pods(self.ns, "ballast.dev/job=suspend")
                    if not p["metadata"].get("deletionTimestamp")]
        self.k.wait(lambda: not live_pods(), 60, "every pod of the job stopped")
        # Suspension fences the master: whichever of it and the operator saw the
        # suspension first, no pod comes back while the job is suspended (the master
        # replaced the deleted pods when its pod watch was first), and the phase stays.
        time.sleep(2)
        self.assertEqual(live_pods(), [], "a pod created for the suspended job: " + j.debug())
        self.assertEqual(j.status().get("phase"), "Suspended", j.debug())
        stopped_at = min_step(self.out, range(2))
        self.k.kubectl("-n", self.ns, "patch", "elasticjob", "suspend", "--type=merge", "-p",
                       '{"spec": {"suspend": false}}')
        st = j.wait_phase("Succeeded", 240)
        self.assertEqual(done_ranks(self.out, 2), [0, 1], j.debug())
        from _jobs import read_events
        resumed = [e["step"] for e in read_events(self.out, 0) if e["event"] == "start"][-1]
        self.assertGreater(resumed, 0, "the resumed workers started from the checkpoint, not from step 0")
        self.assertLessEqual(resumed, stopped_at + 1)
        # The whole story, in the order the API server stored it: no pod replaced, no
        # master restarted; the resume is a Resumed and a new master.
        self.assertEqual(j.reasons(), ["MasterCreated", "Started", "Suspended", "Resumed", "MasterCreated",
                                       "Started", "Succeeded"], j.debug())
        self.assertEqual(st.get("masterRestarts", 0), 0, j.debug())
        self.assertEqual(st.get("replacements", 0), 0, j.debug())
        self.assertEqual(st["masterGeneration"], 2, j.debug())

    def test_deleting_the_job_deletes_every_pod_service_and_secret(self):
        j = self.harness("gc")
        j.apply(sleep_job("gc", self.ns, nodes="2", spares=1))
        self.k.wait(lambda: len(j.running()) == 3, 60, "2 worker pods and a spare Running")
        self.k.wait(lambda: j.status().get("phase") == "Running", 30, "the job Running")
        sel = "ballast.dev/job=gc"
        for kind in ("services", "secrets", "serviceaccounts"):
            self.assertTrue(self.k.api("GET", f"/api/v1/namespaces/{self.ns}/{kind}?labelSelector={sel}")["items"],
                            kind)
        self.k.kubectl("-n", self.ns, "delete", "elasticjob", "gc", "--wait=false")

        def gone():
            left = [p["metadata"]["name"] for p in self.k.pods(self.ns, sel)]
            for kind in ("services", "secrets", "serviceaccounts"):
                left += [f"{kind}/{o['metadata']['name']}" for o in
                         self.k.api("GET", f"/api/v1/namespaces/{self.ns}/{kind}?labelSelector={sel}")["items"]]
            left += [f"rolebinding/{o['metadata']['name']}" for o in self.k.api(
                "GET", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{self.ns}/rolebindings?labelSelector={sel}")[
                "items"]]
            self.last_left = left
            return not left
        try:
            self.k.wait(gone, 60, "everything of the job deleted")
        except AssertionError as e:
            raise AssertionError(f"{e}: left {self.last_left}")


if __name__ == "__main__":
    unittest.main()
