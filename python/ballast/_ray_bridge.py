"""The Ray bridge of `ballast ray run`: the only part of Ballast that speaks Ray.

`ballast ray run` (C++: src/cli/cmd_ray.cc) runs the job's replacement policy
(NodeManager) and drives its master; it starts this script as a child process and
talks to it over fd 3, one JSON object per line (the protocol is described in
src/scheduler/ray/ray_scheduler.h). The bridge connects to the Ray cluster as
a driver, places one agent actor per Ray node (hard node affinity, the
per-node CPUs, GPUs and custom resources requested, so no second agent of the
job lands on a node and other jobs see the node taken), starts the agent
(`ballast run`) in it, and reports what Ray saw: started on which node, the
agent's exit status, the actor or its node dead (Ray's death notice: faster
than a heartbeat timeout), no free node. It also runs the job's master as an
actor (`ballast master --journal DIR`) pinned to the head (or the node asked
for), which Ray restarts there when it dies: every incarnation resumes the
job from its journal on the port the first one picked, so the agents
reconnect and training goes on.

It is run as a file (runpy), not imported as `ballast._ray_bridge`: importing
the `ballast` package imports torch, seconds the driver does not need, and
classes defined in `__main__` travel to the Ray nodes by value.

Nothing is left behind: the agent actors belong to this driver (Ray kills them
when it goes), each agent dies with its actor (PR_SET_PDEATHSIG), and each
worker with its agent; on EOF, SIGTERM or stop_all every agent gets SIGTERM,
then SIGKILL after the grace, and its actor is killed. The master's actor is
this driver's too, and its master process dies with it.
"""
import ctypes
import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1


def _die_with_parent():
    # In the agent's child, before exec: SIGKILL when the actor's thread that
    # forked it goes (the actor process dying, or being killed by Ray).
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _die_with_raylet():
    """In an agent's actor: ends this process the moment the raylet that
    started it (its parent) exits, as when its Ray node is removed or the
    raylet crashes. Ray's own worker notices that only later (~0.5 s here), and
    meanwhile the agent (this process's child) kept its stream to the master
    open: the driver then started the node's replacement only at Ray's death
    notice instead of at the stream's close. The agent dies with this process
    (PR_SET_PDEATHSIG), its workers with it. A parent that is not a raylet is
    left alone."""
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/comm") as f:
            if f.read().strip() != "raylet":
                return
        fd = os.pidfd_open(ppid)
    except (OSError, AttributeError):  # no pidfd (Linux < 5.3): Ray's own notice then
        return
    if os.getppid() != ppid:  # it exited before the pidfd was opened
        os._exit(1)

    def watch():
        select.select([fd], [], [])  # readable once the raylet has exited
        os._exit(1)

    threading.Thread(target=watch, name="ballast-raylet-watch", daemon=True).start()


def _local_ballast(argv):
    """argv with its ballast binary as installed on this node (the driver's path, else `ballast` on PATH)."""
    import ray
    if os.access(argv[0], os.X_OK):
        return list(argv)
    # Another machine: the same Ballast installed elsewhere on it.
    found = shutil.which("ballast")
    if found is None:
        raise RuntimeError(f"Ray node {ray.util.get_node_ip_address()}: no ballast binary at {argv[0]} and no "
                           "`ballast` on PATH; install Ballast on every node (pip install ballast)")
    return [found] + list(argv[1:])


