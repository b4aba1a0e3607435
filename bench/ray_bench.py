"""Ballast (`ballast ray run`) against Ray Train's TorchTrainer (and, with --systems dlrover, DLRover 0.6.1's Ray mode)
on the same real Ray cluster.

What it measures. One small DDP job (gloo, CPU): an MLP Linear(16,64)-Tanh-Linear(64,1) on
synthetic regression data, SGD, 4 ranks, --steps steps (default 60) of ~0.15 s each (a
time.sleep stands in for compute), with a checkpoint after every step, run by
  - Ballast: `ballast ray run --nodes 2 --nproc-per-node 2` (one agent actor per Ray node),
    the script (this file, --worker-ballast) flash-saving every step with ballast.Checkpointer
    and reporting ballast.step(step);
  - Ray Train: ray.train.torch.TorchTrainer, 4 workers of 0.5 CPU (they pack 2 to a node),
    FailureConfig(max_failures=3), DDP through prepare_model, a checkpoint reported from rank 0
    with ray.train.report every step (and, as a third row, every 10 steps), resumed from
    ray.train.get_checkpoint();
  - DLRover (only when --systems names it): DLRover 0.6.1's Ray mode, its experimental "unified" API
    (dlrover.python.unified: DLJobBuilder().train(...).nnodes(2).nproc_per_node(2).resource(cpu=0.5),
    device_type CPU, submitted from a Python driver, --driver-dlrover). It creates a detached PrimeMaster
    actor (pinned to the head here through JobConfig.master_isolation_schedule_resource), an
    ElasticMaster sub-master and one ElasticWorker actor per rank in a placement group of two 1-CPU
    bundles; each worker sets up the gloo process group and runs this file (--worker-dlrover) in a
    thread (runpy). Its fault tolerance as configured by default: Ray restarts a dead actor
    (max_restarts=-1, a lost node's bundle is rescheduled onto a free node), and any rank ending with
    FAIL (here: the survivors' gloo error) makes the PrimeMaster restart the job: every worker actor
    and the ElasticMaster killed and restarted, its node check (two rounds of matmul + allreduce;
    --dlrover-skip-node-check skips it), the process group set up again, the script started again.
    The checkpoint every step: DLRover's flash checkpoint (DdpCheckpointer, storage_type DISK; its
    engine forks its own saver process since no dlrover-run agent hosts one) or, with
    --dlrover-ckpt torch, torch.save from rank 0. Install it with bench/setup_dlrover_ray.sh
    (~/.cache/ballast/dlrover-ray-0.6.1, on PYTHONPATH only for this system's driver and actors).
    What DLRover 0.6.1 does that shows in its rows: a job that restarted once restarts again when it
    finishes (the PrimeMaster keeps the earlier FAIL result of the restarted rank: PrimeManager
    never clears DLExecutionVertex.result, so has_any_failure() stays true), which adds a
    restart to its wall time and can leave its ElasticMaster actor behind (the bench kills it and
    prints "actors left"); and its flash checkpoint's restarted saver sometimes never answers
    (ConnectionRefusedError from DdpCheckpointer() after 30 retries), which fails that incarnation
    and costs one more job restart.
and one fault per run at step 15:
  - node:   the Ray node hosting node rank 1 (Ballast) / world rank 1 (Ray Train, DLRover) is removed
            without grace (cluster.remove_node(allow_graceful=False): its raylet and every
            process on it killed); a fresh Ray node is added 2 s later;
  - pod:    the same Ray node loses every process at once, as when its pod or container is
            deleted: its raylet and every process under it (the agent actor, the agent, the
            ranks) SIGKILLed together, then the node removed; a fresh node 2 s later
            (not in the default --faults);
  - worker: the process of rank 1 is SIGKILLed (Ballast: --chaos kill-worker:rank=1,at_step=15,
            the fault time is when the bench sees that process die; Ray Train: the bench
            kills rank 1's worker actor process itself when rank 1 has logged step 15; DLRover:
            the same, rank 1's ElasticWorker actor process).
Every rank appends a JSON line after each completed step ({rank, step, t, inc}: inc names one
incarnation of the training loop) and one when its loop starts ({ev: start, step resumed}).
  recovery   = time from the fault until every rank has completed a step in an incarnation
               started after the fault;
  steps lost = the highest step completed before the fault minus the step training resumed from;
  wall       = the whole job, from starting its driver (`ballast ray run` / a Python driver
               running TorchTrainer.fit() / DLJob.submit()) to that driver's exit.
The table shows medians over --trials.

The cluster: ray.cluster_utils.Cluster on this machine (a head with 0 CPUs, 3 nodes of 1 CPU,
Ray's health checks every 200 ms as in tests/python/test_ray.py), inside a network namespace
with only loopback: the bench re-executes itself under `unshare -n` (run it as root). One
cluster serves every run; a removed node is replaced before the next run starts.

Ray Train needs ray[train]'s extras (fsspec, pandas, pyarrow, tensorboardX) beside Ray 2.60.0 and
Debian's torch 1.13, which build/venv-ray lacks: `make ray-train` builds a venv that has them,
pinned (scripts/ray-train-venv.sh; pyarrow < 21 and pandas < 3: newer ones need NumPy 2, Debian's
is 1.24), and prints its python.

Run (as root, from the repository root; every process of the cluster uses this interpreter):

    $(make -s ray-train) bench/ray_bench.py --trials 3
    build/venv-ray/bin/python bench/ray_bench.py --systems ballast        # Ballast only
    bench/setup_dlrover_ray.sh && $(make -s ray-train) bench/ray_bench.py --systems ballast,raytrain,dlrover

Options: --trials N (3), --steps N (60), --faults node,worker (or pod), --systems ballast,raytrain(,dlrover),
--dlrover-ckpt flash|torch, --dlrover-skip-node-check,
--ballast-flags '...' (more `ballast ray run` flags: '--spares 1 --cpus-per-node 1' makes the
cluster's free third node a hot spare), --json FILE. One trial (5 jobs) takes about 7 minutes on a 2-core machine (Ballast's 2 jobs ~1 min,
Ray Train's 3 ~6 min: a checkpoint reported every step costs it ~1.8 s), plus ~15 s to start the cluster. Not a test:
DLRover's 2 jobs take ~1.5-4 min on that machine (its recovery ~30 s with its node check, ~17 s without).
Numbers go into notes and docs.
"""
import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BALLAST = os.environ.get("BALLAST_BIN", os.path.join(ROOT, "build", "bin", "ballast"))
PYPATH = os.path.join(ROOT, "build", "python")
NETNS_MARK = "BALLAST_BENCH_RAY_NETNS"
# DLRover's Ray mode (bench/setup_dlrover_ray.sh installs it here); its masters go on the head, which alone has
# this custom resource (JobConfig.master_isolation_schedule_resource).
DLROVER_DIR = os.environ.get("BALLAST_DLROVER_RAY",
                             os.path.join(os.path.expanduser("~"), ".cache", "ballast", "dlrover-ray-0.6.1"))
