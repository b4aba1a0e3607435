#!/usr/bin/python3
"""testkubelet: a minimal process-running kubelet for Ballast's Kubernetes tests.

It stands in for the kubelets of N nodes against a real control plane
(scripts/k8s/cluster.sh). Images are ignored: each container's command + args run as
a local process on this host. Python 3 standard library only.

Usage:
  testkubelet.py --kubeconfig-env DIR/env --nodes N --state-dir SDIR
                 [--name-prefix tk-node] [--cpu 8] [--memory 32Gi] [--pods 110]
                 [--path-prepend DIR]... [--node-label k=v]... [--verbose]

  --kubeconfig-env  the env file cluster.sh writes (KUBE_SERVER, KUBE_TOKEN, KUBE_CA):
                    TLS verified against KUBE_CA, bearer token auth (admin).
  --nodes N         registers Node objects PREFIX-0 .. PREFIX-(N-1).
  --state-dir SDIR  control.port (written last: the kubelet is ready once it exists),
                    logs/<ns>_<pod>_<container>.log (container stdout+stderr, appended
                    across restarts), pods/<uid>/... (volumes, service account files).
  --path-prepend    dirs put in front of PATH for containers (repeatable, or a:b:c).
  --node-label      extra label on every node (repeatable).

Nodes: labels kubernetes.io/hostname=<name>, kubernetes.io/os=linux,
kubernetes.io/arch=amd64, ballast.test/testkubelet=<prefix>; capacity/allocatable
cpu, memory, pods, ephemeral-storage; Ready kept alive by a Lease in kube-node-lease
renewed every 2 s and a node status heartbeat every 10 s.

Pods (bound by the real kube-scheduler to our nodes; one watch on all pods):
  * initContainers run first, in order, to completion (an init container with
    restartPolicy Always is a sidecar: started, kept running); then all containers.
  * argv = command + args with $(VAR) expansion as Kubernetes does (no command and no
    args: the container fails to start, reason StartError, exit code 128).
  * env: the kubelet's own environment minus KUBECONFIG, KUBE_* and BALLAST_K8S_*
    (so pods never inherit admin credentials), PATH with --path-prepend first; then
    KUBERNETES_SERVICE_HOST=127.0.0.1, KUBERNETES_SERVICE_PORT(_HTTPS)=<apiserver port>,
    KUBERNETES_PORT*, HOSTNAME=<pod name>, envFrom, env (value, fieldRef,
    resourceFieldRef, secretKeyRef, configMapKeyRef). Extra, always set:
      BALLAST_TEST_POD_IP=<pod IP>  BALLAST_TEST_NODE_NAME=<node>
    workingDir is created and used; default cwd is the kubelet's cwd.
  * Each pod gets its own loopback IP 127.A.x.y (A is a /16 block locked host-wide via
    /tmp/ballast-testkubelet/ipblock-A.lock, so parallel kubelets never collide), as
    status.podIP(s); status.hostIP 127.0.0.1. Processes must bind their pod IP, not
    0.0.0.0, to avoid port clashes between pods. hostNetwork pods get 127.0.0.1.
  * Volumes: the service account projected volume (mounted at
    /var/run/secrets/kubernetes.io/serviceaccount) is written to
    SDIR/pods/<uid>/serviceaccount/{token,ca.crt,namespace} (token from the TokenRequest
    API, bound to the pod) and BALLAST_K8S_SA_DIR=<that dir> is set for containers that
    mount it. emptyDir, configMap, secret, downwardAPI and other projected volumes are
    written to SDIR/pods/<uid>/volumes/<name> and every container gets
    BALLAST_TEST_VOLUME_<NAME>=<dir> (name upper-cased, '-' and '.' -> '_').
    Other kinds (hostPath, PVCs, ...) are ignored: processes share the host filesystem.
  * Status (strategic merge patch of pods/NAME/status): Pending -> Running as soon as
    the processes start (ready=true at once: probes are not run) -> Succeeded/Failed
    per restartPolicy; Always/OnFailure restart with backoff 0.5 s doubling to 5 s.
    Killed by a signal: exitCode 128+sig, signal set.
  * Deletion: on deletionTimestamp SIGTERM the process groups, SIGKILL after the grace
    period, report the terminal status, DELETE with gracePeriodSeconds=0 and a uid
    precondition. A DELETED pod (force delete) has its processes killed at once.
  * Processes: own session each (start_new_session), PR_SET_PDEATHSIG=SIGKILL; the
    whole process group is killed when the main process exits. On SIGTERM/SIGINT the
    kubelet SIGKILLs every pod process group and exits (the API is left as is).

Control API on 127.0.0.1:$(cat SDIR/control.port), JSON replies:
  POST /nodes/<name>/fail     Ready=False, no more lease renewals, SIGKILL its pods'
                              processes, no more status reports (pods stay as they are
                              in the API, as on a dead node).
  POST /nodes/<name>/silent   no heartbeats/lease renewals and no API traffic for its
                              pods (they do not see deletions); processes keep running.
  POST /nodes/<name>/recover  Ready again; resyncs its pods from the API: pods whose
                              processes were killed are reported Failed (and their
                              deletion finished if they were being deleted), pods
                              deleted meanwhile are killed, new pods are started.
  POST /nodes/<name>/cordon | /uncordon   spec.unschedulable true/false.
  GET  /nodes                 [{name, state}]
  GET  /pods                  [{name, namespace, uid, node, ip, phase, pids, containers}]
  GET  /healthz
"""

import argparse
import base64
import ctypes
import errno
import fcntl
import http.client
import http.server
import json
import math
import os
import queue
import random
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
from datetime import datetime, timezone

SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
KUBELET_VERSION = "v1.34.4"
VERBOSE = False
_log_lock = threading.Lock()


def log(msg, *, debug=False):
    if debug and not VERBOSE:
        return
    line = "%s testkubelet: %s\n" % (datetime.now().strftime("%H:%M:%S.%f")[:-3], msg)
    with _log_lock:
        sys.stderr.write(line)
        sys.stderr.flush()


def now_ts():
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def ts_of(t):
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_ts():
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --------------------------------------------------------------------------- API client

class ApiError(Exception):
    def __init__(self, status, body):
        super().__init__("HTTP %s: %s" % (status, str(body)[:300]))
        self.status = status
        self.body = body


