#!/usr/bin/python3
"""Smoke test of the Kubernetes test infrastructure: scripts/k8s/cluster.sh (a real
control plane) + tests/kubernetes/testkubelet.py (3 process-running nodes).

  /usr/bin/python3 tests/kubernetes/smoke_test.py [--keep]

Steps (each timed): cluster start; kubelet up and nodes Ready; a Deployment of 2
`sleep 1000` pods Running with distinct pod IPs; a deleted pod replaced; a failed
node's pod evicted and replaced, the node recovered and the evicted pod's deletion
finished; a burst of 100 pods Running; `exit 3` -> Failed with exitCode 3; a pod
reading its service account token gets 403 listing pods (RBAC enforced); teardown
leaves no process behind. Exits non-zero on any failure. ~60 s with cached binaries
(the first run builds them: 10-20 min).
"""

import argparse
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "scripts", "k8s", "cluster.sh")
KUBELET = os.path.join(ROOT, "tests", "kubernetes", "testkubelet.py")
T0 = time.time()


class Fail(Exception):
    pass


def say(msg):
    print("[%6.1fs] %s" % (time.time() - T0, msg), flush=True)


def read_env(path):
    env = {}
    for line in open(path):
        k, _, v = line.strip().partition("=")
        if k:
            env[k] = v.strip("'")
    return env


class K:
    def __init__(self, env):
        self.env = env
        self.ctx = ssl.create_default_context(cafile=env["KUBE_CA"])

    def api(self, method, path, body=None, ctype="application/json"):
        req = urllib.request.Request(self.env["KUBE_SERVER"] + path, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer " + self.env["KUBE_TOKEN"],
                                              "Content-Type": ctype})
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise Fail("%s %s: HTTP %d %s" % (method, path, e.code, e.read()[:300]))

    def kubectl(self, *args, stdin=None):
        env = dict(os.environ, KUBECONFIG=self.env["KUBECONFIG"])
        r = subprocess.run([self.env["KUBECTL"], *args], input=stdin, capture_output=True, text=True, env=env,
                           timeout=60)
        if r.returncode != 0:
            raise Fail("kubectl %s: %s%s" % (" ".join(args), r.stdout, r.stderr))
        return r.stdout

    def pods(self, selector=None):
        q = "?labelSelector=" + selector if selector else ""
        return self.api("GET", "/api/v1/namespaces/default/pods" + q)["items"]


def wait(what, fn, timeout):
    t = time.time()
    while True:
        v = fn()
        if v:
            return v
        if time.time() - t > timeout:
            raise Fail("timed out after %.0f s waiting for %s" % (timeout, what))
        time.sleep(0.1)


def running(p):
    return p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp") and \
        all(c.get("ready") for c in p["status"].get("containerStatuses", []))


def control(port, method, path):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), method=method,
                                 data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def step(name):
    class S:
        def __enter__(self):
            self.t = time.time()
            say("---- " + name)

        def __exit__(self, typ, val, tb):
            if typ is None:
                say("ok   %s (%.1f s)" % (name, time.time() - self.t))
    return S()


