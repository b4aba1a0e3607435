"""Recovery matrix: how fast, and how, a job recovers from each kind of fault,
at each scale, with each kind of checkpoint, on each torch; against the peers.

Cells: {1x2, 2x2, 3x2 nodes x workers} x {no checkpoint, flash checkpoint
every step, flash + peer replicas} x {worker SIGKILL, node loss, hang, early
worker SIGKILLs} x {torch 1.13, torch 2.x}. Every cell runs bench/matrix_train.py (DDP on gloo,
CPU, a tiny deterministic model, 0.05 s a step of simulated compute) on this
machine, every "node" an agent on 127.0.0.1, under

  ballast   `ballast launch --nodes N --nproc-per-node P` (warm restart, the
            default; --ckpt-replicas 0 in the "flash" cells, 1 in "replicas";
            --hang-timeout S in the hang cells). The script saves a flash
            checkpoint (ballast.Checkpointer) after every step, persisted to
            disk every 10, and load()s it on every start.
  torchrun  N torchrun agents (c10d rendezvous, --max-restarts 3,
            --monitor-interval 0.1, the faster of recovery_bench.py's two).
            torch 1.13's torchrun crashes on Python 3.11 (Std.from_str, see
            torch_elastic_baseline.py): this file runs it with that one
            function patched (`recovery_matrix.py _torchrun ARGS`); on torch
            2.x it is the venv's own bin/torchrun.
  dlrover   dlrover-run (bench/setup_dlrover.sh installs 0.6.1 into
            ~/.cache/ballast/dlrover-*; run through dlrover_baseline.py,
            --monitor_interval 0.1): --standalone on one node; on 2-3 nodes
            its local job master (`python -m dlrover.python.master.main
            --platform local --node_num N`) and N agents. Used on a torch
            whose python imports it; otherwise the cells say why not.

The peers have no flash checkpoint: in the checkpoint cells their script
saves with torch.save after every step (rank 0, temp file + rename, into a
directory every node sees, as a shared file system) and torch.load()s it on
every start. A peer has no replicas either, so its "replicas" figure is its
"flash" run (run once, shown in both rows). Nothing runs ballast's Python
package under a peer (PYTHONPATH without build/python).

Faults, injected once warm interpreters are ready on every Ballast node (the
agent logs "warm interpreters ready for the next (re)start") and every rank
passed step 40, as in a job that fails minutes in:

  kill-worker  SIGKILL the worker of the last global rank.
  node-loss    the node of the last global ranks is lost: its agent and
               every process under it SIGKILLed at once, then (Ballast) its
               shared memory removed (/dev/shm/ballast-<hash>-<agent pid>-*:
               its checkpoint stores and the replicas it held;
               /dev/shm/ballast-progress-<pid>). `ballast launch` starts a
               replacement agent itself; for the peers the bench starts one
               at once, the best a cluster manager could do. Neither loses
               its control plane: Ballast's master runs in the launcher, and
               the lost torchrun node is never the one whose agent hosts the
               c10d rendezvous store (DLRover's master is a process of its
               own), except on one node, where the only node is lost.
  hang         the last rank stops (sleeps) at its next step. Ballast detects
               it with --hang-timeout S; torchrun and DLRover have no hang
               detection of their own, so their script's gloo collectives
               get a timeout of S (--pg-timeout) and the surviving ranks'
               failure restarts them. The time counts from the hang.

early-kill is the exception to "once warm interpreters are ready": faults
come early too, at a job's start and right after a restart (a flapping
node). The worker of the last global rank is SIGKILLed --early-kill-at
(3) s after the job's first step (every rank's), whatever Ballast's warm
interpreters have loaded by then, and again --second-kill-after (2) s after
the world came back (every rank's first step after the first kill). Both
recoveries are measured; the cell shows "first then second". Targets: the
first <= 0.5x the best peer's first, the second <= 1.2x the first ("again").
The trial's line also shows what each start's warm interpreters had
imported when they were taken (the agents' "warm interpreters taken" lines).

Per cell, for each trial: the kind of start on every node of the recovery
round (warm/cold, and why, from the agents' "recovery timeline (round R,
KIND start): ... node=ID round=R" lines; a replacement node is marked *),
kill -> first step (seconds from the kill, or the hang, to the first step
that every rank of the new world completed), where the state came from
(memory/replica/disk/none and the step, per rank, from the script's start
events) and the steps lost (the newest step before the fault less the
step resumed), and the peers' kill -> first step, or "failed"
(the job exited, or fewer ranks came back) or "hung" (no step within
--recovery-timeout). Medians over --trials; a cell where a trial failed
or hung says so (beside the median of the others, if any).

Targets (the issue's), checked per cell: every node's start warm (both
starts in early-kill); recovery <= 0.5x the best peer on the same torch (a peer that failed or hung counts
as beaten, not as a time); a checkpoint cell within 1.2x of the
no-checkpoint cell of the same torch, nodes and fault.

torch 1.13 is Debian's /usr/bin/python3; torch 2.x is --python2, else the
python that scripts/torch2-venv.sh prints (it builds that venv first when
it is missing: ~5 GB, minutes). Run the bench itself with /usr/bin/python3.
--warm-modules M is passed to `ballast launch`.

Prints a progress line per trial and a table at the end; --json FILE
writes every trial's record. Not a test: the numbers go into the README.
The machine's cores are shared by every rank, agent and warm interpreter:
run nothing else meanwhile.

usage: recovery_matrix.py [--ballast build/bin/ballast] [--torch 1.13,2] [--python2 PATH]
           [--nodes 1,2,3] [--nproc 2] [--ckpt none,flash,replicas]
           [--fault kill-worker,node-loss,hang,early-kill] [--peers torchrun,dlrover] [--trials 1]
           [--hang-timeout 3] [--early-kill-at 3] [--second-kill-after 2] [--json FILE]
e.g.   recovery_matrix.py --torch 1.13 --nodes 2 --ckpt none,replicas --fault node-loss --peers torchrun
       recovery_matrix.py --torch 2 --nodes 1 --ckpt none --fault early-kill --peers torchrun --trials 5
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRAIN = os.path.join(HERE, "matrix_train.py")
PY113 = "/usr/bin/python3"
KILL_STEP = 40
STEP_TIME = 0.05
PERSIST_EVERY = 10
CKPTS = ("none", "flash", "replicas")
FAULTS = ("kill-worker", "node-loss", "hang", "early-kill")
PEERS = ("torchrun", "dlrover")
sys.path.insert(0, os.path.join(ROOT, "examples"))
from train_events import read_events  # noqa: E402  (the format matrix_train.py writes)
from _benchutil import free_port, patch_torch113_std  # noqa: E402


def torchrun_113():
    """`recovery_matrix.py _torchrun ARGS`: torch 1.13's torchrun with
    Std.from_str fixed for Python 3.11 (as in dlrover_baseline.py)."""
    patch_torch113_std()
    from torch.distributed.run import main
    main(sys.argv[2:])


# -- processes -----------------------------------------------------------------


def proc_table():
    """{pid: (ppid, argv)} of every process now."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = [x.decode(errors="replace") for x in f.read().split(b"\0") if x]
        except OSError:
            continue
        out[int(d)] = (int(stat.rsplit(")", 1)[1].split()[1]), argv)
    return out