class Api:
    """Tiny Kubernetes REST client: one keep-alive HTTPS connection per thread."""

    def __init__(self, server, token, ca):
        u = urllib.parse.urlsplit(server)
        self.host, self.port = u.hostname, u.port or 443
        self.token = token
        self.ctx = ssl.create_default_context(cafile=ca)
        self.local = threading.local()

    def _conn(self, timeout=30):
        return http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=timeout)

    def request(self, method, path, body=None, ctype="application/json", query=None, ok_missing=False):
        """Returns the decoded JSON reply; raises ApiError on HTTP >= 400 (404 -> None when
        ok_missing). Retries connection failures, 429 and 5xx a few times."""
        if query:
            path += "?" + urllib.parse.urlencode(query)
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": "Bearer " + self.token, "Accept": "application/json",
                   "User-Agent": "testkubelet/1"}
        if data is not None:
            headers["Content-Type"] = ctype
        for attempt in range(6):
            conn = getattr(self.local, "conn", None)
            if conn is None:
                conn = self.local.conn = self._conn()
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                self.local.conn = None
                if attempt >= 5:
                    raise ApiError(0, "connection failed: %r" % e)
                time.sleep(0.05 * (attempt + 1))
                continue
            if resp.status == 429 or resp.status >= 500:
                if attempt < 5:
                    time.sleep(0.1 * (attempt + 1))
                    continue
            try:
                obj = json.loads(raw) if raw else None
            except ValueError:
                obj = raw.decode(errors="replace")
            if resp.status == 404 and ok_missing:
                return None
            if resp.status >= 400:
                raise ApiError(resp.status, obj)
            return obj
        raise ApiError(0, "unreachable")

    def watch(self, path, query):
        """Yields watch events (dicts) until the stream ends."""
        q = dict(query, watch="1", allowWatchBookmarks="true")
        conn = self._conn(timeout=120)
        try:
            conn.request("GET", path + "?" + urllib.parse.urlencode(q),
                         headers={"Authorization": "Bearer " + self.token, "Accept": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise ApiError(resp.status, resp.read()[:500])
            while True:
                line = resp.readline()
                if not line:
                    return
                line = line.strip()
                if line:
                    yield json.loads(line)
        finally:
            conn.close()


# --------------------------------------------------------------------------- helpers

def expand(s, mapping):
    """Kubernetes $(VAR) expansion: $(VAR) -> value when defined, else left as is;
    $$ -> $; anything else verbatim."""
    out, i, n = [], 0, len(s)
    while i < n:
        ch = s[i]
        if ch == "$" and i + 1 < n:
            nx = s[i + 1]
            if nx == "$":
                out.append("$")
                i += 2
                continue
            if nx == "(":
                j = s.find(")", i + 2)
                if j >= 0:
                    name = s[i + 2:j]
                    out.append(mapping[name] if name in mapping else "$(" + name + ")")
                    i = j + 1
                    continue
                out.append("$(")
                i += 2
                continue
            out.append("$" + nx)
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


_SUFFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "P": 1e15, "E": 1e18, "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40,
           "Pi": 2 ** 50, "Ei": 2 ** 60}


def quantity(q):
    m = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(n|u|m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?", str(q).strip())
    if not m:
        raise ValueError("bad quantity %r" % q)
    return float(m.group(1)) * _SUFFIX[m.group(2) or ""]


def env_name_ok(k):
    return bool(re.fullmatch(r"[-._a-zA-Z][-._a-zA-Z0-9]*", k))


def field_value(pod, path):
    md, spec, st = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.*)'\]", path)
    if m:
        return (md.get(m.group(1)) or {}).get(m.group(2), "")
    if path in ("metadata.labels", "metadata.annotations"):
        d = md.get(path.split(".")[1]) or {}
        return "\n".join('%s="%s"' % (k, d[k]) for k in sorted(d))
    simple = {
        "metadata.name": md.get("name", ""), "metadata.namespace": md.get("namespace", ""),
        "metadata.uid": md.get("uid", ""), "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": st.get("podIP", ""), "status.hostIP": st.get("hostIP", ""),
        "status.podIPs": ",".join(x["ip"] for x in st.get("podIPs", [])),
        "status.hostIPs": ",".join(x["ip"] for x in st.get("hostIPs", [])),
    }
    if path not in simple:
        raise ConfigError("unsupported fieldRef %s" % path)
    return simple[path]


class ConfigError(Exception):
    pass


class IPPool:
    """Loopback pod IPs 127.A.x.y; block A is flock'ed host-wide for this process's life."""

    def __init__(self):
        d = os.path.join(tempfile.gettempdir(), "ballast-testkubelet")
        os.makedirs(d, exist_ok=True)
        blocks = list(range(10, 251))
        random.shuffle(blocks)
        self.fd = None
        for a in blocks:
            fd = os.open(os.path.join(d, "ipblock-%d.lock" % a), os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self.fd, self.block = fd, a
            break
        if self.fd is None:
            raise SystemExit("testkubelet: no free 127.A.0.0/16 block")
        self.lock = threading.Lock()
        self.used = set()
        self.next = 0

    def alloc(self):
        with self.lock:
            for _ in range(256 * 254):
                i = self.next
                self.next = (self.next + 1) % (256 * 254)
                if i not in self.used:
                    self.used.add(i)
                    return "127.%d.%d.%d" % (self.block, i // 254, i % 254 + 1)
            raise RuntimeError("pod IP pool exhausted")

    def free(self, ip):
        _, _, b, c = (int(x) for x in ip.split("."))
        with self.lock:
            self.used.discard(b * 254 + c - 1)


_libc = ctypes.CDLL(None, use_errno=True)


class Reaper:
    """A watchdog process that outlives the kubelet by a moment: the kubelet tells it
    every pod process group (+PGID / -PGID lines on a pipe); when the pipe reaches EOF
    (the kubelet exited, even by SIGKILL) it SIGKILLs the groups still registered.
    PR_SET_PDEATHSIG alone only covers the direct children. Start it before any thread."""

    def __init__(self):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the watchdog
            try:
                os.close(w)
                os.setsid()  # out of the kubelet's process group: survives a group kill
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    signal.signal(sig, signal.SIG_IGN)
                _libc.prctl(15, b"testkubelet-rpr", 0, 0, 0)  # PR_SET_NAME
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, 0)
                os.dup2(null, 1)
                groups, buf = set(), b""
                while True:
                    data = os.read(r, 65536)
                    if not data:
                        break
                    buf += data
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        if line[:1] == b"+":
                            groups.add(int(line[1:]))
                        elif line[:1] == b"-":
                            groups.discard(int(line[1:]))
                for g in groups:
                    try:
                        os.killpg(g, signal.SIGKILL)
                    except OSError:
                        pass
            finally:
                os._exit(0)
        os.close(r)
        self.pid, self.w, self.lock = pid, w, threading.Lock()

    def send(self, line):
        with self.lock:
            try:
                os.write(self.w, line.encode())
            except OSError:
                pass

    def add(self, pgid):
        self.send("+%d\n" % pgid)

    def remove(self, pgid):
        self.send("-%d\n" % pgid)

    def close(self):
        """After the kubelet killed its pods itself: the watchdog exits at once."""
        with self.lock:
            os.close(self.w)
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


REAPER = None


def write_file_atomic(path, data, mode=0o644):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- containers

class Ctr:
    def __init__(self, spec, kind):
        self.spec = spec
        self.name = spec["name"]
        self.kind = kind  # "init", "sidecar", "main"
        self.proc = None
        self.pgid = None
        self.reaped = True
        self.lock = threading.Lock()
        self.state = "waiting"
        self.waiting_reason = "ContainerCreating"  # PodInitializing behind init containers
        self.waiting_message = None
        self.started_at = None
        self.term = None      # dict for state.terminated
        self.last_term = None
        self.restarts = 0
        self.gen = 0
        self.next_start = 0.0  # earliest (re)start time
        self.done = False      # will not be (re)started
        self.cid = None

    def running(self):
        return self.state == "running"

    def signal(self, sig):
        with self.lock:
            if not self.reaped and self.pgid:
                try:
                    os.killpg(self.pgid, sig)
                except OSError:
                    pass

    def status(self, pod_ready_gate=True):
        st = {"name": self.name, "image": self.spec.get("image", ""),
              "imageID": "testkubelet://" + self.spec.get("image", ""),
              "restartCount": self.restarts,
              "ready": self.running() and self.kind != "init",
              "started": self.running()}
        if self.cid:
            st["containerID"] = self.cid
        if self.state == "running":
            st["state"] = {"running": {"startedAt": ts_of(self.started_at)}, "waiting": None, "terminated": None}
        elif self.state == "terminated":
            st["state"] = {"terminated": self.term, "waiting": None, "running": None}
        else:
            st["state"] = {"waiting": {"reason": self.waiting_reason, "message": self.waiting_message},
                           "running": None, "terminated": None}
        if self.last_term:
            st["lastState"] = {"terminated": self.last_term, "waiting": None, "running": None}
        return st


# --------------------------------------------------------------------------- nodes

class Node:
    def __init__(self, name):
        self.name = name
        self.state = "ok"  # ok | silent | failed
        self.ready_since = now_ts()
        self.uid = None


# --------------------------------------------------------------------------- pod worker

class PodWorker(threading.Thread):
    """Owns one pod: spawns its processes (always from this thread: PR_SET_PDEATHSIG
    follows the forking thread) and reports its status."""

    def __init__(self, kl, pod):
        super().__init__(daemon=True, name="pod-" + pod["metadata"]["name"])
        self.kl = kl
        self.pod = pod
        md = pod["metadata"]
        self.uid, self.ns, self.pname = md["uid"], md["namespace"], md["name"]
        self.node = kl.nodes[pod["spec"]["nodeName"]]
        self.q = queue.Queue()
        spec = pod["spec"]
        self.restart_policy = spec.get("restartPolicy", "Always")
        self.inits = []
        for c in spec.get("initContainers") or []:
            self.inits.append(Ctr(c, "sidecar" if c.get("restartPolicy") == "Always" else "init"))
        self.mains = [Ctr(c, "main") for c in spec.get("containers") or []]
        if self.inits:
            for c in self.mains:
                c.waiting_reason = "PodInitializing"
        self.host_network = bool(spec.get("hostNetwork"))
        self.ip = "127.0.0.1" if self.host_network else kl.ips.alloc()
        self.dir = os.path.join(kl.sdir, "pods", self.uid)
        self.start_time = None
        self.prepared = False
        self.envs = None         # per container name: env dict
        self.retry_at = None
        self.init_idx = 0
        self.phase = "Pending"
        self.deleting = False
        self.deleted = False
        self.delete_deadline = None
        self.term_sent = False
        self.killed_by_node = False
        self.finished = False    # thread exits
        self.terminal = False    # phase Succeeded/Failed reached
        self.last_sent = None
        self.cond_times = {}
        self.report_retry_at = None

    # ---- events
    def run(self):
        try:
            self.on_update(self.pod)
            self.reconcile()
            while not self.finished and not self.kl.stopping.is_set():
                try:
                    ev = self.q.get(timeout=self.timeout())
                except queue.Empty:
                    ev = None
                if ev is not None:
                    self.handle(ev)
                    while True:  # coalesce queued events
                        try:
                            self.handle(self.q.get_nowait())
                        except queue.Empty:
                            break
                if self.finished:
                    break
                self.reconcile()
        except Exception:
            log("pod %s/%s: worker crashed:\n%s" % (self.ns, self.pname, traceback.format_exc()))
        finally:
            self.kill_all(signal.SIGKILL)
            self.wait_reaped(2.0)
            self.kl.worker_done(self)

    def timeout(self):
        """Seconds to the next timed action (restart backoff, retry, grace deadline)."""
        now = time.time()
        t = [c.next_start for c in self.inits + self.mains if c.state == "terminated" and not c.done]
        t += [self.retry_at, self.delete_deadline, self.report_retry_at]
        t = [x - now for x in t if x and x > now]
        return max(0.01, min(t)) if t else 10.0

    def handle(self, ev):
        kind = ev[0]
        if kind == "update":
            self.on_update(ev[1])
        elif kind == "deleted":
            self.deleted = True
            log("pod %s/%s deleted: killing its processes" % (self.ns, self.pname), debug=True)
            self.kill_all(signal.SIGKILL)
            self.finished = True
        elif kind == "exit":
            _, name, gen, rc, t = ev
            self.on_exit(name, gen, rc, t)
        elif kind == "node_failed":
            self.killed_by_node = any(c.running() for c in self.inits + self.mains) or self.killed_by_node
            self.kill_all(signal.SIGKILL)
        elif kind == "resync":
            self.on_resync(ev[1])

    def on_update(self, pod):
        md = pod["metadata"]
        if md.get("uid") != self.uid:
            return
        self.pod = pod
        if md.get("deletionTimestamp"):
            grace = md.get("deletionGracePeriodSeconds")
            if grace is None:
                grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
            deadline = time.time() + max(0, int(grace))
            if not self.deleting:
                self.deleting = True
                self.delete_deadline = deadline
                log("pod %s/%s: deletion requested (grace %ss)" % (self.ns, self.pname, grace), debug=True)
            elif deadline < self.delete_deadline:
                self.delete_deadline = deadline

    def on_exit(self, name, gen, rc, t):
        c = self.find(name)
        if c is None or gen != c.gen:
            return
        if rc < 0:
            sig = -rc
            code, reason = 128 + sig, "Error"
        else:
            sig, code, reason = None, rc, ("Completed" if rc == 0 else "Error")
        c.state = "terminated"
        c.term = {"exitCode": code, "signal": sig, "reason": reason, "message": None,
                  "startedAt": ts_of(c.started_at), "finishedAt": ts_of(t), "containerID": c.cid}
        log("pod %s/%s container %s exited %s" % (self.ns, self.pname, name, code), debug=True)

    def on_resync(self, pod):
        """After the node recovered: pod is the current object (None: gone from the API)."""
        if pod is None or pod["metadata"].get("uid") != self.uid:
            self.kill_all(signal.SIGKILL)
            self.finished = True
            return
        self.on_update(pod)
        if self.killed_by_node and not self.terminal:
            for c in self.inits + self.mains:
                c.done = True
                if c.state != "terminated":
                    c.state = "terminated"
                    c.term = {"exitCode": 137, "signal": None, "reason": "Error",
                              "message": "node %s failed" % self.node.name,
                              "startedAt": ts_of(c.started_at) if c.started_at else None,
                              "finishedAt": now_ts(), "containerID": c.cid}
            self.phase = "Failed"
            self.terminal = True
        self.last_sent = None  # report again

    def find(self, name):
        for c in self.inits + self.mains:
            if c.name == name:
                return c
        return None

    # ---- processes
    def kill_all(self, sig):
        for c in self.inits + self.mains:
            c.signal(sig)

    def wait_reaped(self, timeout):
        end = time.time() + timeout
        while time.time() < end:
            if all(c.reaped for c in self.inits + self.mains):
                return
            time.sleep(0.02)

    def spawn(self, c):
        env = dict(self.envs[c.name])
        mapping = self.envs_k8s[c.name]
        argv = [expand(a, mapping) for a in (c.spec.get("command") or []) + (c.spec.get("args") or [])]
        c.gen += 1
        c.cid = "testkubelet://%s-%s-%d" % (self.uid[:8], c.name, c.restarts)
        c.started_at = time.time()
        if not argv:
            self.start_failed(c, "container %s has no command (images are not run)" % c.name)
            return
        cwd = c.spec.get("workingDir") or None
        logpath = os.path.join(self.kl.sdir, "logs", "%s_%s_%s.log" % (self.ns, self.pname, c.name))
        try:
            if cwd:
                os.makedirs(cwd, exist_ok=True)
            with open(logpath, "ab") as lf:
                lf.write(("==== testkubelet: %s start #%d: %s\n" % (now_ts(), c.restarts, shlex.join(argv))).encode())
                lf.flush()
                # setpriv sets PR_SET_PDEATHSIG and execs the command: no preexec_fn,
                # whose Python code in a child forked from this many-threaded process
                # can deadlock (and then Popen waits forever for the exec).
                proc = subprocess.Popen(["setpriv", "--pdeathsig", "KILL", "--", *argv], env=env, cwd=cwd,
                                        stdin=subprocess.DEVNULL, stdout=lf, stderr=subprocess.STDOUT,
                                        start_new_session=True, close_fds=True)
        except OSError as e:
            self.start_failed(c, "start %s: %s" % (argv[0], e))
            return
        with c.lock:
            c.proc, c.pgid, c.reaped = proc, proc.pid, False
        REAPER.add(proc.pid)
        c.state = "running"
        if self.node.state == "failed":  # raced with a node failure
            c.signal(signal.SIGKILL)
        gen = c.gen
        threading.Thread(target=self._waiter, args=(c, proc, gen), daemon=True,
                         name="wait-%s-%s" % (self.pname, c.name)).start()
        log("pod %s/%s container %s started pid %d" % (self.ns, self.pname, c.name, proc.pid), debug=True)

    def start_failed(self, c, msg):
        log("pod %s/%s: %s" % (self.ns, self.pname, msg))
        c.state = "terminated"
        c.term = {"exitCode": 128, "signal": None, "reason": "StartError", "message": msg,
                  "startedAt": ts_of(c.started_at), "finishedAt": now_ts(), "containerID": c.cid}

    def _waiter(self, c, proc, gen):
        while True:
            try:
                os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
                break
            except InterruptedError:
                continue
            except ChildProcessError:
                break
        with c.lock:
            try:  # the zombie still holds the pgid: no reuse race
                os.killpg(c.pgid, signal.SIGKILL)
            except OSError:
                pass
            rc = proc.wait()
            c.reaped = True
        REAPER.remove(proc.pid)
        self.q.put(("exit", c.name, gen, rc, time.time()))

    # ---- reconcile
    def reconcile(self):
        if self.node.state == "failed":
            return
        now = time.time()
        if self.deleting:
            self.reconcile_deleting(now)
            return
        if self.terminal:
            self.report()
            return
        if not self.prepared:
            if self.retry_at and now < self.retry_at:
                return
            try:
                self.prepare()
                self.prepared = True
                self.retry_at = None
                self.start_time = self.start_time or now
            except Exception as e:  # ConfigError, ApiError, OSError, bad specs
                self.retry_at = now + 2
                for c in self.inits + self.mains:
                    c.waiting_reason, c.waiting_message = "CreateContainerConfigError", str(e)
                log("pod %s/%s: %s (retrying)" % (self.ns, self.pname, e))
                self.report()
                return
        # init containers, in order
        while self.init_idx < len(self.inits):
            c = self.inits[self.init_idx]
            if c.state == "waiting" and c.gen == 0:
                self.spawn(c)
            if c.kind == "sidecar":  # started: go on (restarted below like a container)
                self.init_idx += 1
                continue
            if c.state == "running":
                break
            if c.term["exitCode"] == 0:
                c.done = True
                self.init_idx += 1
                continue
            if self.restart_policy == "Never":
                c.done = True
                self.set_terminal("Failed")
                return
            if c.next_start <= c.started_at:  # schedule the restart
                c.next_start = now + self.backoff(c)
            elif now >= c.next_start:
                self.restart_bookkeeping(c)
                self.spawn(c)
                continue  # running, or failed to start: schedules a backoff
            break
        initialized = self.init_idx >= len(self.inits)
        # sidecars restart always; main containers per restartPolicy
        for c in self.inits + (self.mains if initialized else []):
            if c.kind == "init":
                continue
            if c.state == "waiting" and c.gen == 0:
                self.spawn(c)
            elif c.state == "terminated" and not c.done:
                again = c.kind == "sidecar" or self.restart_policy == "Always" or \
                    (self.restart_policy == "OnFailure" and c.term["exitCode"] != 0)
                if not again:
                    c.done = True
                elif c.next_start <= c.started_at:
                    c.next_start = now + self.backoff(c)
                elif now >= c.next_start:
                    self.restart_bookkeeping(c)
                    self.spawn(c)
        if initialized and self.mains and all(c.done for c in self.mains):
            ok = all(c.term["exitCode"] == 0 for c in self.mains)
            self.set_terminal("Succeeded" if ok else "Failed")
            return
        self.phase = "Running" if initialized and any(c.state != "waiting" or c.gen > 0 for c in self.mains) \
            else "Pending"
        self.report()

    def backoff(self, c):
        return min(5.0, 0.5 * (2 ** c.restarts))

    def restart_bookkeeping(self, c):
        c.last_term = c.term
        c.restarts += 1

    def set_terminal(self, phase):
        for c in self.inits + self.mains:
            if c.kind == "sidecar":
                c.done = True
                c.signal(signal.SIGTERM)
        self.phase = phase
        self.terminal = True
        log("pod %s/%s: %s" % (self.ns, self.pname, phase), debug=True)
        self.report()

    def reconcile_deleting(self, now):
        if not self.term_sent:
            self.term_sent = True
            for c in self.inits + self.mains:
                c.done = True
                c.signal(signal.SIGTERM)
        if any(c.running() for c in self.inits + self.mains):
            if now >= self.delete_deadline:
                self.kill_all(signal.SIGKILL)
            return
        if self.node.state != "ok":
            return
        # every process is gone: terminal status, then finish the deletion
        if not self.terminal and self.start_time:
            ok = all(c.term and c.term["exitCode"] == 0 for c in self.mains)
            self.phase = "Succeeded" if ok else "Failed"
            self.terminal = True
        if self.terminal and self.start_time:
            self.report()
        try:
            self.kl.api.request("DELETE", "/api/v1/namespaces/%s/pods/%s" % (self.ns, self.pname),
                                body={"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0,
                                      "preconditions": {"uid": self.uid}}, ok_missing=True)
        except ApiError as e:
            if e.status != 409:  # 409: precondition failed, another pod by this name
                log("pod %s/%s: final delete failed: %s" % (self.ns, self.pname, e))
                self.delete_deadline = now + 1  # retry
                return
        log("pod %s/%s: deletion finished" % (self.ns, self.pname), debug=True)
        self.finished = True

    # ---- prepare: volumes and env
    def prepare(self):
        api, pod = self.kl.api, self.pod
        spec = pod["spec"]
        pod_for_fields = dict(pod)
        pod_for_fields["status"] = dict(pod.get("status") or {}, podIP=self.ip, hostIP="127.0.0.1",
                                        podIPs=[{"ip": self.ip}], hostIPs=[{"ip": "127.0.0.1"}])
        os.makedirs(self.dir, exist_ok=True)
        vol_env = {}
        vol_paths = {}
        for v in spec.get("volumes") or []:
            name = v["name"]
            is_sa = self.is_sa_volume(v, spec)
            if is_sa:
                d = os.path.join(self.dir, "serviceaccount")
            elif any(k in v for k in ("emptyDir", "configMap", "secret", "projected", "downwardAPI")):
                d = os.path.join(self.dir, "volumes", name)
            else:
                continue
            os.makedirs(d, exist_ok=True)
            self.fill_volume(v, d, pod_for_fields)
            vol_paths[name] = d
            if not is_sa:
                vol_env["BALLAST_TEST_VOLUME_" + re.sub(r"[^A-Z0-9_]", "_", name.upper())] = d
        kl = self.kl
        base = dict(kl.base_env)
        svc = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(kl.api_port),
               "KUBERNETES_SERVICE_PORT_HTTPS": str(kl.api_port),
               "KUBERNETES_PORT": "tcp://127.0.0.1:%d" % kl.api_port,
               "KUBERNETES_PORT_443_TCP": "tcp://127.0.0.1:%d" % kl.api_port,
               "KUBERNETES_PORT_443_TCP_PROTO": "tcp", "KUBERNETES_PORT_443_TCP_PORT": str(kl.api_port),
               "KUBERNETES_PORT_443_TCP_ADDR": "127.0.0.1"}
        self.envs, self.envs_k8s = {}, {}
        for c in self.inits + self.mains:
            kenv = dict(svc)  # what $(VAR) can refer to
            for ef in c.spec.get("envFrom") or []:
                prefix = ef.get("prefix", "")
                if "configMapRef" in ef:
                    ref = ef["configMapRef"]
                    obj = self.kl.get_obj("configmaps", self.ns, ref["name"], ref.get("optional", False))
                    data = dict((obj or {}).get("data") or {})
                else:
                    ref = ef["secretRef"]
                    obj = self.kl.get_obj("secrets", self.ns, ref["name"], ref.get("optional", False))
                    data = {k: base64.b64decode(x).decode(errors="replace")
                            for k, x in ((obj or {}).get("data") or {}).items()}
                for k, x in data.items():
                    if env_name_ok(prefix + k):
                        kenv[prefix + k] = x
            for e in c.spec.get("env") or []:
                k = e["name"]
                if "valueFrom" not in e:
                    kenv[k] = expand(e.get("value", ""), kenv)
                    continue
                vf = e["valueFrom"]
                if "fieldRef" in vf:
                    kenv[k] = field_value(pod_for_fields, vf["fieldRef"]["fieldPath"])
                elif "resourceFieldRef" in vf:
                    kenv[k] = self.resource_value(c, vf["resourceFieldRef"])
                elif "secretKeyRef" in vf or "configMapKeyRef" in vf:
                    is_secret = "secretKeyRef" in vf
                    ref = vf["secretKeyRef" if is_secret else "configMapKeyRef"]
                    obj = self.kl.get_obj("secrets" if is_secret else "configmaps", self.ns, ref["name"],
                                          ref.get("optional", False))
                    data = (obj or {}).get("data") or {}
                    if ref["key"] not in data:
                        if ref.get("optional"):
                            continue
                        raise ConfigError("couldn't find key %s in %s %s/%s" % (
                            ref["key"], "Secret" if is_secret else "ConfigMap", self.ns, ref["name"]))
                    x = data[ref["key"]]
                    kenv[k] = base64.b64decode(x).decode(errors="replace") if is_secret else x
            env = dict(base)
            env.update(vol_env)
            env["HOSTNAME"] = spec.get("hostname") or self.pname
            env["BALLAST_TEST_POD_IP"] = self.ip
            env["BALLAST_TEST_NODE_NAME"] = self.node.name
            for m in c.spec.get("volumeMounts") or []:
                if m.get("mountPath", "").rstrip("/") == SA_MOUNT and m["name"] in vol_paths:
                    env["BALLAST_K8S_SA_DIR"] = vol_paths[m["name"]]
            env.update(kenv)
            self.envs[c.name] = env
            self.envs_k8s[c.name] = kenv

    def is_sa_volume(self, v, spec):
        mounted = any(m.get("name") == v["name"] and m.get("mountPath", "").rstrip("/") == SA_MOUNT
                      for c in (spec.get("containers") or []) + (spec.get("initContainers") or [])
                      for m in c.get("volumeMounts") or [])
        return mounted and "projected" in v

    def resource_value(self, c, ref):
        res = c.spec.get("resources") or {}
        kind, what = ref["resource"].split(".", 1)
        v = (res.get(kind) or {}).get(what)
        if v is None and kind == "requests":
            v = (res.get("limits") or {}).get(what)
        if v is None:
            v = {"cpu": self.kl.args.cpu, "memory": self.kl.args.memory,
                 "ephemeral-storage": "100Gi"}.get(what, "0") if kind == "limits" or what != "cpu" else "0"
        div = quantity(ref.get("divisor") or "1") or 1.0  # the apiserver defaults it to "0"
        return str(int(math.ceil(quantity(v) / div)))

    def fill_volume(self, v, d, pod):
        def put(rel, data, mode=None):
            p = os.path.join(d, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            write_file_atomic(p, data, mode if mode is not None else 0o644)

        def from_map(data, items, binary=False):
            if items:
                for it in items:
                    if it["key"] in data:
                        put(it["path"], data[it["key"]], it.get("mode"))
            else:
                for k, x in data.items():
                    put(k, x)

        def cm_data(name, optional):
            obj = self.kl.get_obj("configmaps", self.ns, name, optional) or {}
            data = dict(obj.get("data") or {})
            data.update({k: base64.b64decode(x) for k, x in (obj.get("binaryData") or {}).items()})
            return data

        def secret_data(name, optional):
            obj = self.kl.get_obj("secrets", self.ns, name, optional) or {}
            return {k: base64.b64decode(x) for k, x in (obj.get("data") or {}).items()}

        def downward(items):
            for it in items or []:
                if "fieldRef" in it:
                    put(it["path"], field_value(pod, it["fieldRef"]["fieldPath"]), it.get("mode"))

        if "configMap" in v:
            s = v["configMap"]
            from_map(cm_data(s["name"], s.get("optional", False)), s.get("items"))
        elif "secret" in v:
            s = v["secret"]
            from_map(secret_data(s["secretName"], s.get("optional", False)), s.get("items"))
        elif "downwardAPI" in v:
            downward(v["downwardAPI"].get("items"))
        elif "projected" in v:
            for src in v["projected"].get("sources") or []:
                if "serviceAccountToken" in src:
                    s = src["serviceAccountToken"]
                    put(s["path"], self.request_token(s), 0o600)
                elif "configMap" in src:
                    s = src["configMap"]
                    from_map(cm_data(s["name"], s.get("optional", False)), s.get("items"))
                elif "secret" in src:
                    s = src["secret"]
                    from_map(secret_data(s["name"], s.get("optional", False)), s.get("items"))
                elif "downwardAPI" in src:
                    downward(src["downwardAPI"].get("items"))

    def request_token(self, s):
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        spec = {"expirationSeconds": int(s.get("expirationSeconds", 3607)),
                "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": self.pname, "uid": self.uid}}
        if s.get("audience"):
            spec["audiences"] = [s["audience"]]
        r = self.kl.api.request("POST", "/api/v1/namespaces/%s/serviceaccounts/%s/token" % (self.ns, sa),
                                body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                      "spec": spec})
        return r["status"]["token"]

    # ---- status
    def build_status(self):
        ctrs = self.inits + self.mains
        initialized = self.init_idx >= len(self.inits) or self.terminal
        ready = (self.phase == "Running" and all(c.running() for c in self.mains)
                 and all(c.running() for c in self.inits if c.kind == "sidecar"))
        conds = {"PodScheduled": True, "PodReadyToStartContainers": self.prepared,
                 "Initialized": initialized, "ContainersReady": ready, "Ready": ready}
        out = []
        for t, v in conds.items():
            prev = self.cond_times.get(t)
            if prev is None or prev[0] != v:
                self.cond_times[t] = prev = (v, now_ts())
            out.append({"type": t, "status": "True" if v else "False", "lastTransitionTime": prev[1],
                        "lastProbeTime": None})
        st = {"phase": self.phase, "conditions": out,
              "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}]}
        if self.prepared or self.start_time:
            st["podIP"] = self.ip
            st["podIPs"] = [{"ip": self.ip}]
        if self.start_time:
            st["startTime"] = ts_of(self.start_time)
        st["containerStatuses"] = [c.status() for c in self.mains]
        if self.inits:
            st["initContainerStatuses"] = [c.status() for c in self.inits]
        return st

    def report(self):
        """Patches the pod status when it changed (never for a failed/silent node)."""
        if self.node.state != "ok":
            return
        st = self.build_status()
        key = json.dumps(st, sort_keys=True)
        if key == self.last_sent:
            return
        if self.report_retry_at and time.time() < self.report_retry_at:
            return
        body = {"metadata": {"uid": self.uid}, "status": st}
        try:
            self.kl.api.request("PATCH", "/api/v1/namespaces/%s/pods/%s/status" % (self.ns, self.pname),
                                body=body, ctype="application/strategic-merge-patch+json")
            self.last_sent, self.report_retry_at = key, None
        except ApiError as e:
            if e.status not in (404, 409):  # 404/409: gone, or another pod by this name now
                log("pod %s/%s: status patch failed: %s" % (self.ns, self.pname, e))
            if e.status in (0, 429) or e.status >= 500:
                self.report_retry_at = time.time() + 1
            else:
                self.last_sent, self.report_retry_at = key, None

    def info(self):
        return {"name": self.pname, "namespace": self.ns, "uid": self.uid, "node": self.node.name,
                "ip": self.ip, "phase": self.phase,
                "pids": [c.proc.pid for c in self.inits + self.mains if c.proc and not c.reaped],
                "containers": [{"name": c.name, "state": c.state, "restartCount": c.restarts,
                                "pid": c.proc.pid if c.proc and not c.reaped else None}
                               for c in self.inits + self.mains]}


# --------------------------------------------------------------------------- kubelet

class Kubelet:
    def __init__(self, args):
        self.args = args
        env = {}
        with open(args.kubeconfig_env) as f:
            for line in f:
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                if line.startswith("export "):
                    line = line[7:]
                k, _, v = line.partition("=")
                parts = shlex.split(v) if v else [""]
                env[k] = parts[0] if parts else ""
        self.api = Api(env["KUBE_SERVER"], env["KUBE_TOKEN"], env["KUBE_CA"])
        self.api_port = self.api.port
        self.sdir = os.path.abspath(args.state_dir)
        for d in ("logs", "pods"):
            os.makedirs(os.path.join(self.sdir, d), exist_ok=True)
        self.nodes = {"%s-%d" % (args.name_prefix, i): Node("%s-%d" % (args.name_prefix, i))
                      for i in range(args.nodes)}
        self.ips = IPPool()
        self.workers = {}       # uid -> PodWorker
        self.done_uids = set()  # pods we ran to the end (do not run again)
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.cache = {}
        self.cache_lock = threading.Lock()
        base = {k: v for k, v in os.environ.items()
                if not (k == "KUBECONFIG" or k.startswith("KUBE_") or k.startswith("BALLAST_K8S_"))}
        prepend = [os.path.abspath(p) for x in args.path_prepend for p in x.split(":") if p]
        base["PATH"] = ":".join(prepend + [os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")])
        base.setdefault("HOME", os.path.expanduser("~"))
        self.base_env = base

    # ---- objects with a short cache (secrets/configmaps for env and volumes)
    def get_obj(self, kind, ns, name, optional):
        key = (kind, ns, name)
        with self.cache_lock:
            hit = self.cache.get(key)
        if hit and time.time() - hit[0] < 2.0:
            obj = hit[1]
        else:
            obj = self.api.request("GET", "/api/v1/namespaces/%s/%s/%s" % (ns, kind, name), ok_missing=True)
            with self.cache_lock:
                self.cache[key] = (time.time(), obj)
        if obj is None and not optional:
            raise ConfigError("%s %s/%s not found" % ("Secret" if kind == "secrets" else "ConfigMap", ns, name))
        return obj

    # ---- nodes
    def node_status(self, n, ready, reason, message):
        a = self.args
        t = now_ts()
        conds = [{"type": x, "status": "False", "reason": "Kubelet" + r, "message": "testkubelet",
                  "lastHeartbeatTime": t, "lastTransitionTime": n.ready_since}
                 for x, r in (("MemoryPressure", "HasSufficientMemory"), ("DiskPressure", "HasNoDiskPressure"),
                              ("PIDPressure", "HasSufficientPID"))]
        conds.append({"type": "Ready", "status": "True" if ready else "False", "reason": reason,
                      "message": message, "lastHeartbeatTime": t, "lastTransitionTime": n.ready_since})
        res = {"cpu": str(a.cpu), "memory": a.memory, "pods": str(a.pods), "ephemeral-storage": "100Gi"}
        return {"conditions": conds, "capacity": res, "allocatable": res,
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                              {"type": "Hostname", "address": n.name}],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
                "nodeInfo": {"machineID": "testkubelet-" + n.name, "systemUUID": "testkubelet-" + n.name,
                             "bootID": "testkubelet-%d" % os.getpid(), "kernelVersion": os.uname().release,
                             "osImage": "testkubelet", "containerRuntimeVersion": "testkubelet://1",
                             "kubeletVersion": KUBELET_VERSION, "kubeProxyVersion": "",
                             "operatingSystem": "linux", "architecture": "amd64"}}

    def patch_node_status(self, n, ready=True, reason="KubeletReady", message="testkubelet is posting ready status"):
        self.api.request("PATCH", "/api/v1/nodes/%s/status" % n.name,
                         body={"status": self.node_status(n, ready, reason, message)},
                         ctype="application/strategic-merge-patch+json")

    def register_nodes(self):
        labels_extra = dict(x.split("=", 1) for x in self.args.node_label)
        for n in self.nodes.values():
            labels = {"kubernetes.io/hostname": n.name, "kubernetes.io/os": "linux",
                      "kubernetes.io/arch": "amd64", "ballast.test/testkubelet": self.args.name_prefix}
            labels.update(labels_extra)
            body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": n.name, "labels": labels},
                    "spec": {}, "status": self.node_status(n, True, "KubeletReady", "testkubelet")}
            try:
                obj = self.api.request("POST", "/api/v1/nodes", body=body)
            except ApiError as e:
                if e.status != 409:
                    raise
                obj = self.api.request("PATCH", "/api/v1/nodes/" + n.name, body={"metadata": {"labels": labels}},
                                       ctype="application/merge-patch+json")
            n.uid = obj["metadata"]["uid"]
            self.patch_node_status(n)
            self.renew_lease(n)
        log("registered nodes: %s" % ", ".join(self.nodes))

    def renew_lease(self, n):
        path = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
        spec = {"holderIdentity": n.name, "leaseDurationSeconds": 40, "renewTime": micro_ts()}
        for attempt in range(50):
            try:
                self.api.request("PATCH", path + "/" + n.name, body={"spec": spec},
                                 ctype="application/merge-patch+json")
                return
            except ApiError as e:
                if e.status != 404:
                    raise
            try:
                self.api.request("POST", path, body={
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": n.name, "namespace": "kube-node-lease",
                                 "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": n.name,
                                                      "uid": n.uid}]},
                    "spec": spec})
                return
            except ApiError as e:
                if e.status == 409:
                    continue
                if e.status == 404:  # kube-node-lease namespace not there yet
                    time.sleep(0.1)
                    continue
                raise

    def heartbeat_loop(self):
        last_status = time.time()
        while not self.stopping.wait(2.0):
            full = time.time() - last_status >= 10
            if full:
                last_status = time.time()
            for n in list(self.nodes.values()):
                if n.state != "ok":
                    continue
                try:
                    self.renew_lease(n)
                    if full:
                        self.patch_node_status(n)
                except Exception as e:
                    log("heartbeat %s: %s" % (n.name, e))

    # ---- control actions
    def fail_node(self, n):
        log("node %s: FAIL" % n.name)
        n.state = "failed"
        n.ready_since = now_ts()
        try:
            self.patch_node_status(n, False, "TestKubeletNodeFailed", "node failed (testkubelet control API)")
        except ApiError as e:
            log("node %s: NotReady patch failed: %s" % (n.name, e))
        with self.lock:
            ws = [w for w in self.workers.values() if w.node is n]
        for w in ws:
            w.killed_by_node = w.killed_by_node or any(c.running() for c in w.inits + w.mains)
            w.kill_all(signal.SIGKILL)
            w.q.put(("node_failed",))

    def silence_node(self, n):
        log("node %s: SILENT" % n.name)
        if n.state == "ok":
            n.state = "silent"

    def recover_node(self, n):
        log("node %s: RECOVER (was %s)" % (n.name, n.state))
        if n.state == "ok":
            return
        n.ready_since = now_ts()
        n.state = "ok"
        self.patch_node_status(n)
        self.renew_lease(n)
        pods = self.api.request("GET", "/api/v1/pods",
                                query={"fieldSelector": "spec.nodeName=" + n.name}).get("items", [])
        present = {p["metadata"]["uid"]: p for p in pods}
        with self.lock:
            for w in [w for w in self.workers.values() if w.node is n]:
                w.q.put(("resync", present.get(w.uid)))
        for p in pods:
            self.dispatch("ADDED", p)

    def cordon(self, n, flag):
        self.api.request("PATCH", "/api/v1/nodes/" + n.name, body={"spec": {"unschedulable": flag}},
                         ctype="application/merge-patch+json")

    # ---- pods
    def dispatch(self, typ, pod):
        node = self.nodes.get((pod.get("spec") or {}).get("nodeName"))
        if node is None or node.state != "ok":
            return
        uid = pod["metadata"]["uid"]
        with self.lock:
            w = self.workers.get(uid)
            if typ == "DELETED":
                if w:
                    w.q.put(("deleted",))
                return
            if w:
                w.q.put(("update", pod))
                return
            if uid in self.done_uids or self.stopping.is_set():
                return
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed") and not pod["metadata"].get("deletionTimestamp"):
                return
            w = PodWorker(self, pod)
            if phase in ("Succeeded", "Failed"):
                w.terminal, w.phase = True, phase
            self.workers[uid] = w
        w.start()

    def worker_done(self, w):
        with self.lock:
            self.workers.pop(w.uid, None)
            self.done_uids.add(w.uid)
        if not w.host_network:
            self.ips.free(w.ip)
        if w.finished and not self.stopping.is_set():
            shutil.rmtree(w.dir, ignore_errors=True)

    def relist(self):
        r = self.api.request("GET", "/api/v1/pods", query={"fieldSelector": "spec.nodeName!="})
        seen = set()
        for p in r.get("items", []):
            seen.add(p["metadata"]["uid"])
            self.dispatch("ADDED", p)
        with self.lock:
            gone = [w for uid, w in self.workers.items() if uid not in seen and w.node.state == "ok"]
        for w in gone:
            w.q.put(("deleted",))
        return r["metadata"]["resourceVersion"]

    def watch_loop(self, rv):
        while not self.stopping.is_set():
            try:
                if rv is None:
                    rv = self.relist()
                for ev in self.api.watch("/api/v1/pods", {"fieldSelector": "spec.nodeName!=",
                                                          "resourceVersion": rv,
                                                          "timeoutSeconds": str(random.randint(240, 360))}):
                    typ, obj = ev.get("type"), ev.get("object") or {}
                    if typ == "ERROR":
                        code = obj.get("code")
                        log("pod watch error %s: %s" % (code, obj.get("message")), debug=code == 410)
                        rv = None if code == 410 else rv
                        if code != 410:
                            time.sleep(0.5)
                        break
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    if typ in ("ADDED", "MODIFIED", "DELETED"):
                        try:
                            self.dispatch(typ, obj)
                        except Exception:
                            log("dispatch of %s failed:\n%s" % (typ, traceback.format_exc()))
            except ApiError as e:
                if self.stopping.is_set():
                    return
                log("pod watch: %s" % e)
                if e.status == 410:
                    rv = None
                time.sleep(0.5)
            except (OSError, http.client.HTTPException, ValueError) as e:
                if self.stopping.is_set():
                    return
                log("pod watch reconnecting: %r" % e, debug=True)
                time.sleep(0.2)
            except Exception:
                log("pod watch failed (relisting):\n%s" % traceback.format_exc())
                rv = None
                time.sleep(0.5)

    # ---- shutdown
    def shutdown(self):
        self.stopping.set()
        with self.lock:
            ws = list(self.workers.values())
        for w in ws:
            w.kill_all(signal.SIGKILL)
        end = time.time() + 3
        for w in ws:
            w.wait_reaped(max(0.0, end - time.time()))
        log("stopped: killed the processes of %d pods" % len(ws))


