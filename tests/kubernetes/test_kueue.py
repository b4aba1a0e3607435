"""ElasticJobs under Kueue, on the suite's real API server and a real Kueue
(tests/kubernetes/_kueue.py: the pinned release built from the Go module proxy).

One ClusterQueue with a quota that fits one job (cpu 3: a job is its master,
100m, and 2 workers of 1 cpu), one flavor that places pods on the test
kubelet's nodes (node label ballast.test/testkubelet), preemption of lower
priorities within the queue, and a LocalQueue in each test's namespace.
"""
import collections
import json
import os
import shutil
import sys
import threading
import time
import unittest

from _cluster import ROOT, PYTHON
from _jobs import JobTestCase, sleep_job
from _kueue import Kueue

sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from test_sampler_elastic import check_lineage, read_events  # noqa: E402

SAMPLER_TRAIN = os.path.join(ROOT, "tests", "python", "scripts", "sampler_train.py")
CQ = "ballast-test-cq"
FLAVOR = "ballast-test-nodes"
NODE_LABEL = "ballast.test/testkubelet"
SIZE, EPOCHS = 242, 2


def queued(job, queue, priority=None, cpu="1"):
    job["metadata"].setdefault("labels", {})["kueue.x-k8s.io/queue-name"] = queue
    if priority:
        job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] = priority
    for c in job["spec"]["template"]["spec"]["containers"]:
        c["resources"] = {"requests": {"cpu": cpu}}
    return job


def torch2_python():
    """The pinned torch 2.x with Ballast's wheel pip-installed (the venv `make test` builds for the
    torch 2.x suites): what a user's image holds."""
    python = os.environ.get("BALLAST_TORCH2_WHEEL_PYTHON", "")
    if not os.access(python, os.X_OK):
        raise AssertionError(f"BALLAST_TORCH2_WHEEL_PYTHON={python!r} is not an interpreter: run the tests with "
                             "`make test` (it builds the torch 2.x wheel venv first)")
    return python


def sampler_job(name, ns, out, ckpt, step_time=0.25, python=PYTHON):
    """2 nodes x 1 worker of tests/python/scripts/sampler_train.py: ElasticSampler, flash checkpoints
    with replicas every step, nothing asked of disk (--persist-every 0): what reaches disk is the
    agents' breakpoint save as their pods stop (the Checkpointer named its folder). On Debian's
    torch 1.13 Ballast comes from the build tree (PYTHONPATH); a venv's interpreter has its wheel."""
    container = {"name": "trainer", "image": "ballast-test:ignored",
                 "command": [python, SAMPLER_TRAIN, "--out", out, "--epochs", str(EPOCHS), "--size", str(SIZE),
                             "--batch", "4", "--step-time", str(step_time), "--persist-every", "0"],
                 "env": [{"name": "PYTHONPATH", "value": os.environ.get("PYTHONPATH", "") if python == PYTHON else ""},
                         {"name": "OMP_NUM_THREADS", "value": "1"}]}
    return {"apiVersion": "ballast.dev/v1alpha1", "kind": "ElasticJob",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"nodes": "2", "nprocPerNode": 1, "maxRestarts": 3, "maxReplacements": 3,
                     "checkpointDir": ckpt,
                     "template": {"spec": {"containers": [container], "terminationGracePeriodSeconds": 10}}}}


class PhaseRecorder:
    """The phases a job's status goes through, polled every 20 ms from a
    thread (Admitted lasts while the master pod starts)."""

    def __init__(self, harness):
        self.phases = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(harness,), daemon=True)
        self._thread.start()

    def _run(self, harness):
        final_reads = 50
        while True:
            # Read, then look at the stop flag: the read after stop() is what
            # the caller last saw (e.g. the Succeeded its wait_phase returned
            # on), which a check before the read would miss.
            stopping = self._stop.is_set()
            try:
                phase = harness.status().get("phase")
            except Exception:  # noqa: BLE001 - a failed read is retried
                phase = None
            if phase and (not self.phases or self.phases[-1] != phase):
                self.phases.append(phase)
            if stopping:
                final_reads -= 1
                if phase or not final_reads:
                    return
            self._stop.wait(0.02)

    def stop(self):
        """Stops after one more read, made after this call."""
        self._stop.set()
        self._thread.join()
        return self.phases


