"""The Helm chart (deploy/helm/ballast), rendered by a real helm (built from the Go module
proxy: scripts/k8s/build-helm.sh) and applied to the real API server:

- with the defaults it renders what `kubectl apply -f deploy/` applies, object by object
  (labels aside): the two never drift apart;
- that rendering applied for real to the running install changes nothing that matters
  (no operator rollout), and the operator keeps reconciling;
- every value (image, namespace, replicas, master address mode, journal, watched
  namespace, cordoning RBAC, resources) renders into valid objects: the API server
  accepts them (server-side dry run: admission, schema and RBAC escalation checks).
"""
import glob
import json
import os
import subprocess
import tempfile
import unittest

import yaml

from _cluster import ROOT, Suite
from _jobs import JobHarness, sleep_job

CHART = os.path.join(ROOT, "deploy", "helm", "ballast")
CHART_LABELS = ("app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "helm.sh/chart")


def helm_bin():
    p = subprocess.run([os.path.join(ROOT, "scripts", "k8s", "build-helm.sh")], capture_output=True, text=True)
    if p.returncode != 0:
        raise AssertionError(f"cannot build helm (scripts/k8s/build-helm.sh):\n{p.stderr}")
    return os.path.join(p.stdout.strip(), "helm")


def docs(text):
    return [d for d in yaml.safe_load_all(text) if d]


def key(obj):
    return (obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"])


class HelmChartTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.k = Suite.get()
        cls.k.install()
        cls.helm = helm_bin()

    def render(self, *args, namespace="ballast-system"):
        p = subprocess.run([self.helm, "template", "ballast", CHART, "--namespace", namespace, "--include-crds",
                            *args], capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        return p.stdout

    def test_defaults_render_what_deploy_applies(self):
        rendered = {key(o): o for o in docs(self.render("--set", "namespace.create=true"))}
        applied = {}
        for path in sorted(glob.glob(os.path.join(ROOT, "deploy", "*.yaml"))):
            with open(path) as f:
                for o in docs(f.read()):
                    applied[key(o)] = o
        self.assertEqual(sorted(rendered), sorted(applied), "the same objects in deploy/ and the chart")
        for k, want in applied.items():
            got = json.loads(json.dumps(rendered[k]))
            labels = got["metadata"].pop("labels", {})
            want = json.loads(json.dumps(want))
            want_labels = want["metadata"].pop("labels", {})
            self.assertEqual({l: v for l, v in labels.items() if l not in CHART_LABELS}, want_labels, k)
            self.assertEqual(got, want, f"{k} differs between deploy/ and deploy/helm/ballast: change both")

    def test_the_default_rendering_applied_to_the_running_install_keeps_it_working(self):
        operators = lambda: sorted(p["metadata"]["name"] for p in  # noqa: E731
                                   self.k.pods("ballast-system", "app.kubernetes.io/name=ballast-operator"))
        before = operators()
        p = self.k.kubectl("apply", "-f", "-", input=self.render())
        self.assertIn("deployment.apps/ballast-operator", p.stdout)
        dep = self.k.api("GET", "/apis/apps/v1/namespaces/ballast-system/deployments/ballast-operator")
        self.assertEqual(dep["metadata"]["labels"]["app.kubernetes.io/managed-by"], "Helm")
        self.assertEqual(operators(), before, "labels on the Deployment alone: no rollout")
        # The operator still reconciles: a job gets its master pod.
        ns = self.k.namespace(self)
        j = JobHarness(self, self.k, ns, "helmjob")
        j.apply(sleep_job("helmjob", ns, "1", seconds=1))
        j.wait_phase("Succeeded", 120)

    def test_every_value_renders_objects_the_api_server_accepts(self):
        # A namespace of its own (a dry run cannot create objects in one it only pretends to create).
        ns = self.k.namespace(self, prefix="mlp")
        out = self.render("--set", "image.repository=registry.example.com/ml/ballast",
                          "--set", "image.tag=9.9.9", "--set", "operator.replicas=3",
                          "--set", "operator.masterAddress=pod-ip", "--set", "operator.masterJournal=none",
                          "--set", "operator.watchNamespace=ml", "--set", "rbac.cordonNodes.enabled=true",
                          "--set", "rbac.cordonNodes.namespaces={ml,research}",
                          "--set", "operator.resources.limits.memory=512Mi",
                          "--set", "imagePullSecrets[0].name=regcred", namespace=ns)
        objs = {key(o): o for o in docs(out)}
        dep = objs[("Deployment", ns, "ballast-operator")]
        c = dep["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        self.assertEqual(dep["spec"]["replicas"], 3)
        self.assertEqual(c["image"], "registry.example.com/ml/ballast:9.9.9")
        self.assertEqual(env["BALLAST_IMAGE"], "registry.example.com/ml/ballast:9.9.9")
        self.assertEqual(env["BALLAST_MASTER_ADDRESS"], "pod-ip")
        self.assertEqual(env["BALLAST_MASTER_JOURNAL"], "none")
        self.assertEqual(c["command"], ["ballast", "operator", "--namespace", "ml"])
        self.assertEqual(c["resources"]["limits"]["memory"], "512Mi")
        self.assertEqual(dep["spec"]["template"]["spec"]["imagePullSecrets"], [{"name": "regcred"}])
        crb = objs[("ClusterRoleBinding", "", "ballast-operator")]
        self.assertEqual(crb["subjects"][0]["namespace"], ns)
        self.assertIn(("Role", ns, "ballast-operator-leader"), objs)
        self.assertNotIn(("Namespace", "", ns), objs)
        self.assertEqual(objs[("ClusterRole", "", "ballast-master-cordon")]["rules"][0]["verbs"], ["get", "patch"])
        self.assertEqual(objs[("ClusterRoleBinding", "", "ballast-master-cordon-research")]["subjects"][0]["name"],
                         "system:serviceaccounts:research")
        p = self.k.kubectl("apply", "--dry-run=server", "-f", "-", input=out, check=False)
        self.assertEqual(p.returncode, 0, f"the API server refused the rendered chart:\n{p.stdout}\n{p.stderr}")
        self.assertIn("deployment.apps/ballast-operator created (server dry run)", p.stdout)


if __name__ == "__main__":
    unittest.main()