def descendants(pid, table=None):
    """pid's descendants (not pid), parents before children."""
    table = table or proc_table()
    children = {}
    for p, (pp, _) in table.items():
        children.setdefault(pp, []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(pid, sig=signal.SIGKILL):
    """Signals pid and every process under it (a snapshot first: all at once)."""
    for p in [pid] + descendants(pid):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def shm_of_agent(pid):
    """The shared memory objects a Ballast agent of this pid created."""
    return [p for p in glob.glob("/dev/shm/ballast-*")
            if re.fullmatch(rf"ballast-[0-9a-f]{{8}}-{pid}-.*|ballast-progress-{pid}", os.path.basename(p))]


class Job:
    """The processes of one trial, each in a session of its own."""

    def __init__(self, out):
        self.out = out
        self.procs = []  # (label, Popen)
        self.extra = []  # processes that are not agents (DLRover's master)

    def start(self, label, argv, env, extra=False):
        log = open(os.path.join(self.out, f"{label}.log"), "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT)
        log.close()
        (self.extra if extra else self.procs).append((label, p))
        return p

    def alive(self):
        return [p for _, p in self.procs if p.poll() is None]

    def exits(self):
        """The agents' exit statuses and the last line they logged, for an error message."""
        text = ", ".join(f"{label} exit {p.returncode}" for label, p in self.procs if p.returncode is not None)
        last = [line for line in self.log_text().splitlines() if line.strip()]
        return text + (f"; last log line: {last[-1].strip()[:300]}" if last else "; no output")

    def log_text(self):
        text = []
        for label, _ in self.procs + self.extra:
            try:
                with open(os.path.join(self.out, f"{label}.log"), errors="replace") as f:
                    text.append(f.read())
            except OSError:
                pass
        return "\n".join(text)

    def stop(self, grace):
        """Waits up to grace s for the agents to end, then SIGTERM, then SIGKILL their trees."""
        deadline = time.time() + grace
        while self.alive() and time.time() < deadline:
            time.sleep(0.1)
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            left = [p for _, p in self.procs + self.extra if p.poll() is None]
            if not left:
                break
            for p in left:  # SIGTERM: the launcher or agent stops its own; SIGKILL: every process under it
                kill_tree(p.pid) if sig == signal.SIGKILL else os.kill(p.pid, sig)
            deadline = time.time() + wait
            while any(p.poll() is None for p in left) and time.time() < deadline:
                time.sleep(0.1)
        for _, p in self.procs + self.extra:
            if p.poll() is None:
                kill_tree(p.pid)
            p.wait()


# -- the systems -------------------------------------------------------------------

def clean_env(extra_path=None):
    """This environment without build/python on PYTHONPATH (peers run without ballast)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and os.path.abspath(p) != os.path.join(ROOT, "build", "python")]
    if extra_path:
        path.insert(0, extra_path)
    env["PYTHONPATH"] = os.pathsep.join(path)
    if not env["PYTHONPATH"]:
        del env["PYTHONPATH"]
    return env


def script_args(out, ckpt_kind, hang_pg_timeout):
    args = [TRAIN, "--out", out, "--step-time", str(STEP_TIME), "--persist-every", str(PERSIST_EVERY),
            "--ckpt", ckpt_kind]
    if ckpt_kind != "none":
        args += ["--ckpt-dir", os.path.join(out, "ckpt")]
    if hang_pg_timeout is not None:
        args += ["--pg-timeout", str(hang_pg_timeout)]
    return args


class Ballast:
    name = "ballast"

    def __init__(self, a, torch):
        self.a, self.torch = a, torch

    def start(self, job, nodes, ckpt, fault):
        a = self.a
        argv = [a.ballast, "launch", "--nodes", str(nodes), "--nproc-per-node", str(a.nproc),
                "--python", self.torch["python"], "--max-restarts", "3"]
        if ckpt != "none":
            argv += ["--ckpt-replicas", "1" if ckpt == "replicas" else "0"]
        if fault == "hang":
            argv += ["--hang-timeout", str(a.hang_timeout)]
        if a.warm_modules:
            argv += ["--warm-modules", a.warm_modules]
        if a.spares:
            argv += ["--spares", str(a.spares)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        job.start("launch", argv + script_args(job.out, "none" if ckpt == "none" else "ballast", None), env)

    def agents(self, job):
        """{node rank: pid} of the `ballast run` agents now under the launcher."""
        table = proc_table()
        found = {}
        for p in descendants(job.procs[0][1].pid, table):
            argv = table[p][1]
            if len(argv) > 1 and argv[1] == "run" and "--node-rank" in argv:
                found[int(argv[argv.index("--node-rank") + 1])] = p
        return found

    def lose_node(self, job, world):
        """Loses the last node (its workers hold the highest global ranks):
        its agent and everything under it SIGKILLed, its shared memory
        removed. (time of the kill, the ranks lost)."""
        node_rank = world // self.a.nproc - 1
        pid = self.agents(job).get(node_rank)
        if pid is None:
            raise RuntimeError(f"no `ballast run` agent of node rank {node_rank} under the launcher")
        lost = sorted(r for r in range(world)
                      if [e for e in read_events(job.out, r) if e["event"] == "start"][-1]["group_rank"] == node_rank)
        t = time.time()
        kill_tree(pid)
        for path in shm_of_agent(pid):  # the host's memory goes with it
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return t, lost


class Torchrun:
    name = "torchrun"

    def __init__(self, a, torch):
        self.a, self.torch = a, torch
        if torch["name"] == "1.13":
            self.cmd = [torch["python"], os.path.abspath(__file__), "_torchrun"]
        else:
            self.cmd = [os.path.join(os.path.dirname(torch["python"]), "torchrun")]

    def available(self):
        if not os.access(self.cmd[0], os.X_OK):
            return f"no {self.cmd[0]}"
        return None

    def start(self, job, nodes, ckpt, fault):
        self.nodes, self.port, self.run_id = nodes, free_port(), uuid.uuid4().hex[:12]
        self.script = script_args(job.out, "none" if ckpt == "none" else "torch",
                                  self.a.hang_timeout if fault == "hang" else None)
        self.incarnation = {}
        for r in range(nodes):
            self.start_node(job, r)

    def node_argv(self, r):
        return self.cmd + ["--nnodes", str(self.nodes), "--nproc_per_node", str(self.a.nproc),
                           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{self.port}",
                           "--rdzv_id", self.run_id, "--rdzv_conf", f"is_host={1 if r == 0 else 0},timeout=120",
                           "--max_restarts", "3", "--monitor_interval", "0.1"] + self.script

    def node_env(self, r):
        return clean_env()

    def start_node(self, job, r):
        k = self.incarnation[r] = self.incarnation.get(r, 0) + 1
        return job.start(f"node{r}-{k}", self.node_argv(r), self.node_env(r))

    def agents(self, job):
        return {}

    def lose_node(self, job, world):
        """Loses the node whose workers hold the highest global rank, but not
        torchrun's rendezvous host (node 0's agent holds the c10d store, as
        Ballast's master is not on a node that is lost); starts its
        replacement at once. (time of the kill, the ranks lost)."""
        table = proc_table()
        agents = {p.pid: r for r, p in self.current(job).items()}
        ranks = {}  # node r -> global ranks of its workers
        for rank in range(world):
            pid = [e for e in read_events(job.out, rank) if e["event"] == "start"][-1]["pid"]
            while pid in table and pid not in agents:
                pid = table[pid][0]
            if pid in agents:
                ranks.setdefault(agents[pid], []).append(rank)
        hosts = {0} if self.nodes > 1 and self.name == "torchrun" else set()
        choices = {r: max(v) for r, v in ranks.items() if r not in hosts}
        if not choices:
            raise RuntimeError(f"no node to lose: the workers' agents are {ranks}")
        victim = max(choices, key=choices.get)
        proc = self.current(job)[victim]
        t = time.time()
        kill_tree(proc.pid)
        proc.wait()
        self.start_node(job, victim)  # the replacement, at once
        return t, sorted(ranks[victim])

    def current(self, job):
        """{node r: Popen} of each node's newest agent."""
        procs = dict(job.procs)
        return {r: procs[f"node{r}-{k}"] for r, k in self.incarnation.items()}


class Dlrover(Torchrun):
    name = "dlrover"

    def __init__(self, a, torch, install):
        self.a, self.torch, self.install = a, torch, install
        self.cmd = [torch["python"], os.path.join(HERE, "dlrover_baseline.py")]

    def available(self):
        if self.install is None:
            return "not installed (no ~/.cache/ballast/dlrover-*; see bench/setup_dlrover.sh)"
        check = "import dlrover.trainer.torch.elastic_run, dlrover.python.master.local_master"
        r = subprocess.run([self.torch["python"], "-c", check], env=clean_env(self.install),
                           capture_output=True, text=True)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            return f"{self.install} does not import on torch {self.torch['version']} ({last})"
        return None

    def start(self, job, nodes, ckpt, fault):
        self.job_name = f"matrix-{uuid.uuid4().hex[:8]}"
        self.master_port = free_port()
        if nodes > 1:  # its local job master, for the agents of every node
            job.start("dlrover-master", [self.torch["python"], "-u", "-m", "dlrover.python.master.main", "--port",
                                         str(self.master_port), "--node_num", str(nodes), "--job_name",
                                         self.job_name, "--platform", "local"], clean_env(self.install), extra=True)
        super().start(job, nodes, ckpt, fault)

    def node_argv(self, r):
        common = ["--nproc_per_node", str(self.a.nproc), "--max_restarts", "3", "--monitor_interval", "0.1"]
        if self.nodes == 1:
            return self.cmd + ["--standalone"] + common + self.script
        return self.cmd + ["--nnodes", str(self.nodes)] + common + self.script

    def node_env(self, r):
        env = clean_env(self.install)
        env.update(JOB_NAME=self.job_name, NODE_RANK=str(r), NODE_ID=str(r))
        if self.nodes > 1:
            env["DLROVER_MASTER_ADDR"] = f"127.0.0.1:{self.master_port}"
        return env


def dlrover_install(opt):
    if opt == "":
        return None
    if opt is not None:
        return opt
    found = sorted(glob.glob(os.path.expanduser("~/.cache/ballast/dlrover-*/dlrover")),
                   key=lambda d: [int(n) for n in re.findall(r"\d+", os.path.basename(os.path.dirname(d)))])
    return os.path.dirname(found[-1]) if found else None


# -- one trial ---------------------------------------------------------------------

TIMELINE = re.compile(r"(?:recovery|start) timeline \(round (\d+), (.*?) start\): (.*?) node=(\S+) round=(\d+)")
WARM_READY = re.compile(r"warm interpreters ready for the next \(re\)start .*?node=(\S+) round=(\d+)")


def latest_steps(out, world):
    """Each rank's newest step (0 before its first)."""
    return [max([e["step"] for e in read_events(out, r) if e["event"] == "step"] or [0]) for r in range(world)]


def start_kind(summary):
    """('warm'|'cold'|'mixed', why) of a timeline's start summary."""
    if summary.startswith("warm"):
        return "warm", ""
    m = re.match(r"(cold|\d+ warm, \d+ cold)(?: \((.*)\))?$", summary)
    if not m:
        return "?", summary
    kind = "cold" if m.group(1) == "cold" else "mixed"
    return kind, m.group(2) or "warm restart off"


def recovered(out, world, t0):
    """{rank: (start event, first step event)} of the ranks whose process
    started after t0 and completed a step."""
    got = {}
    for r in range(world):
        starts = {}
        for e in read_events(out, r):
            if e["event"] == "start" and e["t"] > t0:
                starts[e["pid"]] = e
            elif e["event"] == "step" and e["pid"] in starts and e["t"] > t0:
                got[r] = (starts[e["pid"]], e)
                break
    return got


def trial(system, a, nodes, ckpt, fault):
    """One job with one fault. The record of what happened (see the docstring)."""
    world = nodes * a.nproc
    out = tempfile.mkdtemp(prefix="ballast-matrix-")
    job = Job(out)
    rec = {"system": system.name, "nodes": nodes, "nproc": a.nproc, "ckpt": ckpt, "fault": fault, "out": out}
    agent_pids = set()
    try:
        return run_trial(system, a, nodes, ckpt, fault, world, out, job, rec, agent_pids)
    except RuntimeError as e:
        raise RuntimeError(f"{e} (see {out})") from None
    finally:
        job.stop(grace=0)
        for pid in agent_pids:  # an agent unlinks its own; SIGKILLed ones (and leaks) are removed here
            left = shm_of_agent(pid)
            if left:
                rec.setdefault("leftover_shm", []).extend(os.path.basename(x) for x in left)
            for path in left:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if rec.get("outcome") == "ok" and not a.keep:
            shutil.rmtree(out, ignore_errors=True)
            rec["out"] = None


def run_trial(system, a, nodes, ckpt, fault, world, out, job, rec, agent_pids):
    """trial()'s body: start, fault, recovery, stop."""
    system.start(job, nodes, ckpt, fault)
    t_start = time.time()
    deadline = t_start + a.start_timeout
    steps_ready_t = None
    scanned = [0.0]

    def scan_agents():  # the agents' pids, for the shared memory check at the end (twice a second)
        if time.time() - scanned[0] > 0.5:
            agent_pids.update(system.agents(job).values())
            scanned[0] = time.time()

    early = fault == "early-kill"
    while True:  # until every rank passed KILL_STEP and (Ballast) every node's warm interpreters are ready
        if time.time() > deadline:
            raise RuntimeError(f"no step {1 if early else KILL_STEP} on every rank within {a.start_timeout:.0f} s")
        if not job.alive():
            raise RuntimeError(f"the job exited before the fault ({job.exits()})")
        scan_agents()
        if early:  # a fixed time after the job's first step, whatever is ready by then
            firsts = first_step_times(out, world)
            if firsts is not None:
                rec["first_step_after_launch_s"] = max(firsts) - t_start
                t_kill = max(firsts) + a.early_kill_at
                while time.time() < t_kill and job.alive():
                    scan_agents()
                    time.sleep(0.01)
                break
        elif min(latest_steps(out, world)) >= KILL_STEP:
            steps_ready_t = steps_ready_t or time.time()
            if system.name != "ballast":
                break
            ready = {m.group(1) for m in WARM_READY.finditer(job.log_text())}
            if len(ready) >= nodes + a.spares:  # the spares' interpreters too
                rec["warm_ready"] = True
                break
            if time.time() - steps_ready_t > a.warm_wait:
                rec["warm_ready"] = False  # the fault comes anyway; the starts will say cold
                break
        time.sleep(0.05)
    rec["startup_s"] = time.time() - t_start
    before = latest_steps(out, world)
    rec["step_at_fault"] = max(before)
    victim = world - 1
    if early:
        rec["kill_after_first_step_s"] = time.time() - max(firsts)
    if fault in ("kill-worker", "early-kill"):
        pid = [e for e in read_events(out, victim) if e["event"] == "start"][-1]["pid"]
        t_fault = time.time()
        os.kill(pid, signal.SIGKILL)
    elif fault == "node-loss":
        t_fault, rec["lost_ranks"] = system.lose_node(job, world)
    else:
        with open(os.path.join(out, "hang.tmp"), "w") as f:
            f.write(str(victim))
        os.replace(os.path.join(out, "hang.tmp"), os.path.join(out, "hang"))
        t_fault = None
        hang_deadline = time.time() + 30
        while t_fault is None:
            hangs = [e for e in read_events(out, victim) if e["event"] == "hang"]
            if hangs:
                t_fault = hangs[0]["t"]
            elif time.time() > hang_deadline:
                raise RuntimeError(f"rank {victim} did not hang within 30 s of being told to")
            time.sleep(0.02)
    outcome, got = await_recovery(job, out, world, t_fault, a, scan_agents, rec)
    if fault == "hang":
        rec["threshold_s"] = a.hang_timeout  # included in recovery_s (detection or collective timeout)
    second = None
    if early and outcome == "ok":
        # A flapping worker: killed again a fixed time after the world came
        # back (every rank's first step), whatever the next start has ready.
        t_kill = max(e["t"] for _, e in got.values()) + a.second_kill_after
        while time.time() < t_kill and job.alive():
            scan_agents()
            time.sleep(0.01)
        second = {"step_at_fault": max(latest_steps(out, world))}
        pid = [e for e in read_events(out, victim) if e["event"] == "start"][-1]["pid"]
        t_fault2 = time.time()
        os.kill(pid, signal.SIGKILL)
        second["kill_after_recovery_s"] = t_fault2 - (t_kill - a.second_kill_after)
        _, got2 = await_recovery(job, out, world, t_fault2, a, scan_agents, second)
        rec["second"] = second
    # Stop the job cleanly: every rank ends at the same step.
    with open(os.path.join(out, "stop.tmp"), "w") as f:
        f.write(str(max(latest_steps(out, world)) + 10))
    os.replace(os.path.join(out, "stop.tmp"), os.path.join(out, "stop"))
    job.stop(grace=30 if outcome == "ok" else 1)
    rec["exit"] = [p.returncode for _, p in job.procs]
    if system.name == "ballast":
        log = job.log_text()
        starts_of(rec, log, got)
        if second is not None:
            starts_of(second, log, got2)
        rec["taken"] = taken_of(log)
    return rec


def await_recovery(job, out, world, t_fault, a, scan_agents, rec):
    """Waits until every rank of the world completed a step in a process
    started after t_fault; fills rec (outcome, recovery_s, resumed, ...).
    (outcome, {rank: (start event, first step event)})."""
    deadline = time.time() + a.recovery_timeout
    outcome = None
    while outcome is None:
        scan_agents()
        got = recovered(out, world, t_fault)
        if len(got) == world:
            outcome = "ok"
        elif not job.alive():
            outcome = "failed"
            time.sleep(0.2)
            got = recovered(out, world, t_fault)
        elif time.time() > deadline:
            outcome = "hung"
        else:
            time.sleep(0.05)
    rec["outcome"] = outcome
    rec["ranks_back"] = len(got)
    if got:
        rec["restarted_s"] = max(s["t"] for s, _ in got.values()) - t_fault
    if outcome == "ok":
        rec["recovery_s"] = max(e["t"] for _, e in got.values()) - t_fault
    rec["resumed"] = {r: {"source": s["source"], "step": s["step"], "round": s.get("round"), "node": s.get("node"),
                          "group_rank": s.get("group_rank"), "load_s": s.get("load_s")}
                      for r, (s, _) in sorted(got.items())}
    if got:
        rec["lost_steps"] = rec["step_at_fault"] - min(s["step"] for s, _ in got.values())
    return outcome, got


def first_step_times(out, world):
    """Each rank's time of its first step in the job, or None before every rank made one."""
    times = []
    for r in range(world):
        t = next((e["t"] for e in read_events(out, r) if e["event"] == "step"), None)
        if t is None:
            return None
        times.append(t)
    return times


TAKEN = re.compile(r"warm interpreters taken: (.*?) node=(\S+) round=(\d+)")


def taken_of(log):
    """What each node's warm interpreters had imported when a start took them
    (the agents' "warm interpreters taken" lines): [{node, round, ranks}]."""
    return [{"node": m.group(2), "round": int(m.group(3)), "ranks": m.group(1)} for m in TAKEN.finditer(log)]


def starts_of(rec, log, got):
    """rec["starts"]: the kind of start each node of the recovery round had."""
    nodes = {}  # node id -> (node rank, round) of the restarted workers
    for s, _ in got.values():
        nodes[s["node"]] = (s["group_rank"], s["round"])
    lines = {(m.group(4), int(m.group(5))): (m.group(2), m.group(3)) for m in TIMELINE.finditer(log)}
    lost = set(rec.get("lost_ranks", ()))
    replacements = {s["node"] for r, (s, _) in got.items() if r in lost}
    starts = []
    for node_id, (node_rank, rnd) in sorted(nodes.items(), key=lambda x: x[1][0]):
        summary, timeline = lines.get((node_id, rnd), (None, None))
        kind, why = start_kind(summary) if summary is not None else ("?", "no timeline line for this node and round")
        starts.append({"node_rank": node_rank, "node": node_id, "round": rnd, "kind": kind, "why": why,
                       "replacement": node_id in replacements, "summary": summary, "timeline": timeline})
    rec["starts"] = starts


# -- the matrix ----------------------------------------------------------------------

def resolve_torch(name, a):
    if name == "1.13":
        py = PY113
    elif name == "2":
        py = a.python2
        if not py:
            r = subprocess.run([os.path.join(ROOT, "scripts", "torch2-venv.sh")], stdout=subprocess.PIPE, text=True)
            if r.returncode != 0:
                return None, f"scripts/torch2-venv.sh failed (exit {r.returncode})"
            py = r.stdout.strip().splitlines()[-1]
    else:
        return None, f"unknown torch '{name}' (1.13 or 2)"
    r = subprocess.run([py, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"{py} does not import torch: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    version = r.stdout.strip()
    if not version.startswith("1.13" if name == "1.13" else "2."):
        return None, f"{py} has torch {version}, not {name}"
    return {"name": name, "python": py, "version": version}, None


def summarize(trials):
    """(median recovery s or None, 'ok'|'failed'|'hung'|'mixed', text)."""
    oks = [t["recovery_s"] for t in trials if t.get("outcome") == "ok"]
    bad = [t.get("outcome", "error") for t in trials if t.get("outcome") != "ok"]
    if not bad:
        med = statistics.median(oks)
        return med, "ok", f"{med:.2f}"
    if not oks:
        return None, bad[0], bad[0] if len(set(bad)) == 1 else "/".join(sorted(set(bad)))
    return statistics.median(oks), "mixed", f"{statistics.median(oks):.2f} ({len(bad)}/{len(trials)} {bad[0]})"


def starts_text(trials):
    """Each node's kind of start in the first successful trial ('*' marks a
    replacement node; the kinds of all trials are in the JSON)."""
    for t in trials:
        if t.get("starts"):
            parts = []
            for s in t["starts"]:
                star = "*" if s.get("replacement") else ""
                parts.append(f"n{s['node_rank']}{star} {s['kind']}" + (f" ({s['why']})" if s["why"] else ""))
            return ", ".join(parts)
    return "-"


def source_text(trials):
    for t in trials:
        if t.get("resumed"):
            groups = {}
            for r, v in t["resumed"].items():
                groups.setdefault(f"{v['source']}@{v['step']}", []).append(int(r))
            lost = t.get("lost_steps")
            text = " ".join(k if len(groups) == 1 else f"{k}(r{','.join(map(str, rs))})" for k, rs in groups.items())
            return text + (f", lost {lost}" if lost is not None else "")
    return "-"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_torchrun":
        return torchrun_113()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ballast", default=os.path.join(ROOT, "build", "bin", "ballast"))
    p.add_argument("--torch", default="1.13,2", help="1.13 (/usr/bin/python3) and/or 2 (the venv of "
                                                     "scripts/torch2-venv.sh, or --python2)")
    p.add_argument("--python2", default=None, help="python of a torch 2.x environment")
    p.add_argument("--nodes", default="1,2,3")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--ckpt", default=",".join(CKPTS))
    p.add_argument("--fault", default=",".join(FAULTS))
    p.add_argument("--peers", default=",".join(PEERS), help="torchrun,dlrover; '' for none")
    p.add_argument("--dlrover", default=None, help="DLRover install dir (default: newest ~/.cache/ballast/dlrover-*)")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--hang-timeout", type=float, default=3.0,
                   help="Ballast's --hang-timeout and the peers' gloo collective timeout in the hang cells")
    p.add_argument("--early-kill-at", type=float, default=3.0,
                   help="early-kill cells: s after the job's first step (every rank's) to the first kill")
    p.add_argument("--second-kill-after", type=float, default=2.0,
                   help="early-kill cells: s after the first recovery (every rank's first step) to the second kill")
    p.add_argument("--warm-modules", default="", help="passed to `ballast launch --warm-modules`")
    p.add_argument("--spares", type=int, default=0,
                   help="Ballast's hot spares (`ballast launch --spares`; NxP+Ks in the table); the peers have none")
    p.add_argument("--start-timeout", type=float, default=240.0, help="s from launch to step 40 on every rank")
    p.add_argument("--warm-wait", type=float, default=60.0,
                   help="s past step 40 to wait for every node's warm interpreters before the fault anyway")
    p.add_argument("--recovery-timeout", type=float, default=120.0, help="no step this long after the fault: hung")
    p.add_argument("--keep", action="store_true", help="keep every trial's directory (default: failed ones only)")
    p.add_argument("--json", default=None)
    a = p.parse_args()

    def listed(value, allowed, what):
        items = [x.strip() for x in value.split(",") if x.strip()]
        bad = [x for x in items if allowed is not None and x not in allowed]
        if bad:
            p.error(f"--{what}: unknown {', '.join(bad)} (choose from {', '.join(allowed)})")
        return items

    ckpts, faults = listed(a.ckpt, CKPTS, "ckpt"), listed(a.fault, FAULTS, "fault")
    peers = listed(a.peers, PEERS, "peers")
    try:
        node_counts = [int(x) for x in listed(a.nodes, None, "nodes")]
    except ValueError:
        p.error("--nodes: a list of node counts, e.g. 1,2,3")
    if not os.access(a.ballast, os.X_OK):
        sys.exit(f"recovery_matrix: no ballast binary at {a.ballast} (build it: make)")
    torches = []
    for name in listed(a.torch, ("1.13", "2"), "torch"):
        t, why = resolve_torch(name, a)
        if t is None:
            print(f"torch {name}: skipped: {why}", flush=True)
        else:
            torches.append(t)
    if not torches:
        sys.exit("recovery_matrix: no torch to run")
    install = dlrover_install(a.dlrover)

    cells = []
    peer_cache = {}
    n_cells = len(torches) * len(node_counts) * len(faults) * len(ckpts)
    i = 0
    for t in torches:
        systems = {"ballast": Ballast(a, t)}
        peer_na = {}
        for name in peers:
            s = Torchrun(a, t) if name == "torchrun" else Dlrover(a, t, install)
            why = s.available()
            if why is None:
                systems[name] = s
            else:
                peer_na[name] = why
                print(f"torch {t['name']}: {name}: n/a: {why}", flush=True)
        for nodes in node_counts:
            for fault in faults:
                for ckpt in ckpts:
                    i += 1
                    cell = {"torch": t["name"], "torch_version": t["version"], "nodes": nodes, "nproc": a.nproc,
                            "spares": a.spares, "ckpt": ckpt, "fault": fault, "peers": {}}
                    if fault == "early-kill":
                        cell["early"] = {"at": a.early_kill_at, "again": a.second_kill_after}
                    label = f"[{i}/{n_cells}] torch {t['name']} {nodes}x{a.nproc} {ckpt} {fault}"
                    for name, system in systems.items():
                        peer_ckpt = "none" if ckpt == "none" else "torch.save"
                        key = (t["name"], nodes, fault, peer_ckpt, name)
                        if name != "ballast" and key in peer_cache:
                            cell["peers"][name] = peer_cache[key]
                            continue
                        trials = []
                        for k in range(a.trials):
                            try:
                                r = trial(system, a, nodes, ckpt, fault)
                            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                                r = {"system": name, "outcome": "error", "error": str(e)}
                            r["trial"] = k + 1
                            trials.append(r)
                            what = (f"{r['recovery_s']:.2f} s" if r.get("outcome") == "ok" else
                                    r.get("outcome", "error") + (f": {r['error']}" if r.get("error") else ""))
                            if "second" in r:
                                r2 = r["second"]
                                what += (f", again {r2['recovery_s']:.2f} s" if r2.get("outcome") == "ok" else
                                         f", again {r2.get('outcome', 'error')}")
                            extra = ""
                            if name == "ballast" and r.get("outcome") in ("ok", "failed", "hung"):
                                extra = f"  starts: {starts_text([r])}  state: {source_text([r])}"
                                if "second" in r:
                                    extra += f"  again: {starts_text([r['second']])}"
                                for tk in r.get("taken", []):
                                    extra += f"\n    round {tk['round']} {tk['node']} took: {tk['ranks']}"
                            if r.get("leftover_shm"):
                                extra += f"  LEFTOVER /dev/shm (removed): {' '.join(r['leftover_shm'])}"
                            if r.get("out"):
                                extra += f"  (kept {r['out']})"
                            print(f"{label}: {name} trial {k + 1}/{a.trials}: {what}{extra}", flush=True)
                        med, outcome, text = summarize(trials)
                        entry = {"median_s": med, "outcome": outcome, "text": text, "trials": trials}
                        if fault == "early-kill":  # the second kill's recovery beside the first's
                            seconds = [t["second"] for t in trials if "second" in t]
                            med2, outcome2, text2 = summarize(seconds) if seconds else (None, "n/a", "-")
                            entry.update(second_median_s=med2, second_outcome=outcome2,
                                         text=f"{text} then {text2}")
                        if name == "ballast":
                            cell["ballast"] = entry
                        else:
                            entry["ckpt"] = peer_ckpt
                            peer_cache[key] = cell["peers"][name] = entry
                    for name, why in peer_na.items():
                        cell["peers"][name] = {"median_s": None, "outcome": "n/a", "text": "n/a", "why": why}
                    cells.append(cell)
    assess(cells)
    print_table(cells)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(a).items()}, "kill_step": KILL_STEP, "step_time": STEP_TIME,
                       "persist_every": PERSIST_EVERY, "cells": cells}, f, indent=2)
        print(f"wrote {a.json}", flush=True)
    return 0


