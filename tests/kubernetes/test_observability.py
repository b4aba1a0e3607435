"""A job's dashboard and metrics on the cluster: the master pod serves the dashboard,
/api/v1/job, /api/v1/events and /metrics (the job token) on its http port, which its
Service exposes; `kubectl get elasticjobs` shows the job's goodput; a real Prometheus
finds the master pod by its prometheus.io annotations (as docs/kubernetes.md's kubernetes_sd
scrape config does; Debian's Prometheus lacks kubernetes_sd, so the test discovers the
pods into a file_sd file) and scrapes it with the job's token; a real headless
Chromium renders the dashboard.
"""
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import unittest
import urllib.parse
import urllib.request

from _jobs import JobHarness, JobTestCase, train_job, wait_steps
from _cluster import ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from _ports import free_port  # noqa: E402  (below the ephemeral range: no outgoing connection takes it first)


def need(tool):
    path = shutil.which(tool)
    if path is None:
        raise AssertionError(f"{tool} is not installed: scripts/install-deps.sh installs it (make test runs it)")
    return path


def http_get(url, token=None, timeout=10):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def scrape_config(targets_file, job_token_file):
    """Debian's Prometheus is built without kubernetes_sd: the test discovers the master pods
    itself, the way docs/kubernetes.md's kubernetes_sd relabeling does (pods annotated
    prometheus.io/scrape=true, their prometheus.io/port and path), into a file_sd file."""
    return f"""global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: ballast-masters
    file_sd_configs:
      - files: [{targets_file}]
        refresh_interval: 1s
    authorization:
      credentials_file: {job_token_file}
    relabel_configs:
      - source_labels: [__meta_path]
        target_label: __metrics_path__
"""


def discover(pods):
    """What docs/kubernetes.md's kubernetes_sd relabel_configs keep and rewrite, for file_sd."""
    groups = []
    for p in pods:
        a = p["metadata"].get("annotations") or {}
        if a.get("prometheus.io/scrape") != "true" or not p["status"].get("podIP"):
            continue
        ports = [c["containerPort"] for c in p["spec"]["containers"][0].get("ports", []) if c.get("name") == "http"]
        if not ports or str(ports[0]) != a.get("prometheus.io/port"):
            continue
        groups.append({"targets": [f"{p['status']['podIP']}:{ports[0]}"],
                       "labels": {"__meta_path": a.get("prometheus.io/path", "/metrics"),
                                  "elasticjob": p["metadata"]["labels"]["ballast.dev/job"],
                                  "namespace": p["metadata"]["namespace"]}})
    return groups


