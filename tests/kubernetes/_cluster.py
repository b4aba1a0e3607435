"""The Kubernetes test suite's shared cluster: a real control plane
(scripts/k8s/cluster.sh) and the test kubelet (testkubelet.py), started once per
suite by the CTest fixture (`suite.py up DIR`, `suite.py down DIR`) and found
through $BALLAST_K8S_SUITE. Run a test module alone and it starts (and stops)
a cluster of its own.

    from _cluster import Suite
    k = Suite.get()
    k.kubectl("get", "nodes")            # CompletedProcess; check=True raises with output
    k.api("GET", "/api/v1/nodes")         # JSON through the admin token
    k.control("POST", "/nodes/tk-node-1/fail")
    ns = k.namespace(self)               # a fresh namespace, deleted at cleanup
    k.install()                          # kubectl apply -f deploy/ (once), operator Running
"""
import atexit
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CLUSTER_SH = os.path.join(ROOT, "scripts", "k8s", "cluster.sh")
KUBELET = os.path.join(HERE, "testkubelet.py")
BIN = os.environ.get("BALLAST_BIN", os.path.join(ROOT, "build", "bin", "ballast"))
PYTHON = "/usr/bin/python3"
NODES = int(os.environ.get("BALLAST_K8S_NODES", "6"))
NODE_PREFIX = "tk-node"
OPERATOR_REPLICAS = 2  # deploy/03-operator.yaml