def assess(cells):
    """cell["targets"]: warm, vs the best peer, vs the no-checkpoint cell."""
    none_cell = {(c["torch"], c["nodes"], c["fault"]): c for c in cells if c["ckpt"] == "none"}
    for c in cells:
        b = c["ballast"]
        tg = {}
        starts = [s for t in b["trials"] for s in t.get("starts", []) + t.get("second", {}).get("starts", [])]
        tg["warm"] = bool(starts) and all(s["kind"] == "warm" for s in starts) and b["outcome"] == "ok"
        # early-kill: the second kill's recovery within 1.2x of the first's.
        tg["again"], tg["again_met"] = None, None
        if c["fault"] == "early-kill":
            if b["outcome"] != "ok" or b.get("second_outcome") != "ok":
                tg["again_met"] = False
            else:
                tg["again"] = b["second_median_s"] / b["median_s"]
                tg["again_met"] = tg["again"] <= 1.2
        measured = {n: e for n, e in c["peers"].items() if e["outcome"] != "n/a"}
        ok_peers = {n: e["median_s"] for n, e in measured.items() if e["outcome"] in ("ok", "mixed")}
        if not measured or b["outcome"] != "ok":
            tg["vs_best_peer"] = None
            tg["best_peer"] = None
            tg["peer_met"] = None if not measured else False
        elif ok_peers:
            best = min(ok_peers, key=ok_peers.get)
            tg["best_peer"] = best
            tg["vs_best_peer"] = b["median_s"] / ok_peers[best]
            tg["peer_met"] = tg["vs_best_peer"] <= 0.5
        else:  # every peer failed or hung: beaten
            tg["best_peer"], tg["vs_best_peer"], tg["peer_met"] = None, None, True
        base = none_cell.get((c["torch"], c["nodes"], c["fault"]))
        tg["vs_no_ckpt"], tg["ckpt_met"] = None, None
        if c["ckpt"] != "none":
            if b["outcome"] != "ok":
                tg["ckpt_met"] = False
            elif base is not None and base["ballast"]["outcome"] == "ok":
                tg["vs_no_ckpt"] = b["median_s"] / base["ballast"]["median_s"]
                tg["ckpt_met"] = tg["vs_no_ckpt"] <= 1.2
        c["targets"] = tg