class Control(http.server.BaseHTTPRequestHandler):
    kl = None

    def log_message(self, *a):
        pass

    def reply(self, code, obj):
        data = json.dumps(obj, indent=1).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        kl = self.kl
        if self.path == "/pods":
            with kl.lock:
                ws = list(kl.workers.values())
            self.reply(200, [w.info() for w in ws])
        elif self.path == "/nodes":
            self.reply(200, [{"name": n.name, "state": n.state} for n in kl.nodes.values()])
        elif self.path == "/healthz":
            self.reply(200, {"ok": True})
        else:
            self.reply(404, {"error": "unknown path"})

    def do_POST(self):
        kl = self.kl
        m = re.fullmatch(r"/nodes/([^/]+)/(fail|silent|recover|cordon|uncordon)", self.path)
        if not m:
            return self.reply(404, {"error": "unknown path"})
        n = kl.nodes.get(m.group(1))
        if n is None:
            return self.reply(404, {"error": "unknown node %s" % m.group(1)})
        try:
            {"fail": kl.fail_node, "silent": kl.silence_node, "recover": kl.recover_node,
             "cordon": lambda n: kl.cordon(n, True), "uncordon": lambda n: kl.cordon(n, False)}[m.group(2)](n)
        except Exception as e:
            return self.reply(500, {"error": str(e)})
        self.reply(200, {"ok": True, "node": n.name, "state": n.state})