def _free_port():
    """A free port for the master, kept for the whole job: above Ray's worker ports (10002-19999 by default)
    and below the ephemeral range, where an outgoing connection could take it before the master binds it."""
    import random
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200 if low > 20100 else 0):
        port = random.randrange(20000, low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _Master:
    """The job's master: `ballast master --journal DIR` on this Ray node. Ray
    restarts the actor here (hard node affinity) when it dies, and the actor
    dies when its master process dies of a signal; every incarnation serves
    the port the first one picked (kept beside the journal), so the agents
    reconnect to it."""

    def __init__(self, argv, env, journal, advertise_host, cleanup):
        import threading
        import ray
        self.journal = journal
        self.cleanup = cleanup
        os.makedirs(journal, exist_ok=True)
        state_path = os.path.join(journal, "ray-master.json")
        try:
            with open(state_path) as f:
                state = json.load(f)
        except (OSError, ValueError):
            state = {}
        port = int(state.get("port") or _free_port())
        incarnation = int(state.get("incarnation", 0)) + 1
        with open(state_path + ".tmp", "w") as f:
            json.dump({"port": port, "incarnation": incarnation}, f)
        os.replace(state_path + ".tmp", state_path)
        ip = ray.util.get_node_ip_address()
        argv = _local_ballast(argv) + ["--host", "0.0.0.0", "--port", str(port), "--advertise-host",
                                       advertise_host or ip]
        full = dict(os.environ)
        full.update(env)
        self.stopping = False
        self.code = None
        self.proc = None
        self.ended = threading.Event()
        started = threading.Event()
        failed = []

        def keep():
            # The master's parent thread (PR_SET_PDEATHSIG is the forking thread's): it lives as long as the master.
            try:
                self.proc = subprocess.Popen(argv, env=full, preexec_fn=_die_with_parent)
            except OSError as e:
                failed.append(e)
                started.set()
                return
            started.set()
            code = self.proc.wait()
            if code < 0 and not self.stopping:
                # Died of a signal (OOM, a kill): the actor goes with it, and Ray restarts both here.
                print(f"ballast: the master process (pid {self.proc.pid}) died of signal {-code}; Ray restarts its "
                      "actor, which resumes the job from the journal", file=sys.stderr, flush=True)
                os._exit(1)
            self.code = code
            self.ended.set()

        threading.Thread(target=keep, name="ballast-master", daemon=True).start()
        started.wait()
        if failed:
            raise RuntimeError(f"cannot start the master ({argv[0]}): {failed[0]}")
        self.where = {"pid": self.proc.pid, "ip": ip, "port": port, "incarnation": incarnation,
                      "host": _host(ray.get_runtime_context().get_node_id(), ip)}

    def __repr__(self):
        return "master"  # Ray prefixes its lines with it

    def info(self):
        return self.where

    def wait(self):
        self.ended.wait()
        return self.code

    def stop(self, grace):
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.cleanup:
            shutil.rmtree(self.journal, ignore_errors=True)
        return self.proc.returncode


class _Agent:
    """One node of the job: runs `ballast run` on the Ray node it was placed on."""

    def __init__(self, name, node_rank):
        self.name = name
        self.node_rank = node_rank
        self.proc = None
        _die_with_raylet()

    def __repr__(self):
        # Ray prefixes the lines this actor prints with it: "(node-1 rank 1 pid=..)".
        return f"{self.name} node-rank={self.node_rank}"

    def start(self, argv, env):
        import ray
        argv = _local_ballast(argv)
        full = dict(os.environ)
        full.update(env)
        self.proc = subprocess.Popen(argv, env=full, preexec_fn=_die_with_parent)
        ctx = ray.get_runtime_context()
        return {"pid": self.proc.pid, "node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address()}

    def wait(self):
        return self.proc.wait()

    def stop(self, grace):
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _first_line(err):
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def _host(node_id, ip):
    return f"ray:{node_id[:12]}@{ip}"


class Bridge:
    def __init__(self, sock, opts):
        self.sock = sock
        self.opts = opts
        self.buf = b""
        self.nodes = {}        # name -> dict(actor, node_id, host, start_ref, wait_ref, rank)
        self.pending = []      # launch requests waiting for a free node, oldest first
        self.stopping = []     # (actor, stop_ref, deadline)
        self.ray = None
        self.agent_cls = None
        self._alive = []
        self._alive_at = 0.0
        self.master = None     # dict(actor, info_ref, wait_ref, stop_ref, incarnation, died)

    # --- the protocol ---
    def send(self, **event):
        data = (json.dumps(event) + "\n").encode()
        try:
            self.sock.sendall(data)
        except OSError:
            pass  # the driver is gone; the loop ends on EOF

    def read_ops(self, timeout):
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        ready = sel.select(timeout)
        sel.close()
        if not ready:
            return []
        data = self.sock.recv(65536)
        if not data:
            return None  # EOF: the driver ended
        self.buf += data
        ops = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            if line.strip():
                ops.append(json.loads(line))
        return ops

    # --- Ray ---
    def connect(self):
        try:
            import ray
        except ImportError:
            self.send(ev="error", message=(
                f"Ray is not installed for {sys.executable}: install it there (pip install 'ballast[ray]', or "
                "ray[default]), or point --bridge-python at an interpreter that has it"))
            return False
        self.ray = ray
        address = self.opts.get("address") or os.environ.get("RAY_ADDRESS") or "auto"
        try:
            ray.init(address=address, namespace=self.opts.get("namespace") or None,
                     logging_level="WARNING", log_to_driver=True)
        except Exception as e:  # ConnectionError, ValueError: no cluster there
            self.send(ev="error", message=(
                f"cannot connect to a Ray cluster at {address}: {e}. Start one (`ray start --head`), or give its "
                "address with --address or RAY_ADDRESS"))
            return False
        self.agent_cls = ray.remote(_Agent)
        alive = self.alive_nodes(force=True)
        self.send(ev="ready", nodes=len(alive), address=address, ip=ray.util.get_node_ip_address())
        return True

    def alive_nodes(self, force=False):
        now = time.monotonic()
        if force or now - self._alive_at > 0.5:
            self._alive = [n for n in self.ray.nodes() if n.get("Alive")]
            self._alive_at = now
        return self._alive

    def fits(self, node):
        res = node.get("Resources", {})
        want = {"CPU": self.opts.get("cpus", 1), "GPU": self.opts.get("gpus", 0)}
        want.update(self.opts.get("resources") or {})
        return all(res.get(k, 0) >= v for k, v in want.items() if v)

    def free_node(self, avoid):
        busy = {n["node_id"] for n in self.nodes.values()}
        for node in self.alive_nodes():
            nid = node["NodeID"]
            if nid in busy or _host(nid, node.get("NodeManagerAddress", "")) in avoid:
                continue
            if self.fits(node):
                return node
        return None

    def place(self):
        still = []
        for req in self.pending:
            node = self.free_node(set(req.get("avoid") or []))
            if node is None:
                if not req.get("reported") and time.monotonic() - req["since"] > self.opts.get("pending_s", 10):
                    req["reported"] = True
                    self.send(ev="pending", name=req["name"], reason=self.no_node_reason(req))
                still.append(req)
                continue
            self.start(req, node)
        self.pending = still

    def no_node_reason(self, req):
        alive = self.alive_nodes()
        fit = [n for n in alive if self.fits(n)]
        want = {"CPU": self.opts.get("cpus", 1), "GPU": self.opts.get("gpus", 0), **(self.opts.get("resources") or {})}
        want = {k: v for k, v in want.items() if v}
        return (f"no free Ray node: {len(alive)} alive, {len(fit)} with the resources an agent takes ({want}), "
                f"{len(self.nodes)} already run one of this job's agents"
                + (f", {len(req.get('avoid') or [])} avoided" if req.get("avoid") else ""))

    def start(self, req, node):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        nid = node["NodeID"]
        resources = dict(self.opts.get("resources") or {})
        actor = self.agent_cls.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nid, soft=False),
            num_cpus=self.opts.get("cpus", 1), num_gpus=self.opts.get("gpus", 0), resources=resources,
            max_restarts=0, max_task_retries=0, max_concurrency=4,
        ).remote(req["name"], req["node_rank"])
        env = dict(req.get("env") or {})
        env["BALLAST_RAY_NODE_ID"] = nid
        self.nodes[req["name"]] = {
            "actor": actor, "node_id": nid, "host": _host(nid, node.get("NodeManagerAddress", "")),
            "start_ref": actor.start.remote(req["argv"], env), "wait_ref": None,
            "since": time.monotonic(), "reported": False,
        }

    def node_gone_reason(self, n, err):
        alive = {x["NodeID"] for x in self.alive_nodes(force=True)}
        if n["node_id"] not in alive:
            return f"Ray node {n['host']} died (Ray's health check)"
        return f"Ray reports its agent actor dead on node {n['host']}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"

    def watch(self):
        ray = self.ray
        refs = {}
        for name, n in self.nodes.items():
            ref = n["wait_ref"] if n["wait_ref"] is not None else n["start_ref"]
            refs[ref] = name
        if refs:
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
            for ref in done:
                name = refs[ref]
                n = self.nodes[name]
                try:
                    value = ray.get(ref)
                except ray.exceptions.ActorUnavailableError as e:
                    if n["wait_ref"] is not None:
                        # Unreachable for now, not dead: ask again.
                        n["wait_ref"] = n["actor"].wait.remote()
                        continue
                    # Whether the agent started is unknown: the node is given up (its actor killed).
                    del self.nodes[name]
                    self.stopping.append((n["actor"], None, time.monotonic()))
                    self.send(ev="lost", name=name, host=n["host"], reason=self.node_gone_reason(n, e))
                    continue
                except Exception as e:  # ActorDiedError, RayActorError, a start that raised
                    del self.nodes[name]
                    self.send(ev="lost", name=name, host=n["host"], reason=self.node_gone_reason(n, e))
                    continue
                if n["wait_ref"] is None:
                    n["host"] = _host(value["node_id"], value["ip"])
                    n["wait_ref"] = n["actor"].wait.remote()
                    self.send(ev="started", name=name, host=n["host"])
                else:
                    del self.nodes[name]
                    code = value if value >= 0 else 0
                    sig = -value if value < 0 else 0
                    self.send(ev="exited", name=name, host=n["host"], code=code, signal=sig)
                    self.stopping.append((n["actor"], None, time.monotonic()))
        # An actor that has not started its agent yet: said once.
        now = time.monotonic()
        for name, n in self.nodes.items():
            waited = now - n["since"]
            if n["wait_ref"] is None and not n["reported"] and waited > self.opts.get("pending_s", 10):
                n["reported"] = True
                self.send(ev="pending", name=name, reason=(
                    f"its agent actor on Ray node {n['host']} has not started after {waited:.0f} s: Ray has not "
                    "scheduled it there (are the node's CPUs, GPUs or custom resources taken by other actors?) "
                    "or its worker process is still starting (a runtime_env being installed?)"))
        # Actors of released or ended nodes: killed once their stop returned or its grace ran out.
        keep = []
        for actor, ref, deadline in self.stopping:
            finished = ref is None or ray.wait([ref], timeout=0)[0]
            if finished or now > deadline:
                ray.kill(actor, no_restart=True)
            else:
                keep.append((actor, ref, deadline))
        self.stopping = keep

    # --- the master's actor ---
    def master_node(self, want):
        alive = self.alive_nodes(force=True)
        for node in alive:
            if want == "head" and "node:__internal_head__" in node.get("Resources", {}):
                return node, None
            if want != "head" and (node.get("NodeManagerAddress") == want or node["NodeID"].startswith(want)):
                return node, None
        names = ", ".join(_host(n["NodeID"], n.get("NodeManagerAddress", "")) for n in alive)
        return None, (f"no alive Ray node is {'the head' if want == 'head' else repr(want)} (alive: {names}); "
                      "give --master-on a node's IP or id, or 'driver'")

    def master_start(self, op):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        node, why = self.master_node(op.get("node") or "head")
        if node is None:
            self.send(ev="master_lost", reason=why)
            return
        actor = self.ray.remote(_Master).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False),
            num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=4,
        ).remote(op["argv"], op.get("env") or {}, op["journal"], op.get("advertise_host") or "",
                 bool(op.get("cleanup")))
        self.master = {"actor": actor, "info_ref": actor.info.remote(), "wait_ref": None, "stop_ref": None,
                       "incarnation": 0, "died": None}

    def watch_master(self):
        m = self.master
        if m is None:
            return
        ray = self.ray
        if m["stop_ref"] is not None:
            done = ray.wait([m["stop_ref"]], timeout=0)[0]
            if not done and time.monotonic() < m["stop_deadline"]:
                return
            code = None
            try:
                code = ray.get(m["stop_ref"], timeout=0) if done else None
            except Exception:
                pass
            ray.kill(m["actor"], no_restart=True)
            self.master = None
            self.send(ev="master_stopped", code=max(code or 0, 0), signal=-code if code and code < 0 else 0)
            return
        if m["info_ref"] is not None and ray.wait([m["info_ref"]], timeout=0)[0]:
            try:
                info = ray.get(m["info_ref"])
            except ray.exceptions.ActorUnavailableError:
                m["info_ref"] = m["actor"].info.remote()  # restarting, or unreachable for now: ask again
                return
            except Exception as e:  # dead for good: its node died (it is pinned there), or its start failed
                self.master = None
                ray.kill(m["actor"], no_restart=True)
                self.send(ev="master_lost", reason=_first_line(e))
                return
            m["info_ref"] = None
            if info["incarnation"] > m["incarnation"]:
                if m["incarnation"] > 0:
                    self.send(ev="master_died", reason=m["died"] or "Ray restarted its actor")
                m["incarnation"] = info["incarnation"]
                self.send(ev="master_started", **info)
            m["wait_ref"] = m["actor"].wait.remote()
        if m["wait_ref"] is not None and ray.wait([m["wait_ref"]], timeout=0)[0]:
            try:
                code = ray.get(m["wait_ref"])
            except Exception as e:
                # The actor died (or is unreachable): the next incarnation, Ray's restart, says which.
                m["wait_ref"] = None
                m["died"] = _first_line(e)
                m["info_ref"] = m["actor"].info.remote()
                return
            m["wait_ref"] = None
            self.send(ev="master_exited", code=max(code, 0), signal=-code if code < 0 else 0)

    def master_stop(self, grace):
        m = self.master
        if m is None:
            self.send(ev="master_stopped", code=0, signal=0)
            return
        m["stop_ref"] = m["actor"].stop.remote(grace)
        m["stop_deadline"] = time.monotonic() + grace + 5

    def release(self, name, grace):
        self.pending = [r for r in self.pending if r["name"] != name]
        n = self.nodes.pop(name, None)
        if n is not None:
            self.stopping.append((n["actor"], n["actor"].stop.remote(grace), time.monotonic() + grace + 5))

    def stop_all(self, grace, master=True):
        self.pending = []
        for name in list(self.nodes):
            self.release(name, grace)
        deadline = time.monotonic() + grace + 5
        while self.stopping and time.monotonic() < deadline:
            self.watch()
            time.sleep(0.05)
        for actor, _, _ in self.stopping:
            self.ray.kill(actor, no_restart=True)
        self.stopping = []
        if master and self.master is not None:
            self.ray.kill(self.master["actor"], no_restart=True)
            self.master = None

    def run(self):
        if not self.connect():
            return 1
        while True:
            ops = self.read_ops(0.05)
            if ops is None:
                self.stop_all(0)
                return 0
            for op in ops:
                kind = op.get("op")
                if kind == "launch":
                    op["since"] = time.monotonic()
                    self.pending.append(op)
                elif kind == "release":
                    self.release(op["name"], float(op.get("grace", 5)))
                elif kind == "stop_all":
                    self.stop_all(float(op.get("grace", 5)), master=False)
                    self.send(ev="stopped")
                elif kind == "master_start":
                    self.master_start(op)
                elif kind == "master_kill":
                    if self.master is not None:
                        self.ray.kill(self.master["actor"], no_restart=False)
                elif kind == "master_stop":
                    self.master_stop(float(op.get("grace", 5)))
            if self.pending:
                self.place()
            self.watch()
            self.watch_master()


def main():
    opts = json.loads(os.environ.get("BALLAST_RAY_OPTIONS", "{}"))
    sock = socket.socket(fileno=int(os.environ.get("BALLAST_RAY_BRIDGE_FD", "3")))
    bridge = Bridge(sock, opts)

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        return bridge.run()
    finally:
        if bridge.ray is not None and (bridge.nodes or bridge.stopping or bridge.master):
            try:
                bridge.stop_all(0)
            except Exception:
                pass


if __name__ == "__main__":
    sys.exit(main())
