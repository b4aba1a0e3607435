"""Kueue for the Kubernetes tests: the real Kueue controller manager (a pinned
release built from the Go module proxy by scripts/k8s/build-kueue.sh, cached),
run as a host process against the suite's API server, with its CRDs.

What is configured, and why:
- Kueue's Configuration (config.kueue.x-k8s.io/v1beta2): integrations.frameworks
  ["batch/job"] and externalFrameworks ["ElasticJob.v1alpha1.ballast.dev"] (the
  snippet deploy/kueue/ documents); leader election off (one replica); metrics
  and health probes on loopback; internalCertManagement off: the test makes a CA
  and a serving certificate for 127.0.0.1 itself.
- Webhooks: the test cluster has no Service network (no kube-proxy), so the API
  server reaches Kueue's webhook server by URL, https://127.0.0.1:PORT/<path>,
  with the test CA as caBundle. Only Kueue's own kinds' webhooks are registered
  (Workload, ClusterQueue, LocalQueue, ResourceFlavor, Cohort, ...): the other
  frameworks' (batch Job, Pod, Deployment, ...) would make every pod create of
  the other tests depend on Kueue. The CRDs' conversion webhooks (v1beta1 <->
  v1beta2, served at /convert) point there too.
- Feature gate VisibilityOnDemand off: its aggregated API server is not needed.
- Kueue's metrics server takes its certificate from /etc/kueue/metrics/certs
  (a fixed path): the test's serving certificate is put there through an
  overlay on /etc in Kueue's own mount namespace.

Kueue.start(suite) starts it (once per test module), Kueue.stop() stops it and
removes the webhook configurations (so nothing depends on a stopped Kueue).
"""
import base64
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import yaml

from _cluster import ROOT, log

sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from _ports import free_port  # noqa: E402  (below the ephemeral range: no outgoing connection takes it first)

BUILD = os.path.join(ROOT, "scripts", "k8s", "build-kueue.sh")
EXTERNAL_FRAMEWORK = "ElasticJob.v1alpha1.ballast.dev"
WEBHOOK_NAMES = ("ballast-test-kueue-mutating", "ballast-test-kueue-validating")
API = "/apis/kueue.x-k8s.io/v1beta2"


def make_certs(d):
    """A CA and a serving certificate for 127.0.0.1 (openssl)."""
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=ballast-test-kueue-ca",
        "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.crt")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", f"{d}/tls.key",
        "-out", f"{d}/tls.csr")
    with open(f"{d}/ext.cnf", "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", f"{d}/tls.csr", "-CA", f"{d}/ca.crt", "-CAkey", f"{d}/ca.key", "-CAcreateserial",
        "-days", "2", "-extfile", f"{d}/ext.cnf", "-out", f"{d}/tls.crt")
    with open(f"{d}/ca.crt", "rb") as f:
        return base64.b64encode(f.read()).decode()