def main():
    global VERBOSE, REAPER
    p = argparse.ArgumentParser(description="minimal process-running kubelet for tests (see file header)")
    p.add_argument("--kubeconfig-env", required=True, help="DIR/env written by scripts/k8s/cluster.sh")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--name-prefix", default="tk-node")
    p.add_argument("--state-dir", required=True)
    p.add_argument("--cpu", default="8")
    p.add_argument("--memory", default="32Gi")
    p.add_argument("--pods", type=int, default=110)
    p.add_argument("--path-prepend", action="append", default=[])
    p.add_argument("--node-label", action="append", default=[])
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    VERBOSE = args.verbose

    REAPER = Reaper()
    kl = Kubelet(args)
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    try:
        kl.register_nodes()
        rv = kl.relist()
        threading.Thread(target=kl.watch_loop, args=(rv,), daemon=True, name="watch").start()
        threading.Thread(target=kl.heartbeat_loop, daemon=True, name="heartbeat").start()
        Control.kl = kl
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Control)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True, name="control").start()
        write_file_atomic(os.path.join(kl.sdir, "control.port"), "%d\n" % srv.server_address[1])
        log("ready: %d nodes (%s-0..), pod IPs 127.%d.x.y, control port %d, state %s" % (
            args.nodes, args.name_prefix, kl.ips.block, srv.server_address[1], kl.sdir))
        while not stop.wait(1.0):
            pass
    finally:
        kl.shutdown()
        REAPER.close()
        try:
            os.unlink(os.path.join(kl.sdir, "control.port"))
        except OSError:
            pass


if __name__ == "__main__":
    main()