def log(msg):
    print(f"[k8s suite {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def out(p):
    """A finished subprocess's exit code and output, for a failed assertion's message."""
    return f"\n--- rc={p.returncode} stdout:\n{p.stdout}\n--- stderr:\n{p.stderr}"


def read_env(path):
    env = {}
    with open(path) as f:
        for line in f:
            k, _, v = line.strip().partition("=")
            if k:
                env[k] = v.strip("'\"")
    return env


def up(state_dir):
    """Starts the control plane and the kubelet under state_dir; returns when both are ready."""
    os.makedirs(state_dir, exist_ok=True)
    t0 = time.time()
    log(f"starting a Kubernetes control plane in {state_dir} (the first run builds it: 10-20 min)")
    subprocess.run([CLUSTER_SH, "start", os.path.join(state_dir, "cluster")], check=True)
    env = read_env(os.path.join(state_dir, "cluster", "env"))
    kdir = os.path.join(state_dir, "kubelet")
    os.makedirs(kdir, exist_ok=True)
    with open(os.path.join(state_dir, "kubelet.log"), "ab") as out:
        p = subprocess.Popen([PYTHON, KUBELET, "--kubeconfig-env", os.path.join(state_dir, "cluster", "env"),
                              "--nodes", str(NODES), "--name-prefix", NODE_PREFIX, "--state-dir", kdir,
                              "--path-prepend", os.path.dirname(BIN)],
                             stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    with open(os.path.join(state_dir, "kubelet.pid"), "w") as f:
        f.write(str(p.pid))
    deadline = time.time() + 60
    while not os.path.exists(os.path.join(kdir, "control.port")):
        if p.poll() is not None or time.time() > deadline:
            down(state_dir)
            raise RuntimeError(f"the test kubelet did not start; see {state_dir}/kubelet.log")
        time.sleep(0.1)
    log(f"cluster up: {NODES} nodes, kubectl {env['KUBECTL']}, {time.time() - t0:.1f} s")
    return env


def down(state_dir):
    pid_file = os.path.join(state_dir, "kubelet.pid")
    if os.path.exists(pid_file):
        with open(pid_file) as f:
            pid = int(f.read().strip() or 0)
        if pid > 0:
            try:
                os.kill(pid, signal.SIGTERM)
                for _ in range(100):
                    os.kill(pid, 0)
                    time.sleep(0.1)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.remove(pid_file)
    if os.path.isdir(os.path.join(state_dir, "cluster")):
        subprocess.run([CLUSTER_SH, "stop", os.path.join(state_dir, "cluster")], check=False)
    log("cluster down")


class Suite:
    _instance = None

    def __init__(self, state_dir, env):
        self.dir = state_dir
        self.env = env
        self.kubelet_dir = os.path.join(state_dir, "kubelet")
        with open(os.path.join(self.kubelet_dir, "control.port")) as f:
            self.control_port = int(f.read().strip())
        self.ctx = ssl.create_default_context(cafile=env["KUBE_CA"])
        self.installed = False

    @classmethod
    def get(cls):
        if cls._instance is None:
            state = os.environ.get("BALLAST_K8S_SUITE")
            if state:
                env = read_env(os.path.join(state, "cluster", "env"))
            else:  # a module run on its own: a cluster of its own
                state = tempfile.mkdtemp(prefix="ballast-k8s-")
                env = up(state)
                atexit.register(lambda: (down(state), shutil.rmtree(state, True)))
            cls._instance = Suite(state, env)
        return cls._instance

    # --- clients ---
    def kubectl(self, *args, check=True, input=None, timeout=120):
        p = subprocess.run([self.env["KUBECTL"], "--kubeconfig", self.env["KUBECONFIG"], *args],
                           capture_output=True, text=True, input=input, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        return p

    def api(self, method, path, body=None, ctype="application/json", ok=(200, 201, 202)):
        req = urllib.request.Request(self.env["KUBE_SERVER"] + path, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer " + self.env["KUBE_TOKEN"],
                                              "Content-Type": ctype, "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=30) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            if e.code in ok:
                return json.loads(e.read() or b"{}")
            raise AssertionError(f"{method} {path}: HTTP {e.code}: {e.read().decode(errors='replace')}")

    def control(self, method, path):
        req = urllib.request.Request(f"http://127.0.0.1:{self.control_port}{path}", method=method, data=b"")
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"{}")

    # --- helpers ---
    def namespace(self, test, prefix="t"):
        ns = f"{prefix}-{secrets.token_hex(3)}"
        self.kubectl("create", "namespace", ns)
        test.addCleanup(lambda: self.kubectl("delete", "namespace", ns, "--wait=false", check=False))
        return ns

    def install(self):
        """kubectl apply -f deploy/ (idempotent), then the operator Running. The test cluster has no
        DNS: the operator is told to give workers the master pod's IP instead of its Service name."""
        if self.installed:
            return
        self.kubectl("apply", "-f", os.path.join(ROOT, "deploy"))
        # The test kubelet runs containers as host processes: a volume's mountPath is a host
        # path, so the master pods' journals go under the suite's folder (each in its pod's
        # uid folder, as in an emptyDir).
        self.journals = os.path.join(self.dir, "journals")
        os.makedirs(self.journals, exist_ok=True)
        self.kubectl("-n", "ballast-system", "set", "env", "deployment/ballast-operator",
                     "BALLAST_MASTER_ADDRESS=pod-ip", f"BALLAST_MASTER_JOURNAL={self.journals}")
        # `set env` rolls the Deployment (Recreate): until the first pod is gone, the operator
        # Running may still be the one without the env, reconciling jobs with Service names.
        def only_the_new_operators():
            pods = self.pods("ballast-system", "app.kubernetes.io/name=ballast-operator")
            if len(pods) != OPERATOR_REPLICAS or any(p["metadata"].get("deletionTimestamp") for p in pods):
                return None
            for p in pods:
                env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0].get("env", [])}
                if (p["status"].get("phase") != "Running" or env.get("BALLAST_MASTER_ADDRESS") != "pod-ip"
                        or env.get("BALLAST_MASTER_JOURNAL") != self.journals):
                    return None
            return pods
        self.wait(only_the_new_operators, 120, f"the {OPERATOR_REPLICAS} operator pods (with "
                  "BALLAST_MASTER_ADDRESS=pod-ip and BALLAST_MASTER_JOURNAL) Running, and no other")
        # One of them leads (the other stands by): jobs are reconciled from then on.
        self.wait(lambda: self.operator_leader(), 60, "an operator holding the leader Lease")
        self.installed = True

    def operator_leader(self):
        """The operator pod holding the leader Lease ("" when none)."""
        try:
            lease = self.api("GET", "/apis/coordination.k8s.io/v1/namespaces/ballast-system/leases/ballast-operator")
        except AssertionError:
            return ""
        return lease["spec"].get("holderIdentity") or ""

    def pods(self, ns, selector=""):
        q = f"?labelSelector={urllib.parse.quote(selector)}" if selector else ""
        return self.api("GET", f"/api/v1/namespaces/{ns}/pods{q}")["items"]

    def running_pods(self, ns, selector=""):
        return [p for p in self.pods(ns, selector)
                if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]

    def crds_established(self, names, timeout=60):
        """Wait until every CRD in names has its Established condition True.

        Not `kubectl wait --for=condition=Established`: a CRD read before the
        API server first writes its status has `status.conditions: null`, which
        kubectl's wait takes for an error and gives up on (seen in CI: "accessor
        error: <nil> is of the type <nil>, expected []interface{}")."""
        def established(name):
            p = self.kubectl("get", f"crd/{name}", "-o", "json", check=False)
            if p.returncode != 0:
                return False
            conditions = (json.loads(p.stdout).get("status") or {}).get("conditions") or []
            return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)
        left = list(names)

        def none_left():
            left[:] = [n for n in left if not established(n)]
            return not left
        self.wait(none_left, timeout, lambda: f"these CRDs to be Established: {', '.join(left)} "
                                              "(kubectl get crd NAME -o yaml shows their status)")

    def wait(self, cond, timeout, what, interval=0.2):
        """Polls cond() until it is true; what (a string, or a callable that
        says it at the timeout) names what was waited for."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            v = cond()
            if v:
                return v
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout} s waiting for {what() if callable(what) else what}")

    def pod_log(self, ns, pod, container=None):
        import glob
        pattern = os.path.join(self.kubelet_dir, "logs", f"{ns}_{pod}_{container or '*'}.log")
        out = []
        for path in sorted(glob.glob(pattern)):
            with open(path, errors="replace") as f:
                out.append(f.read())
        return "".join(out)

    def logs(self, ns):
        """Every container log of the namespace (for failure messages)."""
        import glob
        out = []
        for path in sorted(glob.glob(os.path.join(self.kubelet_dir, "logs", f"{ns}_*.log"))):
            with open(path, errors="replace") as f:
                out.append(f"\n--- {os.path.basename(path)} ---\n{f.read()[-6000:]}")
        return "".join(out)


import urllib.parse  # noqa: E402  (used in pods())

if __name__ == "__main__":
    # suite.py-style entry: _cluster.py up|down DIR
    if len(sys.argv) != 3 or sys.argv[1] not in ("up", "down"):
        print("usage: _cluster.py up|down STATE_DIR", file=sys.stderr)
        sys.exit(2)
    if sys.argv[1] == "up":
        up(sys.argv[2])
    else:
        down(sys.argv[2])