def print_table(cells):
    peers = [n for n in PEERS if any(n in c["peers"] for c in cells)]
    head = ["torch", "NxP", "ckpt", "fault", "ballast s", "starts (* replacement)", "state from"] + \
           [f"{n} s" for n in peers] + ["x best peer", "x no-ckpt", "targets"]
    rows = []
    for c in cells:
        tg = c["targets"]
        mark = lambda v: "-" if v is None else ("ok" if v else "MISSED")  # noqa: E731
        targets = f"warm {mark(tg['warm'])}, peer {mark(tg['peer_met'])}, ckpt {mark(tg['ckpt_met'])}"
        if c["fault"] == "early-kill":
            again = "-" if tg["again"] is None else f"{tg['again']:.2f}x "
            targets += f", again {again}{mark(tg['again_met'])}"
        nxp = f"{c['nodes']}x{c['nproc']}" + (f"+{c['spares']}s" if c.get("spares") else "")
        rows.append([c["torch_version"], nxp, c["ckpt"], c["fault"], c["ballast"]["text"],
                     starts_text(c["ballast"]["trials"]), source_text(c["ballast"]["trials"])] +
                    [c["peers"].get(n, {}).get("text", "-") for n in peers] +
                    ["-" if tg["vs_best_peer"] is None else f"{tg['vs_best_peer']:.2f} ({tg['best_peer']})",
                     "-" if tg["vs_no_ckpt"] is None else f"{tg['vs_no_ckpt']:.2f}", targets])
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")
    note = (f"\nkill -> first step that every rank completed, seconds (median); the fault at step >= {KILL_STEP}, "
            f"{STEP_TIME} s a step; the peers checkpoint with torch.save every step in the flash and replicas rows")
    if any(c["fault"] == "early-kill" for c in cells):
        e = next(c["early"] for c in cells if c["fault"] == "early-kill")
        note += (f"; early-kill rows: a worker killed {e['at']:g} s after the job's first step, and again "
                 f"{e['again']:g} s after the world came back (first recovery then second; 'again' is "
                 "second / first, target <= 1.2; the peer target compares the first)")
    thresholds = {t["threshold_s"] for c in cells for t in c["ballast"]["trials"] if "threshold_s" in t}
    if thresholds:
        note += (f"; hang rows count from the hang, so they include the {'/'.join(map(str, sorted(thresholds)))} s "
                 "threshold (Ballast's --hang-timeout, the peers' collective timeout)")
    print(note, flush=True)


if __name__ == "__main__":
    sys.exit(main())