def leftover_processes(tmp, prefix):
    """pids whose command line names tmp, or whose environment says a pod of ours."""
    out = []
    marker = ("BALLAST_TEST_NODE_NAME=%s-" % prefix).encode()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            cmd = open("/proc/%s/cmdline" % d, "rb").read()
            envb = open("/proc/%s/environ" % d, "rb").read()
        except OSError:
            continue
        if not cmd:
            continue  # zombie / kernel thread
        if tmp.encode() in cmd or marker in envb:
            out.append("%s %s" % (d, cmd.replace(b"\0", b" ").decode(errors="replace")[:120]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs) even on success")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ballast-k8s-smoke-")
    cdir, sdir = os.path.join(tmp, "cluster"), os.path.join(tmp, "kubelet")
    prefix = "tk%d" % os.getpid()
    kubelet = None
    ok = False
    try:
        with step("cluster start"):
            subprocess.run([CLUSTER, "start", cdir], check=True, timeout=1800)
        k = K(read_env(os.path.join(cdir, "env")))
        say("kubectl: " + k.kubectl("version", "--output=json").replace("\n", " ")[:160])

        with step("testkubelet with 3 nodes, all Ready and untainted"):
            klog = open(os.path.join(tmp, "testkubelet.log"), "w")
            kubelet = subprocess.Popen([KUBELET, "--kubeconfig-env", os.path.join(cdir, "env"), "--nodes", "3",
                                        "--name-prefix", prefix, "--state-dir", sdir],
                                       stdout=klog, stderr=subprocess.STDOUT)
            cport_file = os.path.join(sdir, "control.port")
            wait("control.port", lambda: os.path.exists(cport_file) or kubelet.poll() is not None, 30)
            if kubelet.poll() is not None:
                raise Fail("testkubelet exited: " + open(klog.name).read()[-2000:])
            cport = int(open(cport_file).read())

            def nodes_ready():
                items = k.api("GET", "/api/v1/nodes?labelSelector=ballast.test/testkubelet=" + prefix)["items"]
                good = [n for n in items
                        if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
                        and not n["spec"].get("taints")]
                return len(good) == 3
            wait("3 Ready untainted nodes", nodes_ready, 30)

        dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "sleeper"},
               "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "sleeper"}},
                        "template": {"metadata": {"labels": {"app": "sleeper"}},
                                     "spec": {"terminationGracePeriodSeconds": 5,
                                              "containers": [{"name": "main", "image": "ignored",
                                                              "command": ["sleep", "1000"]}]}}}}

        def sleepers(n):
            ps = [p for p in k.pods("app=sleeper") if running(p)]
            return ps if len(ps) == n else None

        with step("Deployment of 2: both Running, distinct pod IPs"):
            k.kubectl("apply", "-f", "-", stdin=json.dumps(dep))
            ps = wait("2 Running sleepers", lambda: sleepers(2), 30)
            ips = {p["status"]["podIP"] for p in ps}
            if len(ips) != 2 or "127.0.0.1" in ips:
                raise Fail("pod IPs not distinct loopback addresses: %s" % ips)
            say("pods: %s" % [(p["metadata"]["name"], p["spec"]["nodeName"], p["status"]["podIP"]) for p in ps])
            local = control(cport, "GET", "/pods")
            if sorted(x["ip"] for x in local) != sorted(ips) or not all(x["pids"] for x in local):
                raise Fail("control /pods disagrees: %s" % local)

        with step("delete a pod: ReplicaSet replacement Running, old pod and process gone"):
            victim = ps[0]
            vpid = [x for x in local if x["uid"] == victim["metadata"]["uid"]][0]["pids"][0]
            k.kubectl("delete", "pod", victim["metadata"]["name"], "--wait=false")

            def replaced():
                ps2 = sleepers(2)
                names = {p["metadata"]["name"] for p in k.pods("app=sleeper")}
                return ps2 if ps2 and victim["metadata"]["name"] not in names else None
            ps = wait("replacement", replaced, 30)
            if os.path.exists("/proc/%d" % vpid):
                raise Fail("process %d of the deleted pod still runs" % vpid)

        with step("fail a node: its pod evicted and replaced on another node"):
            victim = ps[0]
            vnode = victim["spec"]["nodeName"]
            control(cport, "POST", "/nodes/%s/fail" % vnode)
            t_fail = time.time()

            def evicted():
                p = k.api("GET", "/api/v1/namespaces/default/pods/" + victim["metadata"]["name"])
                ps2 = sleepers(2)
                if p is not None and p["metadata"].get("deletionTimestamp") and ps2 and \
                        all(x["spec"]["nodeName"] != vnode for x in ps2):
                    return ps2
            ps = wait("eviction + replacement", evicted, 40)
            say("evicted and replaced %.1f s after the node failed" % (time.time() - t_fail))
            if time.time() - t_fail > 25:
                raise Fail("eviction took longer than 25 s")

        with step("recover the node: the evicted pod reported Failed and its deletion finished"):
            control(cport, "POST", "/nodes/%s/recover" % vnode)
            wait("evicted pod gone", lambda: k.api(
                "GET", "/api/v1/namespaces/default/pods/" + victim["metadata"]["name"]) is None, 20)

        with step("burst: scale to 100, all Running"):
            k.kubectl("scale", "deployment/sleeper", "--replicas=100")
            ps = wait("100 Running sleepers", lambda: sleepers(100), 60)
            if len({p["status"]["podIP"] for p in ps}) != 100:
                raise Fail("pod IPs are not unique")
            say("100 Running; scaling back to 2")
            k.kubectl("scale", "deployment/sleeper", "--replicas=2")
            wait("back to 2 pods", lambda: len(k.pods("app=sleeper")) == 2, 40)

        with step("pod `exit 3` (restartPolicy Never): Failed, exitCode 3"):
            k.kubectl("apply", "-f", "-", stdin=json.dumps({
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "exit3"},
                "spec": {"restartPolicy": "Never",
                         "containers": [{"name": "main", "image": "ignored", "command": ["sh", "-c", "exit 3"]}]}}))

            def failed():
                p = k.api("GET", "/api/v1/namespaces/default/pods/exit3")
                return p if p and p["status"].get("phase") == "Failed" else None
            p = wait("exit3 Failed", failed, 30)
            code = p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"]
            if code != 3:
                raise Fail("exitCode %s, want 3" % code)

        with step("service account token: present, and RBAC forbids the default SA to list pods"):
            script = ('test -s "$BALLAST_K8S_SA_DIR/token" && echo token-exists; '
                      'echo "namespace=$(cat $BALLAST_K8S_SA_DIR/namespace)"; '
                      'curl -sS -o /dev/null -w "code=%{http_code}\\n" --cacert "$BALLAST_K8S_SA_DIR/ca.crt" '
                      '-H "Authorization: Bearer $$(cat $BALLAST_K8S_SA_DIR/token)" '
                      'https://$(KUBERNETES_SERVICE_HOST):$(KUBERNETES_SERVICE_PORT)/api/v1/namespaces/default/pods')
            k.kubectl("apply", "-f", "-", stdin=json.dumps({
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "satoken"},
                "spec": {"restartPolicy": "Never",
                         "containers": [{"name": "main", "image": "ignored", "command": ["sh", "-c", script]}]}}))

            def done():
                p = k.api("GET", "/api/v1/namespaces/default/pods/satoken")
                return p if p and p["status"].get("phase") in ("Succeeded", "Failed") else None
            p = wait("satoken done", done, 30)
            out = open(os.path.join(sdir, "logs", "default_satoken_main.log")).read()
            say("satoken output: " + " | ".join(l for l in out.splitlines() if not l.startswith("====")))
            for want in ("token-exists", "namespace=default", "code=403"):
                if want not in out:
                    raise Fail("satoken: no %r in its output" % want)

        with step("teardown: kubelet SIGTERM, cluster stop, nothing left running"):
            kubelet.send_signal(signal.SIGTERM)
            kubelet.wait(timeout=20)
            say("testkubelet exited %s" % kubelet.returncode)
            kubelet = None
            subprocess.run([CLUSTER, "stop", cdir], check=True, timeout=60)
            left = leftover_processes(tmp, prefix)
            if left:
                raise Fail("processes left behind:\n  " + "\n  ".join(left))
        ok = True
    except (Fail, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        say("FAIL: %s" % e)
    finally:
        if kubelet is not None:
            kubelet.kill()
            kubelet.wait()
        if not ok:
            subprocess.run([CLUSTER, "stop", cdir], timeout=60)
            for l in leftover_processes(tmp, prefix):
                say("left behind: " + l)
        if ok and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            say("logs kept in %s" % tmp)
    say("smoke test %s in %.1f s" % ("PASSED" if ok else "FAILED", time.time() - T0))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