DLROVER_MASTER_RES = "dlrover_master"
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from _ray_cluster import HEALTH, STORE, agent_ray_node, alive, enter_loopback_netns, read_jsonl  # noqa: E402
from _ray_cluster import job_processes as procs_matching  # noqa: E402
FAULT_STEP = 15
STEP_TIME = 0.15
WORLD = 4
JOB_TIMEOUT = 300

# ---------------------------------------------------------------- the training both systems run


def make_model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def make_data():
    import torch
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 1, generator=g))
    return x, y


def train_step(ddp, opt, x, y, step, rank, world, batch=8):
    """One DDP step on rank's slice of the step's batch (the same data whatever restarted)."""
    import torch
    lo = ((step * world + rank) * batch) % len(x)
    loss = torch.nn.functional.mse_loss(ddp(x[lo:lo + batch]), y[lo:lo + batch])
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss)


def log_line(out, **rec):
    """One JSON line, appended with a single write (atomic among the ranks' processes)."""
    rec.setdefault("t", time.time())
    fd = os.open(os.path.join(out, "steps.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(rec) + "\n").encode())
    finally:
        os.close(fd)


def ballast_worker(out, steps):
    """The torchrun-style script `ballast ray run` starts (this file with --worker-ballast)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ballast

    t0 = time.time()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    inc = f"b{os.getpid()}-{t0:.6f}"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = make_data()
    ckpt = ballast.Checkpointer(os.path.join(out, "ckpt"), keep=3)
    step, state = ckpt.load()
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    step = step or 0
    log_line(out, ev="start", rank=rank, step=step, t=t0, inc=inc, pid=os.getpid(),
             round=int(os.environ.get("BALLAST_ROUND", "0")),
             restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), source=ckpt.last_load_source)
    while step < steps:
        step += 1
        loss = train_step(ddp, opt, x, y, step, rank, world)
        ckpt.save(step, {"model": model.state_dict(), "opt": opt.state_dict()})
        log_line(out, ev="step", rank=rank, step=step, inc=inc, loss=loss)
        ballast.step(step)
        time.sleep(STEP_TIME)
    dist.barrier()
    dist.destroy_process_group()


def raytrain_loop(config):
    """Ray Train's train_loop_per_worker: the same model, data and step."""
    import tempfile as tf

    import ray.train
    import torch
    from ray.train import Checkpoint
    from ray.train.torch import prepare_model

    t0 = time.time()
    out, steps, every = config["out"], config["steps"], config["ckpt_every"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    inc = f"r{os.getpid()}-{t0:.6f}"
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    ck = ray.train.get_checkpoint()
    if ck is not None:
        with ck.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    ddp = prepare_model(model)  # DDP (gloo on CPU); the weights broadcast from rank 0
    x, y = make_data()
    log_line(out, ev="start", rank=rank, step=step, t=t0, inc=inc, pid=os.getpid(),
             node=ray.get_runtime_context().get_node_id(), source="checkpoint" if ck is not None else None)
    while step < steps:
        step += 1
        loss = train_step(ddp, opt, x, y, step, rank, world)
        if step % every == 0:
            with tf.TemporaryDirectory() as d:
                ckpt = None
                if rank == 0:
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(d, "state.pt"))
                    ckpt = Checkpoint.from_directory(d)
                ray.train.report({"step": step, "loss": loss}, checkpoint=ckpt)
        log_line(out, ev="step", rank=rank, step=step, inc=inc, loss=loss)
        time.sleep(STEP_TIME)


def dlrover_run_id(out):
    """Names a DLRover job's flash-checkpoint sockets (/tmp/ckpt_sock/ID-nodeN) and shared memory
    (/dev/shm/ID-nodeN_ckpt_shm_*): unique per bench run, so no run finds another's checkpoint in memory."""
    return os.path.basename(os.path.dirname(out)) + "-" + os.path.basename(out)


def dlrover_worker(out, steps):
    """The training DLRover's Ray mode runs (this file with --worker-dlrover, its PY_CMD entrypoint): runpy runs
    it in a thread of each rank's ElasticWorker actor, which has set RANK/WORLD_SIZE/NODE_RANK and already
    initialised the gloo process group (comm_auto_setup_process_group). The checkpoint after every step
    (BALLAST_DLROVER_CKPT):
      flash: DLRover's flash checkpoint, DdpCheckpointer.save_checkpoint(step, state, storage_type=DISK): copied
             into shared memory, then written to out/ckpt by a saver process. The unified API has no agent to host
             the saver, so the engine forks its own from local rank 0 (start_saver_process, its "not launched by
             dlrover-run" path). TORCHELASTIC_RUN_ID names the saver's sockets and shared memory per node: the two
             Ray nodes of a job share this machine's /tmp and /dev/shm.
      torch: rank 0 torch.saves {model, opt, step} to out/ckpt (a temporary file, then renamed)."""
    import ray
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    t0 = time.time()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    inc = f"d{os.getpid()}-{t0:.6f}"
    torch.set_num_threads(1)
    if not dist.is_initialized():
        raise RuntimeError("DLRover's ElasticWorker did not set up the process group")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckdir = os.path.join(out, "ckpt")
    path = os.path.join(ckdir, "state.pt")
    step, source, state, flash = 0, None, None, None
    if os.environ.get("BALLAST_DLROVER_CKPT", "flash") == "flash":
        os.environ["TORCHELASTIC_RUN_ID"] = f"{dlrover_run_id(out)}-node{os.environ['NODE_RANK']}"
        from dlrover.python.common.storage import KeepLatestStepStrategy
        from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer
        flash = DdpCheckpointer(ckdir, deletion_strategy=KeepLatestStepStrategy(3, ckdir))
        state = flash.load_checkpoint() or None
        if state is not None and "model_states" in state:
            state = state["model_states"]
        source = "flash" if state is not None else None
    elif os.path.exists(path):
        state, source = torch.load(path), "disk"
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    ddp = DDP(model)
    x, y = make_data()
    log_line(out, ev="start", rank=rank, step=step, t=t0, inc=inc, pid=os.getpid(),
             node=ray.get_runtime_context().get_node_id(), source=source)
    os.makedirs(ckdir, exist_ok=True)
    while step < steps:
        step += 1
        loss = train_step(ddp, opt, x, y, step, rank, world)
        if flash is not None:
            flash.save_checkpoint(step, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                                  storage_type=StorageType.DISK)
        elif rank == 0:
            tmp = f"{path}.{os.getpid()}.tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, path)
        log_line(out, ev="step", rank=rank, step=step, inc=inc, loss=loss)
        time.sleep(STEP_TIME)
    dist.barrier()


def dlrover_driver(out, steps):
    """DLRover's Ray-mode job driver (this file with --driver-dlrover): DLJobBuilder ... .submit(), which creates
    the detached PrimeMaster actor and waits for the job. 2 nodes x 2 ranks of 0.5 CPU (a placement group of two
    1-CPU bundles, PACK: one bundle per Ray node), the masters on the head (DLROVER_MASTER_RES)."""
    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], namespace=os.environ["BALLAST_DLROVER_NS"], log_to_driver=True)
    from dlrover.python.unified.api.builder import DLJobBuilder
    from dlrover.python.unified.controller.api import MASTER_ACTOR_NAME

    me = os.path.abspath(__file__)
    job = (DLJobBuilder().node_num(2).device_per_node(2).device_type("CPU")
           .global_env({"PYTHONPATH": os.environ["PYTHONPATH"], NETNS_MARK: "1",
                        "BALLAST_DLROVER_CKPT": os.environ.get("BALLAST_DLROVER_CKPT", "flash")})
           .train(f"{me} --worker-dlrover --out {out} --steps {steps}")
           .nnodes(2).nproc_per_node(2).resource(cpu=0.5)
           .end())
    if os.environ.get("BALLAST_DLROVER_SKIP_NODE_CHECK") == "1":
        job.skip_node_check()
    rc = 1
    try:
        rc = job.build().submit(os.path.basename(out), master_cpu=0,
                                master_isolation_schedule_resource=DLROVER_MASTER_RES)
    finally:
        # The PrimeMaster is detached and outlives submit(); its placement group goes with it.
        try:
            ray.kill(ray.get_actor(MASTER_ACTOR_NAME), no_restart=True)
        except ValueError:
            pass
    print(f"dlrover driver: done, exit code {rc}", flush=True)
    ray.shutdown()
    sys.exit(rc)


