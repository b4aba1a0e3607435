#!/usr/bin/python3
"""The KubeRay RayJob example (examples/ray/rayjob.yaml) against KubeRay's own CRDs on a real API server.

    cd tests/kubernetes && /usr/bin/python3 -m unittest -v test_kuberay

KubeRay's operator does not run here (its RayCluster pods would need a container
runtime), so the example's job is not run; what can be checked is checked: the
API server, with KubeRay v1.5.0's RayJob and RayCluster CRDs installed
(scripts/k8s/kuberay-crds.sh, from the Go module proxy), accepts the example
as it is, with kubectl's strict field validation (a misplaced or misspelled
field is an error, not dropped), and keeps what Ballast relies on; a RayJob
with a wrong type or an unknown field is refused (the check can fail); and the
RayJob's entrypoint is a command line `ballast ray run` accepts (its flags
parse), while a misspelled flag is refused.
"""
import copy
import json
import os
import shlex
import subprocess
import unittest

import yaml

from _cluster import ROOT, Suite, out

EXAMPLE = os.path.join(ROOT, "examples", "ray", "rayjob.yaml")
FETCH = os.path.join(ROOT, "scripts", "k8s", "kuberay-crds.sh")
BALLAST = os.environ.get("BALLAST_BIN", os.path.join(ROOT, "build", "bin", "ballast"))


class KubeRayExampleTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.k = Suite.get()
        cache = subprocess.run([FETCH], check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        docs = []
        for name in ("ray.io_rayclusters.yaml", "ray.io_rayjobs.yaml"):
            with open(os.path.join(cache, "crds", name)) as f:
                docs.extend(d for d in yaml.safe_load_all(f) if d)
        # Server-side: the RayJob CRD (1.3 MB) is too large for client-side apply's annotation.
        cls.k.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                      input="\n---\n".join(json.dumps(d) for d in docs))
        cls.k.crds_established([d["metadata"]["name"] for d in docs])
        # Established comes before discovery and the OpenAPI schema kubectl's validation uses.
        cls.k.wait(lambda: cls.k.kubectl("get", "rayjobs", "-A", check=False).returncode == 0,
                   30, "kubectl get rayjobs to work")
        cls.crds = [d["metadata"]["name"] for d in docs]
        with open(EXAMPLE) as f:
            cls.text = f.read()
        cls.example = yaml.safe_load(cls.text)

    @classmethod
    def tearDownClass(cls):
        # The suite's cluster as the next module expects it: no KubeRay kinds.
        cls.k.kubectl("delete", "crd", *cls.crds, "--wait=false", check=False)

    def setUp(self):
        self.ns = self.k.namespace(self, prefix="kuberay")

    def apply(self, text):
        return self.k.kubectl("-n", self.ns, "apply", "-f", "-", input=text, check=False)

    def test_the_example_is_accepted_as_written(self):
        p = self.apply(self.text)
        self.assertEqual(p.returncode, 0, "KubeRay's RayJob CRD refused examples/ray/rayjob.yaml" + out(p))
        got = json.loads(self.k.kubectl("-n", self.ns, "get", "rayjob", self.example["metadata"]["name"],
                                        "-o", "json").stdout)
        spec, want = got["spec"], self.example["spec"]
        self.assertEqual(spec["entrypoint"], want["entrypoint"])
        self.assertTrue(spec["shutdownAfterJobFinishes"])
        cluster = spec["rayClusterSpec"]
        # The head runs the driver and the master, no agent: 0 CPUs for Ray's scheduling.
        self.assertEqual(cluster["headGroupSpec"]["rayStartParams"], {"num-cpus": "0"})
        group = cluster["workerGroupSpecs"][0]
        self.assertEqual((group["replicas"], group["minReplicas"], group["maxReplicas"]), (4, 2, 4))
        pod = group["template"]["spec"]
        self.assertEqual(pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"], "8")
        # Flash checkpoints live in /dev/shm: a memory-backed volume of the worker pods, kept by the server.
        self.assertEqual(pod["containers"][0]["volumeMounts"], [{"name": "dshm", "mountPath": "/dev/shm"}])
        self.assertEqual(pod["volumes"], [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}])

    def test_a_malformed_rayjob_is_refused_naming_the_field(self):
        bad_type = copy.deepcopy(self.example)
        bad_type["metadata"]["name"] = "bad-type"
        bad_type["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "four"
        p = self.apply(json.dumps(bad_type))
        self.assertNotEqual(p.returncode, 0, "a string replica count was accepted" + out(p))
        self.assertIn("replicas", p.stderr, out(p))
        unknown = copy.deepcopy(self.example)
        unknown["metadata"]["name"] = "unknown-field"
        unknown["spec"]["entryPoint"] = unknown["spec"].pop("entrypoint")
        p = self.apply(json.dumps(unknown))
        self.assertNotEqual(p.returncode, 0, "a misspelled field was accepted" + out(p))
        self.assertIn("entryPoint", p.stderr, out(p))

    def ray_run(self, argv):
        """`ballast ray run` with the entrypoint's flags, its bridge on Debian's python3, which has no Ray:
        flags that parse get as far as the bridge (exit 1, Ray or Ballast missing there); a bad flag exits 2."""
        words = shlex.split(argv)
        self.assertEqual(words[:3], ["ballast", "ray", "run"], "the entrypoint is not a `ballast ray run` line")
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
        return subprocess.run([BALLAST, "ray", "run", "--bridge-python", "/usr/bin/python3", *words[3:]],
                              capture_output=True, text=True, env=env, timeout=60)

    def test_the_entrypoint_is_a_ballast_ray_run_command_line(self):
        entrypoint = self.example["spec"]["entrypoint"]
        p = self.ray_run(entrypoint)
        self.assertEqual(p.returncode, 1, out(p))
        self.assertNotIn("unknown flag", p.stderr, out(p))
        self.assertIn("not installed for /usr/bin/python3", p.stderr, out(p))
        p = self.ray_run(entrypoint.replace("--gpus-per-node", "--gpu-per-node"))
        self.assertEqual(p.returncode, 2, out(p))
        self.assertIn("unknown flag --gpu-per-node", p.stderr, out(p))


if __name__ == "__main__":
    unittest.main()
