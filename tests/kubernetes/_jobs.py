"""ElasticJobs for the Kubernetes tests: real DDP training on gloo
(examples/train_ddp.py) or plain sleeping pods, applied with kubectl, and
what to wait for and read back."""
import json
import os
import sys
import tempfile
import time
import unittest

from _cluster import ROOT, PYTHON, Suite

sys.path.insert(0, os.path.join(ROOT, "examples"))
from train_events import read_events  # noqa: E402

TRAIN = os.path.join(ROOT, "examples", "train_ddp.py")


def train_job(name, ns, out, nodes, nproc=1, steps=30, step_time=0.2, env=None, **spec):
    """An ElasticJob whose workers run train_ddp.py (checkpoint to `out` every step, resume from it)."""
    container = {"name": "trainer", "image": "ballast-test:ignored",
                 "command": [PYTHON, TRAIN, "--steps", str(steps), "--step-time", str(step_time), "--out", out]}
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    body = {"nodes": nodes, "nprocPerNode": nproc, "maxRestarts": 3, "maxReplacements": 3,
            "template": {"spec": {"containers": [container], "terminationGracePeriodSeconds": 5}}}
    body.update(spec)
    return {"apiVersion": "ballast.dev/v1alpha1", "kind": "ElasticJob",
            "metadata": {"name": name, "namespace": ns}, "spec": body}


def sleep_job(name, ns, nodes, seconds=600, **spec):
    """An ElasticJob whose workers only sleep (agents, rendezvous and pods, no torch)."""
    body = {"nodes": nodes, "nprocPerNode": 1,
            "template": {"spec": {"containers": [{"name": "trainer", "image": "ballast-test:ignored",
                                                  "command": ["sleep", str(seconds)]}],
                                  "terminationGracePeriodSeconds": 2}}}
    body.update(spec)
    return {"apiVersion": "ballast.dev/v1alpha1", "kind": "ElasticJob",
            "metadata": {"name": name, "namespace": ns}, "spec": body}


class JobHarness:
    def __init__(self, test, k: Suite, ns, name):
        self.test, self.k, self.ns, self.name = test, k, ns, name

    def apply(self, job):
        self.k.kubectl("apply", "-f", "-", input=json.dumps(job))

    def get(self):
        return self.k.api("GET", f"/apis/ballast.dev/v1alpha1/namespaces/{self.ns}/elasticjobs/{self.name}")

    def status(self):
        return self.get().get("status", {})

    def wait_phase(self, phase, timeout):
        def reached():
            st = self.status()
            if st.get("phase") == phase:
                return st
            if st.get("phase") in ("Succeeded", "Failed"):  # final, and not the one expected
                raise AssertionError(f"ElasticJob {self.ns}/{self.name} is {st.get('phase')}, not {phase}: "
                                     f"{st.get('message')}\n{self.debug()}")
            return None
        try:
            return self.k.wait(reached, timeout, f"ElasticJob {self.ns}/{self.name} {phase}")
        except AssertionError as e:
            raise AssertionError(f"{e}; status: {json.dumps(self.status())}\n{self.debug()}")

    def pods(self, role="worker"):
        return self.k.pods(self.ns, f"ballast.dev/job={self.name},ballast.dev/role={role}")

    def running(self, role="worker"):
        return self.k.running_pods(self.ns, f"ballast.dev/job={self.name},ballast.dev/role={role}")

    def events(self):
        evs = self.k.api("GET", f"/api/v1/namespaces/{self.ns}/events")["items"]
        return [e for e in evs if e["involvedObject"].get("name") == self.name]

    def reasons(self):
        """The job's event reasons in the order the API server stored them (resourceVersion: one etcd
        revision counter; the timestamps have whole seconds only)."""
        def stored(e):
            rv = e["metadata"].get("resourceVersion", "")
            return (0, int(rv), "") if rv.isdigit() else (1, 0, e.get("lastTimestamp") or "")
        return [e["reason"] for e in sorted(self.events(), key=stored)]

    def debug(self):
        evs = "\n".join(f"  {e['type']} {e['reason']}: {e['message']}" for e in self.events())
        pods = "\n".join(f"  {p['metadata']['name']} {p['status'].get('phase')} on {p['spec'].get('nodeName')}"
                         f"{' (deleting)' if p['metadata'].get('deletionTimestamp') else ''}"
                         for p in self.k.pods(self.ns))
        return f"events:\n{evs}\npods:\n{pods}\nlogs:{self.k.logs(self.ns)}"


def min_step(out, ranks):
    """The lowest step every rank in `ranks` reported (0 before the first)."""
    steps = []
    for r in ranks:
        evs = [e for e in read_events(out, r) if e["event"] == "step"]
        steps.append(max((e["step"] for e in evs), default=0))
    return min(steps) if steps else 0


def done_ranks(out, world):
    """Ranks that logged their final "done" event."""
    return sorted(r for r in range(world) if any(e["event"] == "done" for e in read_events(out, r)))


def worlds_seen(out, world):
    """World sizes the workers started with, in order of their start events."""
    starts = []
    for r in range(world):
        starts += [e for e in read_events(out, r) if e["event"] == "start"]
    return [e["world"] for e in sorted(starts, key=lambda e: e["t"])]


def wait_steps(k, out, ranks, step, timeout, what=""):
    return k.wait(lambda: min_step(out, ranks) >= step, timeout, f"every rank at step {step} {what}")


class JobTestCase(unittest.TestCase):
    """A test on the suite's cluster with the operator installed: self.k, a fresh namespace
    self.ns (deleted at cleanup) and an output folder self.out for the workers' events."""

    @classmethod
    def setUpClass(cls):
        cls.k = Suite.get()
        cls.k.install()

    def setUp(self):
        self.ns = self.k.namespace(self)
        self.out = tempfile.mkdtemp(prefix="ballast-k8s-out-")

    def harness(self, name):
        return JobHarness(self, self.k, self.ns, name)