def time_parts(status):
    return (status.get("time") or {}).get("parts") or {}


def condition(obj, kind):
    for c in obj.get("status", {}).get("conditions", []):
        if c["type"] == kind:
            return c
    return None


class ElasticJobsUnderKueue(JobTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.kueue = Kueue(cls.k).start()
        cls.kueue.create("resourceflavors", {"kind": "ResourceFlavor", "metadata": {"name": FLAVOR},
                                             "spec": {"nodeLabels": {NODE_LABEL: "tk-node"}}})
        cls.kueue.create("clusterqueues", {
            "kind": "ClusterQueue", "metadata": {"name": CQ},
            "spec": {"namespaceSelector": {},
                     "preemption": {"withinClusterQueue": "LowerPriority"},
                     "resourceGroups": [{"coveredResources": ["cpu", "memory"],
                                         "flavors": [{"name": FLAVOR, "resources": [
                                             {"name": "cpu", "nominalQuota": "3"},
                                             {"name": "memory", "nominalQuota": "4Gi"}]}]}]}})
        for name, value in (("ballast-test-low", 10), ("ballast-test-high", 1000)):
            cls.kueue.create("workloadpriorityclasses", {"kind": "WorkloadPriorityClass", "metadata": {"name": name},
                                                         "value": value})

    @classmethod
    def tearDownClass(cls):
        cls.kueue.stop()

    def setUp(self):
        super().setUp()
        self.kueue.create("localqueues", {"kind": "LocalQueue", "metadata": {"name": "q"},
                                          "spec": {"clusterQueue": CQ}}, ns=self.ns)

    def debug(self, *jobs):
        wls = "\n".join(f"  {w['metadata']['name']}: {json.dumps(w.get('status', {}).get('conditions', []))}"
                        for w in self.kueue.workloads(self.ns))
        return "\n".join(j.debug() for j in jobs) + f"\nworkloads:\n{wls}\nkueue log:\n{self.kueue.log_tail(30)}"

    def workload(self, job):
        wls = [w for w in self.kueue.workloads(self.ns)
               if w["metadata"].get("labels", {}).get("ballast.dev/job") == job]
        return wls[0] if wls else None

    def test_two_jobs_one_quota_the_second_waits_queued_and_starts_when_the_first_finishes(self):
        a, b = self.harness("a"), self.harness("b")
        # a runs long enough that b is seen waiting even on a loaded machine.
        a.apply(queued(sleep_job("a", self.ns, nodes="2", seconds=20), "q"))
        st = a.wait_phase("Running", 90)
        b.apply(queued(sleep_job("b", self.ns, nodes="2", seconds=2), "q"))
        phases = PhaseRecorder(b)
        st = b.wait_phase("Queued", 30)
        self.assertEqual(st.get("queue"), "q")
        wl_b = self.k.wait(lambda: self.workload("b"), 30, "b's Workload")
        self.assertEqual([p["count"] for p in wl_b["spec"]["podSets"]], [1, 2])
        self.assertEqual(wl_b["metadata"]["ownerReferences"][0]["name"], "b")
        # The first is admitted on the flavor's nodes; the second has no pod while it waits.
        self.assertEqual(condition(self.workload("a"), "Admitted")["status"], "True")
        for p in a.pods() + a.pods("master"):
            self.assertEqual(p["spec"].get("nodeSelector", {}).get(NODE_LABEL), "tk-node", p["metadata"]["name"])
        time.sleep(2)
        self.assertEqual(b.pods() + b.pods("master"), [], self.debug(a, b))
        self.assertEqual(b.status().get("phase"), "Queued")
        # a finishes: its Workload is Finished, its quota goes to b.
        a.wait_phase("Succeeded", 120)
        self.k.wait(lambda: (condition(self.workload("a"), "Finished") or {}).get("status") == "True", 30,
                    "a's Workload Finished")
        st = b.wait_phase("Succeeded", 150)
        seen = phases.stop()
        self.assertEqual(b.reasons()[:2], ["Queued", "Admitted"], self.debug(b))
        self.assertNotIn("Resumed", b.reasons())
        self.assertEqual([p for p in seen if p in ("Queued", "Admitted", "Running", "Succeeded")],
                         ["Queued", "Admitted", "Running", "Succeeded"], seen)
        # The time b waited for the quota is its goodput's queued part (not
        # in goodput's share), as the operator measured it.
        parts = time_parts(st)
        self.assertGreater(st.get("queuedSeconds", 0), 5, st)
        self.assertAlmostEqual(parts.get("queued", 0), st["queuedSeconds"], delta=0.2, msg=st)
        self.assertEqual(parts.get("preempted", 0), 0, st)
        self.assertAlmostEqual(sum(parts.values()), st["time"]["wallSeconds"], delta=0.1, msg=st)

    def test_min_max_job_is_partially_admitted_and_runs_with_what_the_quota_holds(self):
        j = self.harness("partial")
        # nodes 1:3 asks for 3 worker pods (3.1 cpu with the master): the quota (3) holds 2.
        j.apply(queued(sleep_job("partial", self.ns, nodes="1:3", seconds=3), "q"))
        j.wait_phase("Running", 90)
        wl = self.workload("partial")
        self.assertEqual(wl["spec"]["podSets"][1].get("minCount"), 1)
        workers = [a for a in wl["status"]["admission"]["podSetAssignments"] if a["name"] == "workers"][0]
        self.assertEqual(workers.get("count"), 2, wl["status"])
        self.assertEqual(j.get()["metadata"]["annotations"].get("ballast.dev/kueue-admitted-workers"), "2")
        j.wait_phase("Succeeded", 120)
        self.assertEqual(sorted(p["metadata"]["labels"]["ballast.dev/node-rank"] for p in j.pods()), ["0", "1"],
                         self.debug(j))

    def test_job_without_the_queue_label_ignores_kueue(self):
        j = self.harness("plain")
        job = sleep_job("plain", self.ns, nodes="2", seconds=2)
        for c in job["spec"]["template"]["spec"]["containers"]:
            c["resources"] = {"requests": {"cpu": "2"}}  # 4 cpu: more than the queue's quota
        j.apply(job)
        j.wait_phase("Succeeded", 120)
        self.assertIsNone(self.workload("plain"))
        self.assertNotIn("Queued", j.reasons())

    def test_preempted_job_persists_its_flash_checkpoint_and_resumes_from_the_step_it_reached(self):
        self.preemption(PYTHON)

    def test_torch2_preempted_job_persists_its_flash_checkpoint_and_resumes_from_the_step_it_reached(self):
        self.preemption(torch2_python())

    def preemption(self, python):
        low, high = self.harness("low"), self.harness("high")
        ckpt = os.path.join(self.out, "ckpt")
        out = os.path.join(self.out, "low")
        os.makedirs(out)
        low.apply(queued(sampler_job("low", self.ns, out, ckpt, python=python), "q", priority="ballast-test-low"))
        low.wait_phase("Running", 120)

        def trained():
            evs = [e for e in read_events(out) if e["ev"] == "train"]
            return max((e["step"] for e in evs), default=0)
        self.k.wait(lambda: trained() >= 14, 120, "low training to step 14")
        # A higher-priority job that does not fit beside it: Kueue preempts low.
        high.apply(queued(sleep_job("high", self.ns, nodes="2", seconds=4), "q", priority="ballast-test-high"))
        t_evicted = self.k.wait(
            lambda: time.time() if (condition(self.workload("low") or {}, "Evicted") or {}).get("status") == "True"
            else None, 60, "low's Workload evicted")
        st = low.wait_phase("Preempted", 30)
        self.assertIn("Preempted", st.get("message", ""))
        t_gone = self.k.wait(lambda: time.time() if not (low.pods() + low.pods("master")) else None, 90,
                             "low's pods gone")
        step_at_eviction = trained()
        high.wait_phase("Succeeded", 120)
        t_readmitted = self.k.wait(
            lambda: time.time() if (condition(self.workload("low"), "Admitted") or {}).get("status") == "True"
            else None, 90, "low admitted again")
        low.wait_phase("Succeeded", 300)

        # Rounds of the master that resumed the job start over: number them after the first master's.
        events = read_events(out)
        before = [e for e in events if e["t"] < t_gone]
        after = [e for e in events if e["t"] >= t_readmitted]
        self.assertEqual(len(before) + len(after), len(events), "an event between the pods going and re-admission")
        starts_after = [e for e in after if e["ev"] == "start"]
        self.assertEqual(len({e["round"] for e in starts_after}), 1, starts_after)
        resumed = starts_after[0]
        self.assertEqual(resumed["source"], "disk", f"{resumed}\n{self.debug(low)}")
        # Nothing trained before the eviction is trained again, beyond the step in flight.
        self.assertGreaterEqual(resumed["step"], step_at_eviction - 1, (resumed, step_at_eviction))
        renumbered = os.path.join(self.out, "lineage")
        os.makedirs(renumbered)
        shift = 1000
        for e in after:
            e["round"] += shift
        by_rank = collections.defaultdict(list)
        for e in before + after:
            by_rank[e["rank"]].append(e)
        for rank, es in by_rank.items():
            with open(os.path.join(renumbered, f"rank{rank}.jsonl"), "w") as f:
                f.writelines(json.dumps(e) + "\n" for e in es)
        lineage, redone = check_lineage(self, renumbered, epochs=EPOCHS, size=SIZE)
        self.assertLessEqual(redone, 2, (lineage, redone))  # at most the step in flight, on each rank

        # The time from the eviction to the re-admission is the goodput's
        # preempted part, carried by the master that resumed the job from the
        # first one's status.time; the training before it is still counted.
        st = low.status()
        parts = time_parts(st)
        self.assertGreater(parts.get("preempted", 0), 0.5 * (t_readmitted - t_evicted), st)
        self.assertLess(parts.get("preempted", 0), t_readmitted - t_evicted + 10, st)
        # The wall spans both masters (without the first one's time it would
        # start at the re-admission).
        self.assertGreater(st["time"]["wallSeconds"], max(e["t"] for e in after) - min(e["t"] for e in before) - 1,
                           st)
        self.assertAlmostEqual(sum(parts.values()), st["time"]["wallSeconds"], delta=0.1, msg=st)

        first_step_after = min(e["t"] for e in after if e["ev"] == "train")
        reasons = low.reasons()
        for r in ("Queued", "Admitted", "Preempted", "Requeued", "Resumed"):
            self.assertIn(r, reasons, self.debug(low))
        torch = "torch 1.13" if python == PYTHON else "torch 2.x"
        print(f"\nkueue preemption ({torch}): evicted -> pods gone {t_gone - t_evicted:.1f} s; re-admitted -> next step "
              f"{first_step_after - t_readmitted:.1f} s; steps at eviction {step_at_eviction}, resumed from "
              f"{resumed['step']} ({step_at_eviction - resumed['step']} lost); redone rank-steps {redone}; "
              f"status.time: preempted {parts.get('preempted', 0):.1f} s, productive {parts.get('productive', 0):.1f} s "
              f"of {st['time']['wallSeconds']:.1f} s, goodput {st.get('goodput')}",
              file=sys.stderr, flush=True)
        shutil.rmtree(renumbered, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
