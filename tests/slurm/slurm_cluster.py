#!/usr/bin/python3
"""A real multi-node Slurm cluster on one machine, for tests (stdlib only, root).

Slurm 22.05 (Debian 12 packages slurmctld, slurmd, slurm-client, munge) runs as
on a cluster: slurmctld in a "ctl" network namespace, one slurmd per node
n1..nN, each in its own network namespace with a veth link to a private bridge
(in a "switch" namespace), its own IP (10.67.0.0/24), its own host name (UTS
namespace) and a private mount namespace in which a generated hosts file is
bind-mounted on /etc/hosts (there is no DNS). munged runs in the machine's own
namespaces; its unix socket, on the shared filesystem, reaches every node. Job
processes run inside their node's namespaces, so killing a node (kill_node) or
cutting its link (link) is a dead or partitioned machine.

    from slurm_cluster import SlurmCluster
    with SlurmCluster(nodes=5) as c:
        job = c.sbatch(script, args=["x"], env={"FOO": "1"})
        c.wait_job(job, timeout=60)        # "COMPLETED"
        c.kill_node("n3"); c.wait_node_state("n3", lambda s: s.endswith("*"), 15)
        c.run(["scontrol", "show", "nodes"]).stdout

Everything lives under c.workdir (/tmp/ballast-slurm-<tag>, mode 755, visible
from every node at the same path); stop() kills every daemon and every process
in the cluster's namespaces, deletes the namespaces and the directory (kept
when BALLAST_KEEP_SLURM=1). stop() also runs at exit and on SIGTERM; daemons
get PR_SET_PDEATHSIG so they die with the process that started them, and
start() first cleans up what a SIGKILLed earlier run left behind.

As a developer's tool:

    /usr/bin/python3 tests/slurm/slurm_cluster.py up [--nodes N] [--cpus C]
        starts a cluster, prints the environment to export, stays up until Ctrl-C
    /usr/bin/python3 tests/slurm/slurm_cluster.py clean
        removes what clusters whose owner died left behind
"""
import atexit
import ctypes
import glob
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

SUBNET = "10.67.0"           # /24; tests/python/_netns.py uses 10.66.0.0/24
CTL_IP = f"{SUBNET}.1"
# wait_job() waits while a job is in one of these (transient ones included:
# a requeued job goes back to PENDING); SUSPENDED, *_HOLD and STOPPED return.
_ACTIVE_STATES = ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED",
                  "RESIZING", "SIGNALING", "STAGE_OUT", "REQUEUE_FED")
_WORKDIR_PREFIX = "/tmp/ballast-slurm-"

_live = []                    # started, not yet stopped clusters
_live_lock = threading.Lock()
_handlers_installed = False
_prev_sigterm = None


def _log(msg):
    print(f"[slurm-cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _ip(*args, check=True):
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {p.stderr.strip()} "
                           "(the Slurm cluster needs root and iproute2)")
    return p


try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl   # loaded here, not after fork
except (OSError, AttributeError):
    _prctl = None


def _pdeathsig():
    _prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG


def _preexec_fn():
    # PR_SET_PDEATHSIG fires when the *thread* that forked dies: only from the
    # main thread, which lives as long as the process.
    if _prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    return _pdeathsig


