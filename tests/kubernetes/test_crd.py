#!/usr/bin/python3
"""The ElasticJob CustomResourceDefinition and the RBAC manifests, against a real API server.

    cd tests/kubernetes && /usr/bin/python3 -m unittest -v test_crd

Applies deploy/00-namespace.yaml, 01-crd.yaml and 02-rbac.yaml (not the operator
Deployment) and checks: the example job is accepted and defaulted by the server;
malformed jobs are rejected by `kubectl apply` with a message naming the field (CEL
rules included; unknown fields through kubectl's default Strict field validation);
the printer columns; the status subresource; what the operator's ServiceAccount may
and may not do, and what a RoleBinding to ballast-master grants a job's master.
"""
import copy
import json
import os
import ssl
import unittest
import urllib.request

from _cluster import OPERATOR_REPLICAS, ROOT, Suite, out

DEPLOY = os.path.join(ROOT, "deploy")
EXAMPLE = os.path.join(ROOT, "examples", "kubernetes", "elasticjob.yaml")
CRD = "elasticjobs.ballast.dev"
OPERATOR_SA = "system:serviceaccount:ballast-system:ballast-operator"

# A small valid job; the malformed cases are edits of it.
BASE = {
    "apiVersion": "ballast.dev/v1alpha1",
    "kind": "ElasticJob",
    "metadata": {"name": "job"},
    "spec": {
        "nodes": "2:4",
        "nprocPerNode": 2,
        "template": {"spec": {"containers": [
            {"name": "trainer", "image": "my-train:latest", "command": ["python3", "train.py"]}]}},
    },
}


def job(name="job", **spec_edits):
    """BASE with spec keys replaced (value None deletes the key); `containers` edits the list."""
    j = copy.deepcopy(BASE)
    j["metadata"]["name"] = name
    for k, v in spec_edits.items():
        if k == "containers":
            j["spec"]["template"]["spec"]["containers"] = v
        elif v is None:
            j["spec"].pop(k, None)
        else:
            j["spec"][k] = v
    return j


class ElasticJobCRDTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.k = Suite.get()
        # These jobs are objects to validate, not jobs to run: an operator that
        # other tests installed would start them and write their status.
        cls.operator_scaled = cls.k.kubectl("-n", "ballast-system", "scale", "deployment/ballast-operator",
                                            "--replicas=0", check=False).returncode == 0
        if cls.operator_scaled:
            cls.k.wait(lambda: not cls.k.pods("ballast-system", "app.kubernetes.io/name=ballast-operator"), 60,
                       "the operator stopped")
        cls.k.kubectl("apply", "-f", os.path.join(DEPLOY, "00-namespace.yaml"),
                      "-f", os.path.join(DEPLOY, "01-crd.yaml"), "-f", os.path.join(DEPLOY, "02-rbac.yaml"))
        cls.k.crds_established([CRD])
        # Established is set before discovery and the OpenAPI schema kubectl's
        # validation needs are served: wait until kubectl can list the resource.
        cls.k.wait(lambda: cls.k.kubectl("get", "elasticjobs", "-A", check=False).returncode == 0,
                   30, "kubectl get elasticjobs to work")

    @classmethod
    def tearDownClass(cls):
        if cls.operator_scaled:
            cls.k.kubectl("-n", "ballast-system", "scale", "deployment/ballast-operator",
                          f"--replicas={OPERATOR_REPLICAS}")

    def setUp(self):
        self.ns = self.k.namespace(self, prefix="crd")

    # --- helpers
    def apply(self, obj, *extra, check=False):
        return self.k.kubectl("-n", self.ns, "apply", *extra, "-f", "-", input=json.dumps(obj), check=check)

    def get(self, name):
        return json.loads(self.k.kubectl("-n", self.ns, "get", "elasticjob", name, "-o", "json").stdout)

    def path(self, name, sub=""):
        return f"/apis/ballast.dev/v1alpha1/namespaces/{self.ns}/elasticjobs/{name}{sub}"

    def table(self, name):
        """The server-side Table of one ElasticJob (what kubectl get prints): (column names, cells)."""
        k = self.k
        req = urllib.request.Request(k.env["KUBE_SERVER"] + self.path(name), headers={
            "Authorization": "Bearer " + k.env["KUBE_TOKEN"],
            "Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"})
        with urllib.request.urlopen(req, context=k.ctx, timeout=30) as r:
            t = json.loads(r.read())
        return [c["name"] for c in t["columnDefinitions"]], t["rows"][0]["cells"]

    def can_i(self, *args, as_=OPERATOR_SA):
        p = self.k.kubectl("auth", "can-i", f"--as={as_}", *args, check=False)
        return p.stdout.strip(), p

    # --- (a) the example is accepted and defaulted
    def test_example_accepted_and_defaulted(self):
        with open(EXAMPLE) as f:
            p = self.k.kubectl("-n", self.ns, "apply", "-f", "-", input=f.read(), check=False)
        self.assertEqual(p.returncode, 0, "the example job was rejected" + out(p))
        ej = self.get("train-example")
        spec = ej["spec"]
        want = {"nodes": "2:4", "nprocPerNode": 2, "maxRestarts": 3, "maxReplacements": 3,
                "networkCheck": False, "checkpointDir": "/ckpt",
                # defaults filled by the API server
                "nodeUnit": 1, "spares": 0, "excludeStragglers": False, "hangTimeoutSeconds": 0,
                "pendingTimeoutSeconds": 120, "cordonBadNodes": False, "suspend": False}
        for key, v in want.items():
            self.assertEqual(spec.get(key), v, f"spec.{key}: {json.dumps(spec, indent=1)}")
        self.assertNotIn("masterImage", spec)
        pod = spec["template"]["spec"]
        c = pod["containers"][0]
        self.assertEqual((c["name"], c["image"]), ("trainer", "my-registry/my-train:latest"))
        self.assertEqual(c["command"], ["python3", "/workspace/train.py", "--epochs", "3"])
        # the rest of the pod spec passes through (preserve-unknown-fields), not pruned
        self.assertIn("resources", c, json.dumps(pod))
        self.assertEqual(c["volumeMounts"], [{"name": "ckpt", "mountPath": "/ckpt"}])
        self.assertEqual(pod["volumes"], [{"name": "ckpt", "emptyDir": {}}])
        self.assertEqual(spec["template"]["metadata"]["labels"], {"app": "train-example"})

    def test_pod_spec_passes_through(self):
        j = job("passthrough")
        t = j["spec"]["template"]
        t["metadata"] = {"labels": {"team": "ml"}, "annotations": {"a/b": "c"}}
        t["spec"].update({"nodeSelector": {"gpu": "h100"}, "serviceAccountName": "trainer",
                          "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                          "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]})
        t["spec"]["containers"][0].update({
            "args": ["--lr", "0.1"], "workingDir": "/workspace",
            "env": [{"name": "A", "value": "1"},
                    {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
            "resources": {"limits": {"nvidia.com/gpu": "8"}},
            "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}]})
        p = self.apply(j)
        self.assertEqual(p.returncode, 0, out(p))
        self.assertEqual(self.get("passthrough")["spec"]["template"], t)
        # saveEvery takes a step count as an integer or a string, or auto[:MAX]; mtbf a duration
        for i, every in enumerate([10, "auto", "auto:50"]):
            p = self.apply(job(f"save-{i}", saveEvery=every, mtbf="6h"))
            self.assertEqual(p.returncode, 0, f"saveEvery {every!r}" + out(p))
            spec = self.get(f"save-{i}")["spec"]
            self.assertEqual((spec["saveEvery"], spec["mtbf"]), (every, "6h"))
        p = self.apply(job("share", ckptCopyShare=0.1))
        self.assertEqual(p.returncode, 0, out(p))
        self.assertEqual(self.get("share")["spec"]["ckptCopyShare"], 0.1)
        # accepted node counts (pattern + the CEL MIN <= MAX rule)
        for i, nodes in enumerate(["1", "3:3", "16:1024"]):
            p = self.apply(job(f"nodes-{i}", nodes=nodes))
            self.assertEqual(p.returncode, 0, f"nodes {nodes!r}" + out(p))

    # --- (b) malformed jobs are rejected, naming the field
    def test_malformed_rejected(self):
        no_command = {"name": "trainer", "image": "my-train:latest"}
        cases = [
            ("nprocPerNode 0", job(nprocPerNode=0), ["spec.nprocPerNode", "greater than or equal to 1"]),
            ("nprocPerNode 2000", job(nprocPerNode=2000), ["spec.nprocPerNode", "less than or equal to 1024"]),
            ("nodes 4:2", job(nodes="4:2"), ["spec.nodes", "MIN must not exceed MAX"]),
            ("nodes two", job(nodes="two"), ["spec.nodes", "should match"]),
            ("nodes 0", job(nodes="0"), ["spec.nodes", "should match"]),
            ("nodes 2 (a number, not a string)", job(nodes=2), ["spec.nodes", "must be of type string"]),
            ("nodes missing", job(nodes=None), ["spec.nodes", "Required value"]),
            ("template missing", job(template=None), ["spec.template", "Required value"]),
            ("containers []", job(containers=[]), ["spec.template.spec.containers", "at least 1 items"]),
            ("first container without command", job(containers=[no_command]),
             ["spec.template.spec.containers", "the first container needs a command"]),
            ("container with command []", job(containers=[dict(no_command, command=[])]),
             ["spec.template.spec.containers[0].command", "at least 1 items"]),
            ("excludeStragglers without networkCheck", job(excludeStragglers=True),
             ["spec.excludeStragglers", "needs spec.networkCheck: true"]),
            ("unknown field nprocs (typo)", job(nprocPerNode=None, nprocs=2), ['unknown field "spec.nprocs"']),
            ("unknown field next to valid ones", job(nprocs=2), ['unknown field "spec.nprocs"']),
            ("maxRestarts -1", job(maxRestarts=-1), ["spec.maxRestarts", "greater than or equal to 0"]),
            ("spares -1", job(spares=-1), ["spec.spares", "greater than or equal to 0"]),
            ("pendingTimeoutSeconds 0", job(pendingTimeoutSeconds=0),
             ["spec.pendingTimeoutSeconds", "greater than or equal to 1"]),
            ("ckptCopyShare 0", job(ckptCopyShare=0), ["spec.ckptCopyShare", "greater than 0"]),
            ("ckptCopyShare 2", job(ckptCopyShare=2), ["spec.ckptCopyShare", "less than or equal to 1"]),
        ]
        for what, obj, needles in cases:
            with self.subTest(what):
                p = self.apply(obj)
                self.assertNotEqual(p.returncode, 0, f"{what}: accepted" + out(p))
                for n in needles:
                    self.assertIn(n, p.stderr, f"{what}: message lacks {n!r}" + out(p))
        p = self.k.kubectl("-n", self.ns, "get", "elasticjobs", "-o", "name")
        self.assertEqual(p.stdout.strip(), "", "a malformed job was stored" + out(p))
        # a sidecar needs no command: only the first container trains
        sidecar = job("sidecar", containers=[{"name": "trainer", "image": "t", "command": ["python3", "t.py"]},
                                             {"name": "logs", "image": "fluent-bit"}])
        p = self.apply(sidecar)
        self.assertEqual(p.returncode, 0, out(p))
        # excludeStragglers with networkCheck is fine
        p = self.apply(job("stragglers", excludeStragglers=True, networkCheck=True))
        self.assertEqual(p.returncode, 0, out(p))

    def test_unknown_fields_strict_by_default(self):
        """Rejecting unknown fields is kubectl's doing (field validation Strict, its default):
        the schema itself prunes them, as an explicit --validate=ignore shows."""
        p = self.apply(job("typo", nprocs=2), "--validate=ignore")
        self.assertEqual(p.returncode, 0, out(p))
        self.assertNotIn("nprocs", self.get("typo")["spec"], "unknown field not pruned")
        p = self.apply(job("typo2", nprocs=2), "--validate=strict")
        self.assertIn('unknown field "spec.nprocs"', p.stderr, out(p))

    # --- (c) printer columns and the status subresource
    def test_columns_and_status_subresource(self):
        p = self.apply(job("cols"))
        self.assertEqual(p.returncode, 0, out(p))
        p = self.k.kubectl("-n", self.ns, "get", "elasticjobs")
        self.assertEqual(p.stdout.splitlines()[0].split(),
                         ["NAME", "PHASE", "ROUND", "WORLD", "RESTARTS", "GOODPUT", "AGE"], out(p))
        p = self.k.kubectl("-n", self.ns, "get", "ej", "-o", "wide")  # the short name, priority-1 columns
        self.assertEqual(p.stdout.splitlines()[0].split(),
                         ["NAME", "PHASE", "ROUND", "WORLD", "RESTARTS", "GOODPUT", "AGE",
                          "QUEUE", "REPLACEMENTS", "MESSAGE"], out(p))

        status = {"phase": "Running", "round": 2, "world": "3/4 nodes, 6 workers", "nodes": 3,
                  "workers": 6, "restarts": 1, "replacements": 1, "masterRestarts": 0,
                  "goodput": "97.5%", "message": "round 2 training", "masterPod": "cols-master",
                  "startTime": "2025-01-02T03:04:05Z", "observedGeneration": 1,
                  "conditions": [{"type": "Running", "status": "True", "reason": "RoundFormed",
                                  "message": "round 2", "lastTransitionTime": "2025-01-02T03:04:05Z"}]}
        self.k.api("PATCH", self.path("cols", "/status"), {"status": status},
                   ctype="application/merge-patch+json")
        self.assertEqual(self.get("cols")["status"], status)
        p = self.k.kubectl("-n", self.ns, "get", "elasticjobs", "-o", "wide")
        row = p.stdout.splitlines()[1]
        for v in ["cols", "Running", "3/4 nodes, 6 workers", "97.5%", "round 2 training"]:
            self.assertIn(v, row, out(p))
        cols, cells = self.table("cols")
        self.assertEqual(cols, ["Name", "Phase", "Round", "World", "Restarts", "Goodput", "Age",
                                "Queue", "Replacements", "Message"])
        self.assertEqual(cells[:6], ["cols", "Running", 2, "3/4 nodes, 6 workers", 1, "97.5%"])
        self.assertIn(cells[7], (None, ""))  # no kueue.x-k8s.io/queue-name label
        self.assertEqual(cells[8:], [1, "round 2 training"])

        # the main resource ignores .status (a spec change still goes through)
        p = self.k.kubectl("-n", self.ns, "patch", "elasticjob", "cols", "--type=merge",
                           "-p", json.dumps({"spec": {"maxRestarts": 5},
                                             "status": {"phase": "Failed", "round": 9}}))
        ej = self.get("cols")
        self.assertEqual(ej["status"]["phase"], "Running", out(p))
        self.assertEqual(ej["status"]["round"], 2, out(p))
        self.assertEqual(ej["spec"]["maxRestarts"], 5, out(p))
        self.assertEqual(ej["metadata"]["generation"], 2)
        # ... and the status subresource ignores .spec
        self.k.api("PATCH", self.path("cols", "/status"), {"spec": {"maxRestarts": 7}, "status": {"round": 3}},
                   ctype="application/merge-patch+json")
        ej = self.get("cols")
        self.assertEqual((ej["spec"]["maxRestarts"], ej["status"]["round"]), (5, 3))

        # status is validated too
        p = self.k.kubectl("-n", self.ns, "patch", "elasticjob", "cols", "--subresource=status",
                           "--type=merge", "-p", '{"status": {"phase": "Bogus"}}', check=False)
        self.assertNotEqual(p.returncode, 0, out(p))
        self.assertIn("status.phase", p.stderr, out(p))
        self.assertIn("Unsupported value", p.stderr, out(p))

    def test_explain_and_descriptions(self):
        """Every schema property has a description (kubectl explain shows them)."""
        crd = json.loads(self.k.kubectl("get", "crd", CRD, "-o", "json").stdout)
        v = crd["spec"]["versions"][0]
        self.assertEqual(crd["spec"]["names"]["shortNames"], ["ej"])
        self.assertNotIn("categories", crd["spec"]["names"])
        self.assertEqual(v["subresources"], {"status": {}})
        missing = []

        def walk(s, path):
            for name, sub in (s.get("properties") or {}).items():
                p = f"{path}.{name}"
                if path != "" and not sub.get("description") and p != ".metadata":
                    missing.append(p)
                walk(sub, p)
            if "items" in s:
                walk(s["items"], path + "[]")
        walk(v["schema"]["openAPIV3Schema"], "")
        top = v["schema"]["openAPIV3Schema"]["properties"]
        for name in ("spec", "status"):
            self.assertTrue(top[name].get("description"), name)
        self.assertEqual(missing, [], "properties without a description")
        p = self.k.kubectl("explain", "elasticjob.spec.nodes")
        self.assertIn("MIN:MAX", p.stdout, out(p))

    # --- (d) RBAC
    def test_operator_rbac(self):
        yes = [
            ("create", "pods", f"-n={self.ns}"),
            ("create", "pods", "--all-namespaces"),
            ("delete", "pods", "--all-namespaces"),
            ("watch", "pods", "--all-namespaces"),
            ("create", "services", f"-n={self.ns}"),
            ("create", "secrets", f"-n={self.ns}"),
            ("create", "serviceaccounts", f"-n={self.ns}"),
            ("create", "rolebindings.rbac.authorization.k8s.io", f"-n={self.ns}"),
            ("bind", "clusterroles.rbac.authorization.k8s.io/ballast-master"),
            ("bind", "clusterroles.rbac.authorization.k8s.io/ballast-worker"),
            ("delete", "configmaps", f"-n={self.ns}"),
            ("update", "leases.coordination.k8s.io", "-n=ballast-system"),
            ("watch", "elasticjobs.ballast.dev", "--all-namespaces"),
            ("update", "elasticjobs.ballast.dev", "--subresource=status", f"-n={self.ns}"),
            ("patch", "elasticjobs.ballast.dev", "--subresource=status", f"-n={self.ns}"),
            ("update", "elasticjobs.ballast.dev", "--subresource=finalizers", f"-n={self.ns}"),
            ("create", "events", f"-n={self.ns}"),
            ("create", "events.events.k8s.io", f"-n={self.ns}"),
        ]
        no = [
            ("delete", "nodes"),
            ("create", "clusterroles.rbac.authorization.k8s.io"),
            ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
            ("bind", "clusterroles.rbac.authorization.k8s.io/cluster-admin"),
            ("escalate", "clusterroles.rbac.authorization.k8s.io/ballast-master"),
            ("update", "clusterroles.rbac.authorization.k8s.io/ballast-master"),
            ("create", "elasticjobs.ballast.dev", f"-n={self.ns}"),
            ("delete", "elasticjobs.ballast.dev", f"-n={self.ns}"),
            ("update", "pods", f"-n={self.ns}"),
            ("create", "pods", "--subresource=exec", f"-n={self.ns}"),
            ("create", "deployments.apps", f"-n={self.ns}"),
            ("delete", "namespaces"),
        ]
        for args in yes:
            ans, p = self.can_i(*args)
            self.assertEqual(ans, "yes", f"operator can-i {' '.join(args)}" + out(p))
        for args in no:
            ans, p = self.can_i(*args)
            self.assertEqual(ans, "no", f"operator can-i {' '.join(args)}" + out(p))

        # The real thing: as the operator, bind ballast-master (allowed by `bind`, though the
        # operator lacks pods/patch) but not cluster-admin (escalation check).
        master_sa = f"system:serviceaccount:{self.ns}:job-master"
        as_op = f"--as={OPERATOR_SA}"
        self.k.kubectl("-n", self.ns, "create", "serviceaccount", "job-master", as_op)
        p = self.k.kubectl("-n", self.ns, "create", "rolebinding", "job-master", "--clusterrole=ballast-master",
                           f"--serviceaccount={self.ns}:job-master", as_op, check=False)
        self.assertEqual(p.returncode, 0, "the operator cannot bind ballast-master" + out(p))
        p = self.k.kubectl("-n", self.ns, "create", "rolebinding", "admin", "--clusterrole=cluster-admin",
                           f"--serviceaccount={self.ns}:job-master", as_op, check=False)
        self.assertNotEqual(p.returncode, 0, "the operator bound cluster-admin" + out(p))
        self.assertIn("forbidden", p.stderr, out(p))

        # What that RoleBinding gives the job's master: its namespace only.
        other = self.k.namespace(self, prefix="crd-other")
        master_yes = [("create", "pods"), ("patch", "pods"), ("delete", "pods"), ("watch", "pods"),
                      ("create", "events"), ("create", "events.events.k8s.io"),
                      ("get", "elasticjobs.ballast.dev"), ("watch", "elasticjobs.ballast.dev"),
                      ("patch", "elasticjobs.ballast.dev", "--subresource=status"),
                      # The job's Lease and its state outside the master pod (takeover).
                      ("create", "leases.coordination.k8s.io"), ("update", "leases.coordination.k8s.io"),
                      ("create", "configmaps"), ("update", "configmaps"), ("get", "configmaps")]
        master_no = [("update", "elasticjobs.ballast.dev"), ("delete", "elasticjobs.ballast.dev"),
                     ("get", "secrets"), ("create", "pods", "--subresource=exec"), ("create", "services"),
                     ("delete", "leases.coordination.k8s.io"), ("delete", "configmaps")]
        for args in master_yes:
            ans, p = self.can_i(*args, f"-n={self.ns}", as_=master_sa)
            self.assertEqual(ans, "yes", f"master can-i {' '.join(args)}" + out(p))
            ans, p = self.can_i(*args, f"-n={other}", as_=master_sa)
            self.assertEqual(ans, "no", f"master can-i {' '.join(args)} in another namespace" + out(p))
        for args in master_no:
            ans, p = self.can_i(*args, f"-n={self.ns}", as_=master_sa)
            self.assertEqual(ans, "no", f"master can-i {' '.join(args)}" + out(p))

        # The workers' service account, bound to ballast-worker by the operator: it reads
        # the job's Lease (where a new master serves) and nothing else.
        worker_sa = f"system:serviceaccount:{self.ns}:default"
        p = self.k.kubectl("-n", self.ns, "create", "rolebinding", "job-worker", "--clusterrole=ballast-worker",
                           f"--serviceaccount={self.ns}:default", as_op, check=False)
        self.assertEqual(p.returncode, 0, "the operator cannot bind ballast-worker" + out(p))
        ans, p = self.can_i("get", "leases.coordination.k8s.io", f"-n={self.ns}", as_=worker_sa)
        self.assertEqual(ans, "yes", "worker can-i get leases" + out(p))
        for args in [("update", "leases.coordination.k8s.io"), ("get", "configmaps"), ("get", "secrets"),
                     ("list", "pods")]:
            ans, p = self.can_i(*args, f"-n={self.ns}", as_=worker_sa)
            self.assertEqual(ans, "no", f"worker can-i {' '.join(args)}" + out(p))


if __name__ == "__main__":
    unittest.main()