class Kueue:
    def __init__(self, suite):
        self.k = suite
        self.proc = None
        self.dir = tempfile.mkdtemp(prefix="ballast-kueue-", dir=suite.dir)

    def start(self):
        t0 = time.time()
        log("Kueue: building or finding the cached build (the first build takes minutes)")
        cache = subprocess.run([BUILD], check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        ca = make_certs(self.dir)
        self.webhook_port, health, metrics = free_port(), free_port(), free_port()
        url = f"https://127.0.0.1:{self.webhook_port}"
        # CRDs, their conversion webhooks pointed at the webhook server.
        docs = []
        crd_dir = os.path.join(cache, "crds")
        for name in sorted(os.listdir(crd_dir)):
            with open(os.path.join(crd_dir, name)) as f:
                for crd in yaml.safe_load_all(f):
                    if not crd:
                        continue
                    if len(crd["spec"]["versions"]) > 1:
                        crd["spec"]["conversion"] = {
                            "strategy": "Webhook",
                            "webhook": {"clientConfig": {"url": f"{url}/convert", "caBundle": ca},
                                        "conversionReviewVersions": ["v1"]}}
                    docs.append(crd)
        self.apply(docs)
        self.k.crds_established([d["metadata"]["name"] for d in docs])
        # Kueue's manager looks its kinds up in discovery once, at start.
        self.k.wait(lambda: self.k.kubectl("api-resources", "--api-group=kueue.x-k8s.io", check=False).stdout
                    .count("kueue.x-k8s.io/v1beta2") >= len(docs) - 1, 60, "Kueue's kinds in discovery")
        # Kueue's own kinds' webhooks, by URL.
        hooks = []
        with open(os.path.join(cache, "webhook", "manifests.yaml")) as f:
            for cfg, name in zip(yaml.safe_load_all(f), WEBHOOK_NAMES):
                cfg["metadata"] = {"name": name}
                kept = []
                for w in cfg["webhooks"]:
                    path = w["clientConfig"]["service"]["path"]
                    if "-kueue-x-k8s-io-" not in path:
                        continue
                    w["clientConfig"] = {"url": url + path, "caBundle": ca}
                    w.pop("namespaceSelector", None)
                    kept.append(w)
                cfg["webhooks"] = kept
                hooks.append(cfg)
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
            "namespace": "kueue-system",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
            "metrics": {"bindAddress": f"127.0.0.1:{metrics}"},
            "webhook": {"port": self.webhook_port, "host": "127.0.0.1", "certDir": self.dir},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "manageJobsWithoutQueueName": False,
            "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [EXTERNAL_FRAMEWORK]},
        }
        cfg_path = os.path.join(self.dir, "config.yaml")
        with open(cfg_path, "w") as f:
            yaml.safe_dump(config, f)
        self.k.kubectl("create", "namespace", "kueue-system", check=False)
        self.log_path = os.path.join(self.dir, "kueue.log")
        env = dict(os.environ, KUBECONFIG=self.k.env["KUBECONFIG"])
        # Kueue reads its metrics server's certificate from a fixed path,
        # /etc/kueue/metrics/certs, when it does not manage certificates itself:
        # the process sees it there through an overlay on /etc in a mount
        # namespace of its own (the machine's /etc is not touched).
        upper = os.path.join(self.dir, "etc-upper")
        certs = os.path.join(upper, "kueue", "metrics", "certs")
        os.makedirs(certs)
        os.makedirs(os.path.join(self.dir, "etc-work"))
        for name in ("tls.crt", "tls.key"):
            shutil.copy(os.path.join(self.dir, name), certs)
        argv = [os.path.join(cache, "bin", "kueue"), "--config", cfg_path,
                "--feature-gates=VisibilityOnDemand=false", "--zap-log-level=2"]
        script = (f"mount -t overlay overlay -o lowerdir=/etc,upperdir={upper},workdir={self.dir}/etc-work /etc "
                  f"&& exec {' '.join(shlex.quote(a) for a in argv)}")
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                # setpriv: Kueue dies with this test process (a test killed by its
                # timeout leaves no Kueue behind); unshare and sh exec, one pid throughout.
                ["setpriv", "--pdeathsig", "KILL", "--", "unshare", "-m", "--propagation", "private", "sh", "-c",
                 script],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"Kueue exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                import urllib.request
                with urllib.request.urlopen(f"http://127.0.0.1:{health}/readyz", timeout=2) as r:
                    return r.status == 200
            except Exception:
                return False
        self.k.wait(ready, 120, "Kueue's readyz")
        # The webhook server answers: register the webhooks now (failurePolicy Fail).
        self.apply(hooks)
        log(f"Kueue up ({time.time() - t0:.1f} s; log {self.log_path})")
        return self

    def apply(self, docs):
        self.k.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                       input="\n---\n".join(json.dumps(d) for d in docs))

    def log_tail(self, n=60):
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self):
        for kind, name in zip(("mutatingwebhookconfiguration", "validatingwebhookconfiguration"), WEBHOOK_NAMES):
            self.k.kubectl("delete", kind, name, "--ignore-not-found", check=False)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    # --- objects ---
    def create(self, plural, body, ns=None):
        path = f"{API}/namespaces/{ns}/{plural}" if ns else f"{API}/{plural}"
        body = dict(body, apiVersion="kueue.x-k8s.io/v1beta2")
        return self.k.api("POST", path, body)

    def workloads(self, ns):
        return self.k.api("GET", f"{API}/namespaces/{ns}/workloads")["items"]