def _proc_start_time(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
        return s[s.rindex(")") + 2:].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def _proc_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
        return s[s.rindex(")") + 2:].split()[0]
    except (OSError, ValueError, IndexError):
        return None


def _ns_pids(ns):
    """Pids whose network namespace is /run/netns/<ns> (what `ip netns pids` does)."""
    try:
        st = os.stat(f"/run/netns/{ns}")
    except OSError:
        return []
    me = os.getpid()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        pid = int(d)
        if pid == me:
            continue
        try:
            s = os.stat(f"/proc/{d}/ns/net")
        except OSError:
            continue
        if s.st_ino == st.st_ino and s.st_dev == st.st_dev:
            out.append(pid)
    return out


def _kill_ns(ns, timeout=10):
    """SIGKILLs every process in network namespace ns until none is left (zombies aside)."""
    deadline = time.time() + timeout
    while True:
        pids = [p for p in _ns_pids(ns) if _proc_state(p) not in (None, "Z")]
        if not pids:
            return True
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.time() > deadline:
            return False
        time.sleep(0.02)


def _del_ns(ns, timeout=10):
    deadline = time.time() + timeout
    while os.path.exists(f"/run/netns/{ns}"):
        p = _ip("netns", "del", ns, check=False)
        if p.returncode == 0 or time.time() > deadline:
            break
        time.sleep(0.05)


def _tail(path, lines=25):
    try:
        with open(path, errors="replace") as f:
            data = f.readlines()
    except OSError:
        return f"  ({path}: missing)\n"
    return "".join("  " + l for l in data[-lines:]) or "  (empty)\n"


def _stop_all_live():
    with _live_lock:
        clusters = list(_live)
    for c in clusters:
        try:
            c.stop()
        except Exception as e:  # keep tearing the others down
            _log(f"stop of {c.workdir} failed: {e}")


def _on_sigterm(signum, frame):
    _stop_all_live()
    prev = _prev_sigterm
    if callable(prev):
        prev(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_handlers():
    global _handlers_installed, _prev_sigterm
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(_stop_all_live)
    if threading.current_thread() is threading.main_thread():
        prev = signal.getsignal(signal.SIGTERM)
        if prev is not _on_sigterm:
            _prev_sigterm = prev if prev not in (signal.SIG_IGN,) else None
            signal.signal(signal.SIGTERM, _on_sigterm)


def cleanup_stale(verbose=True):
    """Tears down clusters whose owning process is gone (e.g. a SIGKILLed test run)."""
    cleaned = []
    for meta_path in glob.glob(_WORKDIR_PREFIX + "*/cluster.json"):
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue
        if meta.get("state") != "running":
            continue
        owner, start = meta.get("owner_pid"), meta.get("owner_start")
        if owner and _proc_start_time(owner) == start:
            continue  # still owned by a live process
        for ns in meta.get("node_ns", []) + [meta.get("ctl_ns"), meta.get("switch_ns")]:
            if ns:
                _kill_ns(ns)
        for pid in meta.get("root_pids", []):   # munged
            try:
                if _proc_start_time(pid[0]) == pid[1]:
                    os.kill(pid[0], signal.SIGKILL)
            except (ProcessLookupError, TypeError, IndexError):
                pass
        for ns in meta.get("node_ns", []) + [meta.get("ctl_ns"), meta.get("switch_ns")]:
            if ns:
                _del_ns(ns)
        d = os.path.dirname(meta_path)
        if meta.get("keep"):
            meta["state"] = "stopped"
            with open(meta_path, "w") as f:
                json.dump(meta, f)
        else:
            shutil.rmtree(d, ignore_errors=True)
        cleaned.append(d)
        if verbose:
            _log(f"cleaned up stale cluster {d} (owner pid {owner} is gone)")
    return cleaned


class SlurmCluster:
    def __init__(self, nodes=5, cpus_per_node=4, workdir=None, slurmd_timeout=5):
        if not 1 <= nodes <= 200:
            raise ValueError("nodes must be 1..200")
        self.nnodes = nodes
        self.cpus_per_node = cpus_per_node
        self.slurmd_timeout = slurmd_timeout
        self.tag = secrets.token_hex(3)
        self.node_names = [f"n{i}" for i in range(1, nodes + 1)]
        self.controller_addr = CTL_IP
        self._own_workdir = workdir is None
        self.workdir = workdir or f"{_WORKDIR_PREFIX}{self.tag}"
        self.switch_ns = f"bslsw-{self.tag}"
        self.ctl_ns = f"bslctl-{self.tag}"
        self._ns = {n: f"bsl{n}-{self.tag}" for n in self.node_names}
        self.conf = os.path.join(self.workdir, "slurm.conf")
        self.munge_socket = os.path.join(self.workdir, "munge", "munge.socket")
        # The caller's environment, less any Slurm settings of an outer job or
        # user (SLURM_JOB_ID, SBATCH_*, ... would steer the clients elsewhere).
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SINFO_"))}
        self.env["SLURM_CONF"] = self.conf
        self._munged = None
        self._ctld = None
        self._slurmd = {}
        self._started = False
        self._stopped = False
        self._stop_lock = threading.Lock()
        self.start_seconds = None
        self.stop_seconds = None

    # ----- addresses and paths -----
    def addr(self, name):
        if name == "ctl":
            return CTL_IP
        return f"{SUBNET}.{self.node_names.index(name) + 2}"

    def netns(self, name):
        """The network namespace name of a node (or "ctl")."""
        return self.ctl_ns if name == "ctl" else self._ns[name]

    def log_path(self, name):
        """slurmd's (or, for "ctl", slurmctld's) log file."""
        if name == "ctl":
            return os.path.join(self.workdir, "log", "slurmctld.log")
        return os.path.join(self.workdir, "log", f"slurmd-{name}.log")

    def _p(self, *parts):
        return os.path.join(self.workdir, *parts)

    # ----- lifecycle -----
    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    def start(self):
        if self._started:
            raise RuntimeError("SlurmCluster.start() called twice")
        if os.geteuid() != 0:
            raise RuntimeError("SlurmCluster needs root (network namespaces, mounts)")
        for b in ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "nsenter", "unshare"):
            if not shutil.which(b, path="/usr/sbin:/usr/bin:/sbin:/bin"):
                raise RuntimeError(f"{b} not found: install slurmctld slurmd slurm-client munge "
                                   "(scripts/install-deps.sh)")
        if len(self.munge_socket) > 100:
            raise RuntimeError(f"workdir path too long for a unix socket: {self.munge_socket}")
        cleanup_stale()
        self._started = True
        _install_handlers()
        with _live_lock:
            _live.append(self)
        t0 = time.time()
        try:
            self._start(t0)
        except BaseException as e:
            msg = f"Slurm cluster failed to start: {e}\n{self.log_tails()}"
            self.stop()
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise RuntimeError(msg) from e
        self.start_seconds = time.time() - t0
        _log(f"cluster up: {self.nnodes} nodes idle in {self.start_seconds:.2f} s ({self.workdir})")
        return self

    def _phase(self, t0, what):
        _log(f"{what} (+{time.time() - t0:.2f} s)")

    def _write_meta(self, state):
        meta = {
            "state": state, "owner_pid": os.getpid(), "owner_start": _proc_start_time(os.getpid()),
            "switch_ns": self.switch_ns, "ctl_ns": self.ctl_ns, "node_ns": list(self._ns.values()),
            "root_pids": ([[self._munged.pid, _proc_start_time(self._munged.pid)]] if self._munged else []),
            "keep": os.environ.get("BALLAST_KEEP_SLURM") == "1",
        }
        tmp = self._p("cluster.json.tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, self._p("cluster.json"))

    def _start(self, t0):
        os.makedirs(self.workdir, exist_ok=True)
        os.chmod(self.workdir, 0o755)
        for d in ("munge", "log", "state", "spool", "run"):
            os.makedirs(self._p(d), mode=0o755, exist_ok=True)
            os.chmod(self._p(d), 0o755)
        os.makedirs(self._p("munge-key"), mode=0o700, exist_ok=True)
        os.chmod(self._p("munge-key"), 0o700)
        self._write_meta("running")   # before anything exists that would need cleaning

        # munged, in the machine's own namespaces.
        key = self._p("munge-key", "munge.key")
        subprocess.run(["mungekey", "--create", "--force", f"--keyfile={key}"], check=True,
                       capture_output=True, text=True)
        os.chmod(key, 0o600)
        with open(self._p("log", "munged.out"), "wb") as out:
            self._munged = subprocess.Popen(
                ["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                 f"--key-file={key}", f"--pid-file={self._p('run', 'munged.pid')}",
                 f"--log-file={self._p('log', 'munged.log')}", f"--seed-file={self._p('munge-key', 'munged.seed')}",
                 "--num-threads=2"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_preexec_fn())
        self._write_meta("running")

        # Network: a bridge in the switch namespace, a veth to it per host.
        _ip("netns", "add", self.switch_ns)
        _ip("-n", self.switch_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch_ns, "link", "set", "br0", "up")
        for i, (host, ns) in enumerate([("ctl", self.ctl_ns)] + list(self._ns.items())):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", self.switch_ns)
            _ip("-n", self.switch_ns, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch_ns, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        self._phase(t0, f"munged and network ({self.nnodes} nodes + ctl on a bridge) up")

        with open(self._p("hosts"), "w") as f:
            f.write("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
            f.write(f"{CTL_IP}\tctl\n")
            for n in self.node_names:
                f.write(f"{self.addr(n)}\t{n}\n")
        os.chmod(self._p("hosts"), 0o644)
        self._write_conf()
        for n in self.node_names:
            os.makedirs(self._p("spool", n), exist_ok=True)

        # Wait for munged before any Slurm daemon needs it.
        self._wait(lambda: os.path.exists(self.munge_socket), 10, "munged socket",
                   proc=self._munged, log=self._p("log", "munged.log"))

        self._ctld = self._spawn("ctl", self.ctl_ns, ["slurmctld", "-D", "-f", self.conf],
                                 self._p("log", "slurmctld.out"))
        for n in self.node_names:
            self.start_node(n, _wait=False)
        self._phase(t0, "slurmctld and slurmd started")

        self._wait(lambda: self.run(["scontrol", "ping"], check=False, timeout=5).stdout.count("UP") > 0,
                   20, "slurmctld to answer", proc=self._ctld, log=self.log_path("ctl"))
        self._phase(t0, "slurmctld answers")

        def all_idle():
            for n, p in self._slurmd.items():
                if p.poll() is not None:
                    raise RuntimeError(f"slurmd on {n} exited with {p.returncode}")
            states = self.node_states()
            return len(states) == self.nnodes and all(s == "idle" for s in states.values())
        self._wait(all_idle, 30, "every node idle", proc=self._ctld, log=self.log_path("ctl"))

    def _wait(self, cond, timeout, what, proc=None, log=None):
        deadline = time.time() + timeout
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{what}: daemon exited with {proc.returncode}" + (f"; see {log}" if log else ""))
            if cond():
                return
            if time.time() > deadline:
                extra = ""
                if what == "every node idle":
                    extra = "; sinfo: " + repr(self.node_states())
                raise RuntimeError(f"timed out after {timeout} s waiting for {what}{extra}")
            time.sleep(0.05)

    def _spawn(self, hostname, ns, argv, out_path):
        inner = (f"mount --bind {shlex.quote(self._p('hosts'))} /etc/hosts && hostname {hostname} && "
                 f"exec {' '.join(shlex.quote(a) for a in argv)}")
        with open(out_path, "ab") as out:
            return subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount", "sh", "-c", inner],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True, preexec_fn=_preexec_fn())

    def start_node(self, name, _wait=True, timeout=20):
        """(Re)starts a node's slurmd (after kill_node) and waits until it responds again.

        With ReturnToService=2 a node that Slurm had marked down comes back idle
        (and is not added back to a running job); one that a job still holds
        comes back "mixed"/"allocated"."""
        old = self._slurmd.get(name)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"slurmd on {name} is still running")
        self._slurmd[name] = self._spawn(name, self._ns[name],
                                         ["slurmd", "-D", "-f", self.conf, "-N", name],
                                         self._p("log", f"slurmd-{name}.out"))
        if _wait:
            # Back and responding: "idle", or "mixed"/"allocated" if a job still holds it.
            self._wait(lambda: self.node_state(name) in ("idle", "mixed", "allocated"), timeout,
                       f"{name} to respond",
                       proc=self._slurmd[name], log=self.log_path(name))

    def _write_conf(self):
        w = self.workdir
        n = self.nnodes
        lines = [
            "# Generated by tests/slurm/slurm_cluster.py",
            f"ClusterName=ballast{self.tag}",
            f"SlurmctldHost=ctl({CTL_IP})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "SlurmctldPort=6817",
            "SlurmdPort=6818",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={w}/state",
            f"SlurmdSpoolDir={w}/spool/%n",
            f"SlurmctldPidFile={w}/run/slurmctld.pid",
            f"SlurmdPidFile={w}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={w}/log/slurmctld.log",
            f"SlurmdLogFile={w}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SlurmdParameters=config_overrides",
            "DebugFlags=NO_CONF_HASH",
            "ReturnToService=2",
            f"SlurmdTimeout={self.slurmd_timeout}",
            "SlurmctldTimeout=10",
            "MessageTimeout=2",
            "TCPTimeout=2",
            "KillWait=2",
            "InactiveLimit=0",
            "MinJobAge=600",
            "MailProg=/bin/true",
            "PropagateResourceLimitsExcept=MEMLOCK",
            f"NodeName=DEFAULT CPUs={self.cpus_per_node} RealMemory=1000 State=UNKNOWN",
        ]
        for name in self.node_names:
            lines.append(f"NodeName={name} NodeAddr={self.addr(name)} NodeHostname={name}")
        lines.append(f"PartitionName=test Default=YES Nodes=n[1-{n}] MaxTime=INFINITE State=UP")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(self.conf, 0o644)

    def stop(self):
        with self._stop_lock:
            if self._stopped or not self._started:
                self._stopped = True
                return
            self._stopped = True
        t0 = time.time()
        # Nodes first (slurmd, slurmstepd, tasks), then the controller, then munged.
        for p in list(self._slurmd.values()) + ([self._ctld] if self._ctld else []):
            if p.poll() is None:
                try:
                    p.kill()
                except ProcessLookupError:
                    pass
        for ns in list(self._ns.values()) + [self.ctl_ns, self.switch_ns]:
            _kill_ns(ns)
        for p in list(self._slurmd.values()) + ([self._ctld] if self._ctld else []):
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self._munged is not None and self._munged.poll() is None:
            self._munged.kill()
            try:
                self._munged.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for ns in list(self._ns.values()) + [self.ctl_ns, self.switch_ns]:
            _del_ns(ns)
        keep = os.environ.get("BALLAST_KEEP_SLURM") == "1"
        if os.path.isdir(self.workdir):
            if keep:
                try:
                    self._write_meta("stopped")
                except OSError:
                    pass
                _log(f"kept {self.workdir} (BALLAST_KEEP_SLURM=1)")
            elif self._own_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)
            else:  # a caller-given directory: remove only what the cluster made
                for d in ("munge", "munge-key", "log", "state", "spool", "run"):
                    shutil.rmtree(self._p(d), ignore_errors=True)
                for f in ("slurm.conf", "hosts", "cluster.json"):
                    try:
                        os.unlink(self._p(f))
                    except OSError:
                        pass
        with _live_lock:
            if self in _live:
                _live.remove(self)
        self.stop_seconds = time.time() - t0
        _log(f"cluster stopped in {self.stop_seconds:.2f} s")

    def log_tails(self, lines=25):
        out = []
        paths = [self._p("log", "munged.log"), self._p("log", "munged.out"),
                 self.log_path("ctl"), self._p("log", "slurmctld.out")]
        for n in self.node_names:
            paths += [self.log_path(n), self._p("log", f"slurmd-{n}.out")]
        for p in paths:
            if os.path.exists(p) and os.path.getsize(p) > 0:
                out.append(f"--- {p} (last {lines} lines)\n{_tail(p, lines)}")
        return "".join(out)

    # ----- clients -----
    def run(self, argv, check=True, timeout=30, **kw):
        """A Slurm client command in the controller's network namespace (text output captured)."""
        env = kw.pop("env", None)
        e = dict(self.env)
        if env:
            e.update(env)
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("stdin", subprocess.DEVNULL)
        p = subprocess.run(["nsenter", f"--net=/run/netns/{self.ctl_ns}", *argv],
                           env=e, timeout=timeout, **kw)
        if check and p.returncode != 0:
            raise subprocess.CalledProcessError(p.returncode, argv, p.stdout, p.stderr)
        return p

    def sbatch(self, script_path, args=(), env=None):
        """Submits a batch script as root; the job inherits self.env plus env. Returns the job id.

        Unless args say otherwise the job runs in workdir (--chdir) and writes
        workdir/slurm-<job>.out (--output), not into the caller's directory."""
        args = list(args)
        extra = []
        if not any(a in ("-D", "--chdir") or a.startswith("--chdir=") for a in args):
            extra.append(f"--chdir={self.workdir}")
        if not any(a in ("-o", "--output") or a.startswith("--output=") for a in args):
            extra.append(f"--output={self.workdir}/slurm-%j.out")
        p = self.run(["sbatch", "--parsable", "--export=ALL", *extra, *args, script_path], env=env, check=False)
        if p.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} {script_path} failed ({p.returncode}): "
                               f"{p.stderr.strip()} {p.stdout.strip()}")
        return int(p.stdout.strip().split(";")[0])

    def _job_fields(self, job_id):
        p = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        fields = {}
        for tok in p.stdout.split():
            k, sep, v = tok.partition("=")
            if sep and k not in fields:
                fields[k] = v
        return fields, p

    def job_state(self, job_id):
        fields, p = self._job_fields(job_id)
        return fields.get("JobState", "UNKNOWN")

    def job_exit_code(self, job_id):
        fields, _ = self._job_fields(job_id)
        return fields.get("ExitCode", "")

    def wait_job(self, job_id, timeout):
        deadline = time.time() + timeout
        while True:
            state = self.job_state(job_id)
            if state not in _ACTIVE_STATES and state != "UNKNOWN":
                return state
            if time.time() > deadline:
                sq = self.run(["squeue", "-a", "-s"], check=False).stdout
                sq2 = self.run(["squeue", "-a"], check=False).stdout
                sc = self.run(["scontrol", "show", "job", str(job_id)], check=False).stdout
                raise AssertionError(f"job {job_id} still {state} after {timeout} s\n"
                                     f"squeue:\n{sq2}\nsqueue -s:\n{sq}\nscontrol show job:\n{sc}")
            time.sleep(0.2)

    def node_states(self):
        """{node: sinfo %T} for every node sinfo reports."""
        p = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=10)
        out = {}
        for line in p.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                out[parts[0]] = parts[1]
        return out

    def node_state(self, name):
        p = self.run(["sinfo", "-h", "-N", "-n", name, "-o", "%T"], check=False, timeout=10)
        lines = p.stdout.split()
        return lines[0] if lines else ""

    def wait_node_state(self, name, predicate, timeout):
        deadline = time.time() + timeout
        seen = []
        while True:
            s = self.node_state(name)
            if not seen or seen[-1] != s:
                seen.append(s)
            if predicate(s):
                return s
            if time.time() > deadline:
                raise AssertionError(f"node {name} did not reach the expected state in {timeout} s; "
                                     f"states seen: {seen}")
            time.sleep(0.2)

    # ----- faults and inspection -----
    def kill_node(self, name):
        """A dead machine: SIGKILL slurmd and every process in the node's network namespace."""
        p = self._slurmd.get(name)
        if p is not None and p.poll() is None:
            p.kill()
        if not _kill_ns(self._ns[name]):
            raise RuntimeError(f"processes in {name}'s namespace survived SIGKILL: {self.processes(name)}")
        if p is not None:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def link(self, name, up):
        """The node's link down (a network partition) or up again."""
        _ip("-n", self._ns[name], "link", "set", "eth0", "up" if up else "down")

    def processes(self, name):
        """(pid, cmdline) of live processes in the node's network namespace (zombies excluded)."""
        out = []
        for pid in _ns_pids(self.netns(name)):
            if _proc_state(pid) in (None, "Z"):
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            out.append((pid, cmd))
        return out

    def steps(self, job_id):
        """(step id "JOB.N", step name, nodelist) for the job's steps, from squeue -s."""
        p = self.run(["squeue", "-h", "-s", "-j", str(job_id), "-o", "%i|%j|%N"], check=False)
        out = []
        for line in p.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 3:
                out.append(tuple(parts))
        return out


def _main(argv):
    import argparse
    ap = argparse.ArgumentParser(prog="slurm_cluster.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a cluster and keep it up until Ctrl-C")
    up.add_argument("--nodes", type=int, default=5)
    up.add_argument("--cpus", type=int, default=4)
    up.add_argument("--slurmd-timeout", type=int, default=5)
    sub.add_parser("clean", help="tear down clusters whose owner process is gone")
    a = ap.parse_args(argv)
    if a.cmd == "clean":
        print("\n".join(cleanup_stale()) or "nothing to clean")
        return 0
    c = SlurmCluster(nodes=a.nodes, cpus_per_node=a.cpus, slurmd_timeout=a.slurmd_timeout)
    c.start()
    try:
        print(f"# Slurm cluster up, workdir {c.workdir}")
        print(f"export SLURM_CONF={c.conf}")
        print(f"# clients must run in the controller's network namespace:")
        print(f"#   nsenter --net=/run/netns/{c.ctl_ns} sinfo")
        for n in c.node_names:
            print(f"#   {n} {c.addr(n)} netns {c.netns(n)}")
        print("# Ctrl-C to tear down", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