class ObservabilityTest(JobTestCase):
    def setUp(self):
        super().setUp()
        self.tmp = tempfile.mkdtemp(prefix="ballast-k8s-prom-")
        self.procs = []
        self.addCleanup(self.stop)

    def stop(self):
        for p in self.procs:
            p.kill()
            p.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_dashboard_metrics_and_goodput_of_a_job_on_the_cluster(self):
        name = "observed"
        j = JobHarness(self, self.k, self.ns, name)
        j.apply(train_job(name, self.ns, self.out, nodes="2", steps=400, step_time=0.1))
        self.k.wait(lambda: len(j.running()) == 2, 60, "2 worker pods Running")
        wait_steps(self.k, self.out, range(2), 5, 90)

        # The Service exposes the http port; the master pod serves on it (its pod IP: the
        # test cluster routes no Service traffic).
        svc = self.k.api("GET", f"/api/v1/namespaces/{self.ns}/services/{name}-master")
        self.assertIn({"name": "http", "port": 29401, "targetPort": 29401, "protocol": "TCP"}, svc["spec"]["ports"])
        master = j.running("master")[0]
        base = f"http://{master['status']['podIP']}:29401"
        secret = self.k.api("GET", f"/api/v1/namespaces/{self.ns}/secrets/{name}-token")
        token = base64.b64decode(secret["data"]["token"]).decode()
        doc = json.loads(http_get(base + "/api/v1/job", token))
        self.assertEqual(doc["job_id"], name)
        self.assertIn("node_joined", http_get(base + "/api/v1/events", token))
        with self.assertRaises(urllib.error.HTTPError) as refused:
            http_get(base + "/metrics")
        self.assertEqual(refused.exception.code, 401, "the metrics need the job token")

        # GOODPUT in `kubectl get elasticjobs`, once the workers report steps. The first
        # value is written when the master hears of the round's first step, when nothing was
        # productive yet (0.0%: startup is all there was); a change of goodput alone is
        # written every 5 s, so the column shows the share training earned after that.
        def goodput_column():
            p = self.k.kubectl("-n", self.ns, "get", "elasticjobs", name, "-o", "wide")
            header, row = p.stdout.splitlines()[:2]
            at = header.index("GOODPUT")  # columns are aligned; WORLD has spaces in it
            cell = row[at:].split()[0] if len(row) > at else ""
            return (p.stdout, cell) if cell.endswith("%") else None
        table, cell = self.k.wait(goodput_column, 60, "a GOODPUT value in kubectl get elasticjobs")
        self.assertGreaterEqual(float(cell.rstrip("%")), 0, table)
        table, cell = self.k.wait(lambda: (lambda c: c if c and float(c[1].rstrip("%")) > 0 else None)(
            goodput_column()), 30, "a GOODPUT above 0% in kubectl get elasticjobs (written every 5 s)")
        self.assertLessEqual(float(cell.rstrip("%")), 100, table)

        # A real Prometheus finds the master pod by its annotations and scrapes it.
        job_token = os.path.join(self.tmp, "job")
        with open(job_token, "w") as f:
            f.write(token)
        targets = os.path.join(self.tmp, "targets.json")
        with open(targets, "w") as f:
            json.dump(discover(self.k.pods(self.ns)), f)
        config = os.path.join(self.tmp, "prometheus.yml")
        with open(config, "w") as f:
            f.write(scrape_config(targets, job_token))
        port = free_port()
        log = open(os.path.join(self.tmp, "prometheus.log"), "w")
        self.procs.append(subprocess.Popen(
            [need("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={self.tmp}/tsdb",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT))
        prom = f"http://127.0.0.1:{port}"
        self.k.wait(lambda: _ok(lambda: "Ready" in http_get(prom + "/-/ready")), 60, "prometheus ready")

        def scraped():
            q = urllib.parse.quote(f'ballast_goodput_ratio{{elasticjob="{name}",namespace="{self.ns}"}}')
            r = _ok(lambda: json.loads(http_get(f"{prom}/api/v1/query?query={q}")))
            return r["data"]["result"] if r and r["data"]["result"] else None
        try:
            result = self.k.wait(scraped, 60, "ballast_goodput_ratio of the job in prometheus")
        except AssertionError:
            targets = _ok(lambda: http_get(prom + "/api/v1/targets")) or ""
            with open(os.path.join(self.tmp, "prometheus.log")) as f:
                raise AssertionError(f"not scraped; targets: {targets}\nprometheus log:\n{f.read()}")
        self.assertEqual(result[0]["metric"]["instance"], f"{master['status']['podIP']}:29401")
        print(f"\nmeasure: prometheus scraped the master pod at {result[0]['metric']['instance']}: "
              f"ballast_goodput_ratio {float(result[0]['value'][1]):.3f}; kubectl shows GOODPUT {cell}", flush=True)

        # The dashboard, rendered by a real headless Chromium.
        p = subprocess.run([need("chromium"), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                            f"--user-data-dir={self.tmp}/chrome", "--virtual-time-budget=3000", "--dump-dom",
                            f"{base}/?token={token}"], capture_output=True, text=True, timeout=90)
        self.assertRegex(p.stdout, r'id="round">\d+<', p.stderr[-2000:])
        self.assertRegex(p.stdout, r'id="goodput">[0-9.]+%<', p.stdout[-3000:])
        j.wait_phase("Succeeded", 240)


def _ok(fn):
    try:
        return fn()
    except (OSError, ValueError, KeyError):
        return None


if __name__ == "__main__":
    unittest.main()
