"""Goodput you can see, end to end: a real 2-node job under `ballast launch`
(real DDP on gloo, flash checkpoint every step), one worker SIGKILLed; then

  - GET /api/v1/job has the failure record (node, rank, cause, detection,
    resume time, steps lost) and `ballast status --json` is the same document;
  - GET /metrics passes `promtool check metrics`;
  - a real Prometheus scrapes the job with the token and returns
    ballast_goodput_ratio through its own query API;
  - the dashboard, loaded in a real headless Chromium, shows the right round,
    node count and goodput (a screenshot goes into the test output);
  - the job's summary line names the failure it survived.

Needs prometheus, promtool and chromium (scripts/install-deps.sh installs them).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request

from _util import free_port, wait_for

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("BALLAST_BIN", os.path.join(ROOT, "build", "bin", "ballast"))
PYTHON = os.environ.get("BALLAST_PYTHON", "/usr/bin/python3")
TRAIN = os.path.join(ROOT, "bench", "goodput_train.py")
OUTPUT = os.environ.get("BALLAST_TEST_OUTPUT", os.path.join(ROOT, "build", "test-output"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from train_events import read_events  # noqa: E402


def need(tool):
    path = shutil.which(tool)
    if path is None:
        raise RuntimeError(f"{tool} is not installed: run scripts/install-deps.sh (make test does)")
    return path


def http_get(url, token=None, timeout=10):
    req = urllib.request.Request(url)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


class ObserveTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ballast-observe-")
        self.procs = []

    def tearDown(self):
        if os.environ.get("BALLAST_KEEP_TMP"):
            print(f"kept {self.tmp}")
            self.tmp = "/nonexistent"
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def spawn(self, argv, log_name, **kw):
        log = open(os.path.join(self.tmp, log_name), "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **kw)
        log.close()
        self.procs.append(p)
        return p

    def log(self, name):
        with open(os.path.join(self.tmp, name), errors="replace") as f:
            return f.read()

    def start_prometheus(self, target, token):
        port = free_port()
        token_file = os.path.join(self.tmp, "token")
        with open(token_file, "w") as f:
            f.write(token)
        config = os.path.join(self.tmp, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                    "scrape_configs:\n  - job_name: ballast\n"
                    f"    authorization:\n      type: Bearer\n      credentials_file: {token_file}\n"
                    f"    static_configs:\n      - targets: ['{target}']\n")
        self.spawn([need("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={self.tmp}/tsdb",
                    f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"], "prometheus.log")
        base = f"http://127.0.0.1:{port}"
        wait_for("prometheus ready", lambda: "Ready" in http_get(base + "/-/ready"), 60)
        return base

    def chromium(self, url, *args):
        return subprocess.run([need("chromium"), "--headless", "--no-sandbox", "--disable-gpu",
                               "--disable-dev-shm-usage", f"--user-data-dir={self.tmp}/chrome",
                               # Virtual time waits for the page's fetches: its
                               # DOM is dumped after 3 s of its own clock.
                               "--virtual-time-budget=3000", *args, url],
                              capture_output=True, text=True, timeout=90)

    def test_a_failure_is_measured_exported_scraped_and_shown(self):
        promtool = need("promtool")
        need("chromium")
        out, ckpt = os.path.join(self.tmp, "out"), os.path.join(self.tmp, "ckpt")
        os.makedirs(out)
        job = self.spawn([BIN, "launch", "--nodes", "2", "--nproc-per-node", "1", "--python", PYTHON,
                          "--http-port", str(free_port()), TRAIN, "--out", out, "--ckpt-dir", ckpt,
                          "--ckpt", "ballast", "--steps", "260", "--step-time", "0.08", "--state-mb", "4"],
                         "job.log", cwd=self.tmp)
        url = wait_for("the dashboard URL", lambda: re.search(r"dashboard: (http://\S+)", self.log("job.log")), 60)
        url = url.group(1)
        parsed = urllib.parse.urlparse(url)
        base = f"{parsed.scheme}://{parsed.netloc}"
        token = urllib.parse.parse_qs(parsed.query)["token"][0]

        def job_doc():
            return json.loads(http_get(base + "/api/v1/job", token))

        # The step-rate chart, in a real browser, from the first reported step
        # on: never "no steps yet" once the nodes reported steps; a line as
        # soon as the master has two samples of the world's step (the
        # agents report every 2 s).
        def rate_chart():
            d = self.chromium(url, "--dump-dom").stdout
            m = re.search(r'<svg id="rate"[^>]*>(.*?)</svg>', d, re.S)
            return m.group(1) if m and "<text" in m.group(1) else None

        wait_for("a step on the nodes", lambda: any(int(n["last_step"]) > 0 for n in job_doc()["nodes"]), 90,
                 interval=0.2)
        chart = wait_for("the step-rate chart", rate_chart, 60, interval=1)
        self.assertNotIn("no steps yet", chart)
        self.assertTrue("<polyline" in chart or re.search(r"step \d+ reached: the rate shows at the next progress "
                                                          r"report", chart), chart)
        wait_for("two samples of the world's step", lambda: len(job_doc()["step_history"]) >= 2, 30, interval=0.2)
        chart = wait_for("the step-rate chart", rate_chart, 60, interval=1)
        self.assertIn("<polyline", chart)
        self.assertRegex(chart, r'id="rate-now"[^>]*>[0-9.]+ steps/s<')
        rate = float(re.search(r'id="rate-now"[^>]*>([0-9.]+) steps/s<', chart).group(1))
        self.assertGreater(rate, 0, chart)
        print(f"\nstep-rate chart from the first samples: {rate} steps/s", flush=True)

        wait_for("steps", lambda: job_doc()["goodput"]["known"] and int(job_doc()["goodput"]["high_water_step"]) >= 20,
                 90)
        prom = self.start_prometheus(parsed.netloc, token)

        # SIGKILL rank 1's worker: one failure, one in-place restart.
        pid = [e for e in read_events(out, 1) if e["event"] == "start"][-1]["pid"]
        os.kill(pid, signal.SIGKILL)
        doc = wait_for("the failure record, resumed",
                       lambda: (lambda d: d if d["failures"] and d["failures"][0]["resumed"] else None)(job_doc()), 90)
        f = doc["failures"][0]
        self.assertEqual(doc["failures_total"], 1)
        self.assertEqual(f["kind"], "killed", f)
        self.assertIn("SIGKILL", f["cause"], f)
        self.assertEqual(f["global_rank"], 1, f)
        self.assertEqual(f["node_rank"], 1, f)
        self.assertEqual(f["action"], "restart", f)
        self.assertGreaterEqual(f["detection_s"], 0)
        self.assertLess(f["detection_s"], 5, f)
        self.assertGreater(f["resume_s"], 0, f)
        self.assertLess(f["resume_s"], 60, f)
        parts = {p["part"]: p["seconds"] for p in doc["goodput"]["parts"]}
        self.assertGreater(parts["checkpoint"], 0, parts)  # the waits for the overlapped saves
        self.assertGreaterEqual(int(f["steps_lost"]), 0, f)
        self.assertLessEqual(int(f["steps_lost"]), 3, f)  # flash checkpoint every step
        print(f"\nfailure record: {json.dumps(f)}", flush=True)

        # `ballast status --json` prints the same document.
        master = re.search(r"master on (\S+);", self.log("job.log")).group(1)
        st = subprocess.run([BIN, "status", "--master", master, "--json"],
                            capture_output=True, text=True, env={**os.environ, "BALLAST_TOKEN": token}, timeout=30)
        self.assertEqual(st.returncode, 0, st.stderr)
        cli_doc = json.loads(st.stdout)
        self.assertEqual(sorted(cli_doc), sorted(job_doc()))
        self.assertEqual(cli_doc["failures"][0]["cause"], f["cause"])
        human = subprocess.run([BIN, "status", "--master", master], capture_output=True, text=True,
                               env={**os.environ, "BALLAST_TOKEN": token}, timeout=30)
        self.assertEqual(human.returncode, 0, human.stderr)
        self.assertRegex(human.stdout, r"failures \(1\):\n  \+[0-9.]+s round 1: node node-1 \(node rank 1\), rank 1: "
                                       r"killed by SIGKILL \(signal 9\) -> restart; detected in [0-9.]+ s, resumed after "
                                       r"[0-9.]+ s, \d+ steps redone")
        self.assertRegex(human.stdout, r"goodput [0-9.]+% of [0-9.]+ s \(productive")

        # The metrics are valid exposition text with the failure, the
        # recovery and the checkpoint saves in them.
        metrics = http_get(base + "/metrics", token)
        check = subprocess.run([promtool, "check", "metrics"], input=metrics, capture_output=True, text=True,
                               timeout=30)
        self.assertEqual(check.returncode, 0, check.stdout + check.stderr)
        self.assertIn('ballast_restarts_total{cause="killed"} 1\n', metrics)
        self.assertRegex(metrics, r"\nballast_recovery_seconds_count 1\n")
        saves = re.search(r"\nballast_ckpt_save_seconds_count (\d+)\n", metrics)
        self.assertGreater(int(saves.group(1)), 20, metrics)
        self.assertRegex(metrics, r'\nballast_nodes\{state="training"\} 2\n')
        with self.assertRaises(urllib.error.HTTPError) as e:
            http_get(base + "/metrics")
        self.assertEqual(e.exception.code, 401)

        # Prometheus scraped it with the token: the ratio through its query API.
        def prom_ratio():
            r = json.loads(http_get(prom + "/api/v1/query?query=ballast_goodput_ratio"))
            return r["data"]["result"]
        result = wait_for("ballast_goodput_ratio in prometheus", prom_ratio, 30)
        ratio = float(result[0]["value"][1])
        now = job_doc()["goodput"]["goodput"]
        self.assertGreater(ratio, 0.1)
        self.assertLessEqual(ratio, 1.0)
        self.assertAlmostEqual(ratio, now, delta=0.25)  # the last scrape is up to a second old
        self.assertEqual(result[0]["metric"]["job"], "ballast")
        # In the same scrape: productive over the sum of the parts, by PromQL.
        q = urllib.parse.quote('ballast_time_seconds_total{part="productive"} / ignoring(part) '
                               'sum without(part) (ballast_time_seconds_total) - ballast_goodput_ratio')
        diff = json.loads(http_get(f"{prom}/api/v1/query?query={q}"))["data"]["result"]
        self.assertLess(abs(float(diff[0]["value"][1])), 1e-6, diff)
        print(f"prometheus: ballast_goodput_ratio {ratio:.3f} (the job says {now:.3f} now)", flush=True)

        # The dashboard in a real browser: round, nodes, goodput as the API has them.
        # Goodput moves by several points a second on this short job (it jumps
        # at each progress report, and the page's last fetch is seconds older
        # than ours): the page's figure must be the productive share of its
        # own breakdown, which comes from the same /api/v1/job document.
        def dom():
            d = self.chromium(url, "--dump-dom").stdout
            return d if re.search(r'id="round">\d+<', d) and 'data-kind="failure"' in d else None
        page = wait_for("the dashboard's DOM", dom, 120, interval=1)
        api = job_doc()
        self.assertIn(f'id="round">{api["round"]}<', page)
        self.assertIn('id="nodes-count">2 / 2<', page)
        shown = float(re.search(r'id="goodput">([0-9.]+)%<', page).group(1))
        legend = float(re.search(r"</i>productive [0-9.]+ s \(([0-9.]+)%\)", page).group(1))
        self.assertAlmostEqual(shown, legend, delta=0.11)
        self.assertTrue(0 < shown <= 100, shown)
        self.assertIn(f'id="job-id" class="dim">job {api["job_id"]}<', page)
        self.assertIn('data-kind="failure"', page)
        self.assertIn("SIGKILL", page)
        self.assertNotIn(token, re.sub(r"<script>.*</script>", "", page, flags=re.S))
        os.makedirs(OUTPUT, exist_ok=True)
        shot = os.path.join(OUTPUT, "dashboard.png")
        r = self.chromium(url, "--window-size=1280,1000", f"--screenshot={shot}", "--hide-scrollbars")
        self.assertTrue(os.path.getsize(shot) > 10000, r.stderr[-2000:])
        print(f"dashboard screenshot: {shot}", flush=True)

        # The job ends and says what it survived.
        job.wait(timeout=180)
        log = self.log("job.log")
        self.assertEqual(job.returncode, 0, log[-4000:])
        self.assertRegex(log, r"summary: goodput [0-9.]+% of [0-9.]+ s \([^)]*\); "
                              r"1 worker restart\(s\), 0 node replacement\(s\); 1 failure \(1 killed\), "
                              r"training resumed [0-9.]+ s after each on average")


if __name__ == "__main__":
    unittest.main()