def raytrain_driver(out, steps, ckpt_every):
    """The Ray Train job's driver (this file with --driver-raytrain): TorchTrainer.fit()."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
    trainer = TorchTrainer(
        raytrain_loop,
        train_loop_config={"out": out, "steps": steps, "ckpt_every": ckpt_every},
        scaling_config=ScalingConfig(num_workers=WORLD, use_gpu=False, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(name=os.path.basename(out), storage_path=os.path.join(out, "storage"),
                             failure_config=FailureConfig(max_failures=3),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    result = trainer.fit()
    print(f"raytrain driver: done, error={result.error!r}", flush=True)
    ray.shutdown()
    sys.exit(0 if result.error is None else 1)


# ---------------------------------------------------------------- the bench


class Bench:
    def __init__(self, args):
        import ray
        from ray.cluster_utils import Cluster

        self.ray = ray
        self.args = args
        self.tmp = tempfile.mkdtemp(prefix="ballast-raybench-")
        t0 = time.monotonic()
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "object_store_memory": STORE, "_system_config": HEALTH,
            "resources": {DLROVER_MASTER_RES: 2}})
        self.nodes = []
        self.add_node()
        self.add_node()
        self.add_node()
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=False)
        self.session_dir = ray._private.worker._global_node.get_session_dir_path()
        print(f"ray_bench: a Ray head and 3 nodes up in {time.monotonic() - t0:.1f} s at {self.cluster.address}; "
              f"output in {self.tmp}", flush=True)
        self.env = dict(os.environ, RAY_ADDRESS=self.cluster.address, RAY_USAGE_STATS_ENABLED="0")

    def add_node(self):
        self.nodes.append(self.cluster.add_node(num_cpus=1, object_store_memory=STORE))

    def remove(self, node_id, every_process=False):
        node = next((n for n in self.nodes if n.node_id == node_id), None)
        if node is None:
            raise RuntimeError(f"Ray node {node_id} is not one of the bench's")
        if every_process:
            # A deleted pod: the raylet and everything under it die together (remove_node kills the
            # raylet, and its workers notice ~0.5 s later).
            from recovery_matrix import kill_tree
            kill_tree(node.all_processes["raylet"][0].process.pid)
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)

    def settle(self, timeout=90):
        """Waits until 3 worker nodes are alive with all their CPUs free (the last job's actors gone)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            nodes = [n for n in self.ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
            if len(nodes) == 3 and self.ray.available_resources().get("CPU", 0) >= 3:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the cluster did not settle: {self.ray.available_resources()}")

    def close(self):
        self.ray.shutdown()
        self.cluster.shutdown()

    def start(self, system, out, ckpt_every, fault):
        log = open(os.path.join(out, "driver.log"), "w")
        me = os.path.abspath(__file__)
        if system == "ballast":
            cmd = [BALLAST, "ray", "run", "--python", sys.executable, "--nodes", "2", "--nproc-per-node", "2",
                   *shlex.split(self.args.ballast_flags)]
            if fault == "worker":
                cmd += ["--chaos", f"kill-worker:rank=1,at_step={FAULT_STEP}"]
            cmd += [me, "--worker-ballast", "--out", out, "--steps", str(self.args.steps)]
        elif system == "dlrover":
            cmd = [sys.executable, me, "--driver-dlrover", "--out", out, "--steps", str(self.args.steps)]
        else:
            cmd = [sys.executable, me, "--driver-raytrain", "--out", out, "--steps", str(self.args.steps),
                   "--ckpt-every", str(ckpt_every)]
        env = self.env
        if system == "dlrover":
            env = dict(env, PYTHONPATH=DLROVER_DIR + os.pathsep + env.get("PYTHONPATH", ""),
                       BALLAST_DLROVER_NS=self.dlrover_ns(out),
                       BALLAST_DLROVER_SKIP_NODE_CHECK="1" if self.args.dlrover_skip_node_check else "0",
                       BALLAST_DLROVER_CKPT=self.args.dlrover_ckpt)
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return p

    @staticmethod
    def dlrover_ns(out):
        return "dlrover-" + os.path.basename(out)

    def kill_dlrover_actors(self, out):
        """Kills the named actors left in the DLRover job's namespace (they are detached: the PrimeMaster, the
        ElasticMaster, the ranks' ElasticWorkers) and returns their names."""
        from ray.util import list_named_actors
        ns = self.dlrover_ns(out)
        killed = []
        for a in list_named_actors(all_namespaces=True):
            if a["namespace"] != ns:
                continue
            try:
                self.ray.kill(self.ray.get_actor(a["name"], namespace=ns), no_restart=True)
                killed.append(a["name"])
            except ValueError:
                pass
        return killed

    def run(self, system, fault, ckpt_every, trial):
        """One job with one fault; returns its metrics (or an error)."""
        label = system if ckpt_every == 1 else f"{system}-ckpt{ckpt_every}"
        out = os.path.join(self.tmp, f"{label}-{fault}-{trial}")
        os.makedirs(out)
        self.settle()
        steps_file = os.path.join(out, "steps.jsonl")
        t_start = time.time()
        p = self.start(system, out, ckpt_every, fault)
        t_fault = t_add = None
        deadline = time.monotonic() + JOB_TIMEOUT
        watch_pid = None
        err = None
        try:
            while p.poll() is None and time.monotonic() < deadline:
                if t_add is not None and time.time() >= t_add:
                    self.add_node()  # the fresh node, 2 s after the removal
                    t_add = None
                if t_fault is None:
                    recs = read_jsonl(steps_file)
                    done = [r for r in recs if r["ev"] == "step"]
                    if fault in ("node", "pod") and any(r["step"] >= FAULT_STEP for r in done):
                        if system == "ballast":
                            victim = agent_ray_node(out, 1)
                        else:
                            victim = next(r["node"] for r in reversed(recs) if r["ev"] == "start" and r["rank"] == 1)
                        if victim is None:
                            raise RuntimeError("no Ray node hosts node rank 1")
                        t_fault = time.time()
                        self.remove(victim, every_process=fault == "pod")
                        t_add = t_fault + 2.0
                    elif fault == "worker":
                        starts = [r for r in recs if r["ev"] == "start" and r["rank"] == 1]
                        if system == "ballast":
                            # --chaos kills rank 1 at step 15: the fault is when its process dies.
                            if watch_pid is None and starts:
                                watch_pid = starts[0]["pid"]
                            if watch_pid is not None and not alive(watch_pid):
                                t_fault = time.time()
                        elif any(r["step"] >= FAULT_STEP and r["rank"] == 1 for r in done):
                            t_fault = time.time()
                            os.kill(starts[-1]["pid"], signal.SIGKILL)
                time.sleep(0.01)
            if p.poll() is None:
                err = f"timed out after {JOB_TIMEOUT} s"
                os.killpg(p.pid, signal.SIGKILL)
            rc = p.wait()
            t_end = time.time()
        except BaseException:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            raise
        finally:
            if t_add is not None:
                self.add_node()
        if rc != 0 and err is None:
            err = f"driver exit {rc}"
        # DLRover's actors are detached; one its PrimeMaster did not stop (seen: a spurious job restart at the end
        # of a job that had restarted, from the earlier FAIL result it never clears) is killed here and noted.
        leftover = self.kill_dlrover_actors(out) if system == "dlrover" else []
        if system == "dlrover":  # what its flash checkpoint leaves behind (the saver does not remove them)
            import glob
            import shutil
            run_id = dlrover_run_id(out)
            for f in glob.glob(f"/dev/shm/{run_id}-node*"):
                os.unlink(f)
            for d in glob.glob(f"/tmp/ckpt_sock/{run_id}-node*"):
                shutil.rmtree(d, ignore_errors=True)
        # No process of a Ballast job (agents, workers: their command lines name out) may outlive it.
        left_deadline = time.monotonic() + 20
        while procs_matching(out) and time.monotonic() < left_deadline:
            time.sleep(0.2)
        left = procs_matching(out)
        if left:
            err = (err or "") + f"; processes left: {left}"
            for pid, _ in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        res = {"system": label, "fault": fault, "trial": trial, "out": out, "wall": t_end - t_start, "error": err,
               "actors_left": leftover}
        res.update(self.metrics(read_jsonl(steps_file), t_fault))
        if res.get("final_step") != self.args.steps and not err:
            res["error"] = f"ended at step {res.get('final_step')}"
        return res

    def metrics(self, recs, t_fault):
        if t_fault is None:
            return {"recovery": None, "lost": None, "final_step": max((r["step"] for r in recs if r["ev"] == "step"),
                                                                     default=None), "note": "no fault injected"}
        steps = [r for r in recs if r["ev"] == "step"]
        starts = [r for r in recs if r["ev"] == "start"]
        new_incs = {r["inc"]: r for r in starts if r["t"] > t_fault}
        # The highest step the incarnations from before the fault completed (ranks of a lost node may
        # finish a step or two after the removal, before their processes die).
        before = max((r["step"] for r in steps if r["inc"] not in new_incs), default=0)
        resumed = min((r["step"] for r in new_incs.values()), default=None)
        firsts = {}
        for r in steps:
            if r["t"] > t_fault and r["inc"] in new_incs:
                firsts[r["rank"]] = min(firsts.get(r["rank"], r["t"]), r["t"])
        recovery = max(firsts.values()) - t_fault if len(firsts) == WORLD else None
        final = {rank: max((r["step"] for r in steps if r["rank"] == rank), default=0) for rank in range(WORLD)}
        return {"recovery": recovery, "lost": None if resumed is None else before - resumed,
                "before": before, "resumed": resumed, "final_step": min(final.values()),
                "restarted_ranks": sorted({r["rank"] for r in new_incs.values()})}


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, nd=2):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--faults", default="node,worker")
    ap.add_argument("--systems", default="ballast,raytrain")
    ap.add_argument("--ballast-flags", default="",
                    help="more `ballast ray run` flags, e.g. '--spares 1 --cpus-per-node 1': the cluster's third "
                         "node then waits as a hot spare (its agent and warm interpreter started)")
    ap.add_argument("--dlrover-skip-node-check", action="store_true",
                    help="DLRover: skip its node check (two rounds of matmul + allreduce before every (re)start)")
    ap.add_argument("--dlrover-ckpt", choices=("flash", "torch"), default="flash",
                    help="DLRover: its flash checkpoint (DdpCheckpointer, saved to disk every step) or torch.save")
    ap.add_argument("--json", help="also write every run's metrics here")
    # Internal: this file is also the Ballast job's script and the Ray Train job's driver.
    ap.add_argument("--worker-ballast", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--driver-raytrain", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-dlrover", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--driver-dlrover", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt-every", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_ballast:
        return ballast_worker(args.out, args.steps)
    if args.driver_raytrain:
        return raytrain_driver(args.out, args.steps, args.ckpt_every)
    if args.worker_dlrover:
        return dlrover_worker(args.out, args.steps)
    if args.driver_dlrover:
        return dlrover_driver(args.out, args.steps)

    systems = [s for s in args.systems.split(",") if s]
    faults = [f for f in args.faults.split(",") if f]
    for s in systems:
        if s not in ("ballast", "raytrain", "dlrover"):
            ap.error(f"unknown system {s}")
    for f in faults:
        if f not in ("node", "pod", "worker"):
            ap.error(f"unknown fault {f}")
    if "raytrain" in systems:
        try:
            import ray.train.torch  # noqa: F401
        except ImportError as e:
            sys.exit(f"ray_bench: Ray Train does not import with {sys.executable}: {e!r} (cause: {e.__cause__!r}); "
                     "see the docstring for a venv with ray[train]'s extras, or pass --systems ballast")
    if "dlrover" in systems:
        probe = subprocess.run([sys.executable, "-c", "import dlrover.python.unified.api.builder, "
                                "dlrover.python.unified.backend.elastic.worker.worker"],
                               env=dict(os.environ, PYTHONPATH=DLROVER_DIR + os.pathsep + os.environ.get("PYTHONPATH", "")),
                               capture_output=True, text=True)
        if probe.returncode != 0:
            sys.exit(f"ray_bench: DLRover's Ray mode does not import from {DLROVER_DIR} with {sys.executable}: "
                     f"{probe.stderr.strip().splitlines()[-1:]}; run bench/setup_dlrover_ray.sh")
    plan = []
    for s in systems:
        for f in faults:
            plan.append((s, f, 1))
        if s == "raytrain" and "node" in faults:
            plan.append((s, "node", 10))  # the interval a Ray Train user would pick

    bench = Bench(args)
    results = []
    t_bench = time.monotonic()
    try:
        for trial in range(args.trials):
            t_trial = time.monotonic()
            for s, f, every in plan:
                res = bench.run(s, f, every, trial)
                results.append(res)
                print(f"ray_bench: trial {trial} {res['system']:>15} {f:>6}: recovery {fmt(res['recovery'])} s, "
                      f"steps lost {fmt(res.get('lost'))} (before {res.get('before')}, resumed "
                      f"{res.get('resumed')}), wall {res['wall']:.1f} s, restarted ranks "
                      f"{res.get('restarted_ranks')}" + (f"  ERROR: {res['error']} ({res['out']})"
                                                          if res["error"] else "") +
                      (f"  (actors left after the job, killed: {res['actors_left']})" if res["actors_left"] else ""),
                      flush=True)
            print(f"ray_bench: trial {trial} took {time.monotonic() - t_trial:.0f} s", flush=True)
    finally:
        bench.close()
    # Nothing of the cluster may be left.
    time.sleep(1)
    left = procs_matching(bench.session_dir) + procs_matching(bench.tmp)
    if left:
        print(f"ray_bench: processes left after the cluster's shutdown (killed): {left}", flush=True)
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\nMedians over {args.trials} trial(s); {args.steps} steps of ~{STEP_TIME} s, 2 nodes x 2 ranks, "
          f"fault at step {FAULT_STEP}; bench took {time.monotonic() - t_bench:.0f} s.\n")
    print("| system | fault | recovery s | steps lost | wall s | failed runs |")
    print("|---|---|---|---|---|---|")
    seen = []
    for r in results:
        if (r["system"], r["fault"]) not in seen:
            seen.append((r["system"], r["fault"]))
    for system, fault in seen:
        rs = [r for r in results if (r["system"], r["fault"]) == (system, fault)]
        ok = [r for r in rs if not r["error"]]
        print(f"| {system} | {fault} | {fmt(median([r['recovery'] for r in ok]))} | "
              f"{fmt(median([r['lost'] for r in ok]), 1)} | {fmt(median([r['wall'] for r in ok]), 1)} | "
              f"{len(rs) - len(ok)}/{len(rs)} |")


if __name__ == "__main__":
    if os.environ.get(NETNS_MARK) != "1" and not {"--worker-ballast", "--driver-raytrain", "--worker-dlrover",
                                                  "--driver-dlrover"} & set(sys.argv):
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        os.environ["PYTHONPATH"] = PYPATH + (os.pathsep + os.environ["PYTHONPATH"]
                                             if os.environ.get("PYTHONPATH") else "")
        enter_loopback_netns(NETNS_MARK)
    main()
