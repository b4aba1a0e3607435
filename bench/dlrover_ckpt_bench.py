#!/usr/bin/python3
"""First flash-checkpoint save of a job: Ballast against DLRover 0.6.1, side by side.

What it measures, per job (each trial of each row is a separate job, started
by this driver; torch 1.13, /usr/bin/python3):

  first    blocking time of the job's first in-memory save of the state
           (step 1): for both systems this creates/sizes the shared memory
           and faults its pages while copying into it
  steady   median blocking time of the next --saves saves (steps 2..),
           with --gap seconds of idle between saves (standing in for the
           training steps between checkpoints)
  init     time to construct the checkpointer (ballast.Checkpointer /
           DdpCheckpointer), not part of either save

The state (identical for both, built before any timing): make_state of
bench/ckpt_bench.py (copied here: that module imports ballast): {"model":
float32 tensors of 16 MiB each adding up to --gb GiB plus a 4 KiB bias,
"opt": small Python values}.

Rows:
  ballast  agent      `ballast run --standalone --nproc-per-node 1` (the
                      agent owns the shared-memory store); the worker inits
                      a gloo process group and times ckpt.save(step, state)
  ballast  no agent   plain `/usr/bin/python3 worker`: the Checkpointer
                      creates its own store
  dlrover  agent      `dlrover-run --standalone --nproc_per_node 1` (torch
                      1.13's launcher with the Python 3.11 Std patch from
                      _benchutil.py; dlrover-run starts its local job master
                      and its agent hosts the checkpoint saver); the worker
                      inits a gloo process group and times
                      DdpCheckpointer.save_checkpoint(step, state, path,
                      storage_type=StorageType.MEMORY)
  dlrover  no agent   plain python: DLRover's engine forks its own saver
                      process (start_saver_process), as its docs allow
  ... tN              the same with N copy threads: Ballast with
                      BALLAST_CKPT_COPY_THREADS=N, DLRover with
                      torch.set_num_threads(N) (its copy is torch's copy_).
                      Without tN each runs with its defaults: Ballast one
                      copy thread per core (up to 8), DLRover torch's
                      intra-op thread count (1 on the 2-core VM this was
                      written on, where torch.get_num_threads() says 1).
                      The default rows add ballast agent/no agent t1 and
                      dlrover agent t2 to separate threading from the rest.
  ballast  ... reserve   the worker calls ckpt.reserve(state) right after
                      constructing the Checkpointer (what
                      ballast.hf.BallastCallback does after the first step):
                      the shared memory is sized and faulted in the
                      background during the --first-gap seconds of
                      "training" before the first save, so that save only
                      copies. Every row waits --first-gap before its first
                      save; only this one uses the time.
  ballast  ... loadinto  the worker calls ckpt.load(into=state) right after
                      constructing the Checkpointer, as a script that resumes
                      does at its start (here nothing to load: a job's first
                      start), without calling reserve: load sizes and faults
                      the memory for that state in the background itself.
  ballast  agent nowarm  `ballast run --no-warm-restart`: by default the
                      agent preloads a warm interpreter (imports torch and
                      the worker's modules) for the next restart while the
                      job runs, which competes for the CPUs with the
                      worker; warm_ready_after_first_start_s in --json says
                      when that preload finished relative to the first save.

What DLRover's timed call covers: save_checkpoint(..., MEMORY) ->
FullCheckpointEngine.save_to_memory is synchronous: it takes the
shared-memory lock (a local-socket round trip to the saver), all-reduces a
"ready" flag over the process group, on the first call builds the tensor
metadata and creates the SharedMemory segment, sends the metadata dict
(pickled over a local socket) to the saver, copies every tensor with
torch's copy_ into the segment, and sends the metadata again with
writing_shm=False. Nothing of the in-memory save is left running when it
returns (only DISK saves have an asynchronous part, the agent's write to
storage; none is requested here). The worker checks that each save really
happened (the engine's cached step moves to the saved step; a save skipped
because the lock was busy would not count).

Ballast's timed call: ckpt.save(step, state) (blocking=True, persist=False):
it returns when the step is committed in shared memory.

Each job gets a run id of its own (DLRover: ELASTIC_JOB_NAME under
dlrover-run, TORCHELASTIC_RUN_ID in plain python), which names DLRover's
segment (/dev/shm/RUN_ID_ckpt_shm_0) and socket directory
(/tmp/ckpt_sock/RUN_ID); the driver removes those two after each trial
(DLRover's worker leaves the segment behind), and nothing else: Ballast's
agent and Checkpointer.close() remove their own stores. So every trial's
first save is a real first save. The work directory (logs, results) is
kept with --keep or when a job failed.

Run (after `bench/setup_dlrover.sh`, which installs DLRover 0.6.1 under
~/.cache/ballast/dlrover-0.6.1):

  PYTHONPATH=build/python /usr/bin/python3 bench/dlrover_ckpt_bench.py --gb 1 --trials 3 [--json]

Internal entry points (the driver starts these):
  dlrover_ckpt_bench.py _worker {ballast,dlrover} --gb G --out FILE --dir D [...]
  dlrover_ckpt_bench.py _dlrover_run DLROVER-RUN-ARGS...
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
PY = "/usr/bin/python3"
BALLAST_BIN = os.path.join(ROOT, "build", "bin", "ballast")
BALLAST_PY = os.path.join(ROOT, "build", "python")
# system:launch[:tN]; tN: copy threads (Ballast: BALLAST_CKPT_COPY_THREADS=N; DLRover:
# torch.set_num_threads(N) in the worker, as its copy is torch's copy_). Without tN each
# system runs with its defaults: Ballast copies with one thread per core (up to 8),
# DLRover with torch's intra-op threads (what torch.get_num_threads() says here).
# nowarm (ballast agent only): `ballast run --no-warm-restart`, so the agent does
# not preload a warm interpreter for the next restart while the job runs.
# reserve (ballast only): ckpt.reserve(state) before the --first-gap wait.
# loadinto (ballast only): ckpt.load(into=state) there instead (a fresh start).
ROWS = ("ballast:agent,ballast:no agent,dlrover:agent,dlrover:no agent,ballast:agent:reserve,"
        "ballast:no agent:reserve,ballast:agent:nowarm,ballast:agent:t1,ballast:no agent:t1,dlrover:agent:t2")


def parse_row(key):
    """'system:launch[:opt]' -> (system, launch, threads, flag); flag: "", "nowarm", "reserve" or "loadinto"."""
    parts = key.split(":")
    opt = parts[2] if len(parts) == 3 else ""
    if len(parts) not in (2, 3) or parts[0] not in ("ballast", "dlrover") or parts[1] not in ("agent", "no agent") \
            or not (opt == "" or re.fullmatch(r"t\d+", opt) or (opt == "nowarm" and parts[:2] == ["ballast", "agent"])
                    or (opt in ("reserve", "loadinto") and parts[0] == "ballast")):
        raise SystemExit(f"bad row {key!r}: want ballast|dlrover:agent|no agent[:tN], ballast:agent:nowarm "
                         "or ballast:agent|no agent:reserve|loadinto")
    threads = int(opt[1:]) if opt.startswith("t") else 0
    return parts[0], parts[1], threads, "" if threads else opt


# -- worker ----------------------------------------------------------------------


def worker(a):
    sys.path.insert(0, HERE)
    from _benchutil import make_state
    import torch
    import torch.distributed as dist

    t_start = time.perf_counter()
    state = make_state(int(a.gb * (1 << 30)))
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    t_state = time.perf_counter() - t_start

    if a.system == "dlrover" and a.threads:
        torch.set_num_threads(a.threads)
    use_dist = "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ
    if use_dist:
        dist.init_process_group("gloo")

    out = {"system": a.system, "pid": os.getpid(), "state_bytes": nbytes, "tensors": len(state["model"]),
           "make_state_s": t_state, "dist": use_dist, "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
           "copy_threads": (int(os.environ.get("BALLAST_CKPT_COPY_THREADS") or 0) or min(max(os.cpu_count(), 1), 8))
           if a.system == "ballast" else torch.get_num_threads()}
    os.makedirs(a.dir, exist_ok=True)

    t0 = time.perf_counter()
    if a.system == "ballast":
        import ballast

        ckpt = ballast.Checkpointer(a.dir)
        out["ballast_agent_store"] = bool(ckpt.agent)

        if a.reserve:
            out["reserved_bytes"] = ckpt.reserve(state)
        if a.load_into:
            out["loaded_step"] = ckpt.load(into=state)[0]

        def save(step):
            ckpt.save(step, state)

        def saved(step):
            return ckpt.memory_step() == step
    else:
        from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

        ckpt = DdpCheckpointer(a.dir)
        out["dlrover_shm_name"] = ckpt._engine._shm_handler._shm_name

        def save(step):
            ckpt.save_checkpoint(step, state, os.path.join(a.dir, f"{step}.pt"), storage_type=StorageType.MEMORY)

        def saved(step):
            return ckpt._engine._cached_step == step
    out["init_s"] = time.perf_counter() - t0

    times, ok = [], []
    for i in range(1 + a.saves):
        step = i + 1
        time.sleep(a.gap if i else a.first_gap)
        if i == 0:
            out["first_start_unix"] = time.time()
        t0 = time.perf_counter()
        save(step)
        times.append(time.perf_counter() - t0)
        ok.append(saved(step))
    out.update(first_s=times[0], next_s=times[1:], steady_s=statistics.median(times[1:]) if a.saves else None,
               all_saved=all(ok), saved_flags=ok)
    with open(a.out + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(a.out + ".tmp", a.out)
    print("CKPT_BENCH " + json.dumps(out), flush=True)
    if use_dist:
        dist.destroy_process_group()
    if a.system == "ballast":
        ckpt.close()
    else:
        ckpt._engine.close()
    sys.stdout.flush()
    # DLRover's plain-python mode leaves a daemon saver process behind; exit
    # without waiting on its atexit machinery.
    os._exit(0)


def dlrover_run(argv):
    """dlrover-run (dlrover.trainer.torch.elastic_run.main) on torch 1.13 /
    Python 3.11, with torch's Std.from_str patched (see _benchutil.py)."""
    sys.path.insert(0, HERE)
    from _benchutil import patch_torch113_std

    patch_torch113_std()
    from dlrover.trainer.torch.elastic_run import main

    main(argv)


# -- driver ----------------------------------------------------------------------


def dlrover_install(opt):
    if opt:
        return opt
    found = sorted(glob.glob(os.path.expanduser("~/.cache/ballast/dlrover-[0-9]*/dlrover")),
                   key=lambda d: [int(n) for n in re.findall(r"\d+", os.path.basename(os.path.dirname(d)))])
    return os.path.dirname(found[-1]) if found else None


def env_for(system, install):
    """The environment of a job: build/python on PYTHONPATH for Ballast only,
    the DLRover install for DLRover only."""
    env = dict(os.environ)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and os.path.abspath(p) not in (BALLAST_PY, os.path.abspath(install or "/nonexistent"))]
    path.insert(0, BALLAST_PY if system == "ballast" else install)
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def proc_tree(pid):
    table = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    table[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c, pp in table.items():
            if pp == p:
                out.append(c)
                todo.append(c)
    return out


def kill_job(p):
    """Kills the job's processes: its process group (its own session, which
    also holds children that outlived their parent, such as DLRover's forked
    saver) and anything under it that left the group."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for q in [p.pid] + proc_tree(p.pid):
        try:
            os.kill(q, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_job(key, a, install, work, trial):
    """Runs one job; returns the worker's result dict (plus the job's log
    facts) or {"error": ...}."""
    system, mode, threads, flag = parse_row(key)
    tag = f"{key.replace(' ', '').replace(':', '-')}-{trial}"
    out = os.path.join(work, tag + ".json")
    ckdir = os.path.join(work, tag + "-ckpt")
    log_path = os.path.join(work, tag + ".log")
    wargs = [os.path.abspath(__file__), "_worker", system, "--gb", str(a.gb), "--out", out, "--dir", ckdir,
             "--saves", str(a.saves), "--gap", str(a.gap), "--first-gap", str(a.first_gap),
             "--threads", str(threads)] + {"reserve": ["--reserve"], "loadinto": ["--load-into"]}.get(flag, [])
    env = env_for(system, install)
    if system == "ballast" and threads:
        env["BALLAST_CKPT_COPY_THREADS"] = str(threads)
    run_id = f"ckbench{uuid.uuid4().hex[:10]}"
    if system == "ballast" and mode == "agent":
        argv = [BALLAST_BIN, "run", "--standalone", "--nproc-per-node", "1", "--python", PY] \
            + (["--no-warm-restart"] if flag == "nowarm" else []) + wargs
    elif system == "ballast":
        argv = [PY] + wargs
    elif mode == "agent":
        env["ELASTIC_JOB_NAME"] = run_id  # dlrover-run's job name = run id: names its shm segment
        argv = [PY, os.path.abspath(__file__), "_dlrover_run", "--standalone", "--nproc_per_node", "1",
                "--max_restarts", "0", "--monitor_interval", "0.5"] + wargs
    else:
        env["TORCHELASTIC_RUN_ID"] = run_id  # names the segment, so it can be removed after the trial
        argv = [PY] + wargs
    before = set(os.listdir("/dev/shm"))
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    res = None
    try:
        while time.perf_counter() - t0 < a.timeout:
            if os.path.exists(out):
                with open(out) as f:
                    res = json.load(f)
                break
            if p.poll() is not None:
                time.sleep(0.5)  # the result file may have been written just before exiting
                if os.path.exists(out):
                    continue
                break
            time.sleep(0.2)
        try:  # let the launcher wind down on its own, then make sure
            p.wait(timeout=a.exit_grace)
        except subprocess.TimeoutExpired:
            pass
    finally:
        kill_job(p)
        p.wait()
    wall = time.perf_counter() - t0
    with open(log_path, errors="replace") as f:
        text = f.read()
    # Shared memory this job left: only DLRover's segment, named with run_id
    # (other processes of the machine create /dev/shm objects too: nothing
    # else is touched; Ballast's agent, and a Checkpointer's close(), remove
    # their own stores).
    left = [n for n in set(os.listdir("/dev/shm")) - before if run_id in n]
    for n in left:
        try:
            os.unlink(os.path.join("/dev/shm", n))
        except OSError:
            pass
    # DLRover's local sockets of this job (/tmp/ckpt_sock/RUN_ID: its shm lock,
    # event queue, metadata dict).
    shutil.rmtree(os.path.join("/tmp/ckpt_sock", run_id), ignore_errors=True)
    shutil.rmtree(ckdir, ignore_errors=True)
    if res is None:
        last = [l for l in text.splitlines() if l.strip()][-8:]
        return {"error": f"no result (exit {p.returncode}, {wall:.0f} s); log {log_path}; last lines:\n  "
                         + "\n  ".join(last)}
    res["job_wall_s"] = wall
    res["shm_left"] = left
    m = re.search(r"\[ballast agent (\d\d:\d\d:[\d.]+)\] info warm interpreters ready", text)
    if m:  # wall clock of the agent's warm-interpreter preload finishing, vs the first save
        hh, mm, ss = m.group(1).split(":")
        lt = time.localtime(res["first_start_unix"])
        ready = time.mktime(lt[:3] + (int(hh), int(mm), 0) + lt[6:]) + float(ss)
        res["warm_ready_after_first_start_s"] = ready - res["first_start_unix"]
    m = re.search(r"ballast: checkpoint step (\d+): this save of ([\d.]+) GiB took ([\d.]+) s because it sized", text)
    if m:
        res["ballast_growth_note"] = m.group(0)
    res["dlrover_timer"] = re.findall(r"execute save_to_memory in ([\d.]+)s", text)
    res["log"] = log_path
    return res


def fmt(x, unit_ms=True):
    return "-" if x is None else f"{x * 1e3:.0f}" if unit_ms else f"{x:.2f}"


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="state size in GiB [1.0]")
    p.add_argument("--trials", type=int, default=3, help="jobs per row [3]")
    p.add_argument("--saves", type=int, default=3, help="saves after the first, for the steady state [3]")
    p.add_argument("--gap", type=float, default=1.0, help="idle seconds between saves [1.0]")
    p.add_argument("--first-gap", type=float, default=1.0,
                   help="idle seconds before the first save (the first steps of training) [1.0]")
    p.add_argument("--rows", default=ROWS, help=f"comma-separated system:launch[:tN] rows [{ROWS}]")
    p.add_argument("--dlrover", default=None, help="DLRover install dir [newest ~/.cache/ballast/dlrover-*]")
    p.add_argument("--timeout", type=float, default=300, help="seconds a job may take to report [300]")
    p.add_argument("--exit-grace", type=float, default=20, help="seconds a job may take to exit after it reported")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    a = p.parse_args(argv)

    rows = [r for r in a.rows.split(",") if r and parse_row(r)]
    install = dlrover_install(a.dlrover)
    work = tempfile.mkdtemp(prefix="dlrover-ckpt-bench-")
    results = {key: [] for key in rows}
    errors = {}
    for trial in range(a.trials):
        for key in rows:  # rows interleaved, so drift in the machine's load hits all rows alike
            if key.startswith("dlrover") and install is None:
                errors[key] = "DLRover not installed (bench/setup_dlrover.sh)"
                continue
            r = run_job(key, a, install, work, trial)
            if "error" in r:
                errors.setdefault(key, []).append(r["error"])
                print(f"[{key} trial {trial}] ERROR {r['error']}", file=sys.stderr, flush=True)
            else:
                results[key].append(r)
                print(f"[{key} trial {trial}] first {r['first_s']:.3f} s, next "
                      + ", ".join(f"{x:.3f}" for x in r["next_s"]) + f" s, init {r['init_s']:.2f} s, "
                      f"saved={r['all_saved']}", file=sys.stderr, flush=True)

    summary = {}
    for key, rs in results.items():
        if not rs:
            continue
        firsts = [r["first_s"] for r in rs]
        steadies = [r["steady_s"] for r in rs if r["steady_s"] is not None]
        summary[key] = {"first_median_s": statistics.median(firsts), "firsts_s": firsts,
                        "steady_median_s": statistics.median(steadies) if steadies else None,
                        "steadies_s": steadies, "init_median_s": statistics.median(r["init_s"] for r in rs),
                        "all_saved": all(r["all_saved"] for r in rs),
                        "state_gib": rs[0]["state_bytes"] / (1 << 30), "trials": len(rs)}
    gib = summary[next(iter(summary))]["state_gib"] if summary else a.gb
    print(f"\nFlash-checkpoint save, {gib:.2f} GiB state (16 MiB float32 tensors), torch 1.13, "
          f"{a.trials} job(s) per row, {a.first_gap:g} s before the first save, gap {a.gap:g} s between saves; "
          "times in ms (blocking time of the call)")
    hdr = f"{'system':<8} {'launch':<12} {'first (median)':>14} {'first (each trial)':<22} {'steady (median)':>15} " \
          f"{'steady (each)':<20} {'GB/s first':>10} {'GB/s steady':>11} {'init':>6}"
    print(hdr)
    print("-" * len(hdr))
    for key, s in summary.items():
        sysname, mode, threads, flag = parse_row(key)
        mode += f" t{threads}" if threads else f" {flag}" if flag else ""
        each_f = "/".join(fmt(x) for x in s["firsts_s"])
        each_s = "/".join(fmt(x) for x in s["steadies_s"])
        gbs = lambda t: f"{s['state_gib'] / t:.2f}" if t else "-"  # noqa: E731
        print(f"{sysname:<8} {mode:<12} {fmt(s['first_median_s']):>14} {each_f:<22} {fmt(s['steady_median_s']):>15} "
              f"{each_s:<20} {gbs(s['first_median_s']):>10} {gbs(s['steady_median_s']):>11} "
              f"{fmt(s['init_median_s']):>6}" + ("" if s["all_saved"] else "  (some saves NOT done!)"))
    ratios = {}
    for mode in ("agent", "no agent", "agent:reserve", "no agent:reserve", "agent:loadinto", "no agent:loadinto"):
        b, d = summary.get(f"ballast:{mode}"), summary.get(f"dlrover:{mode.split(':')[0]}")
        if b and d:
            ratios[mode] = {"first": b["first_median_s"] / d["first_median_s"],
                            "steady": b["steady_median_s"] / d["steady_median_s"]
                            if b["steady_median_s"] and d["steady_median_s"] else None}
            r = ratios[mode]
            print(f"ballast/dlrover ({mode}): first {r['first']:.2f}x"
                  + (f", steady {r['steady']:.2f}x" if r["steady"] else "")
                  + ("  [target first <= 0.5x: " + ("met" if r["first"] <= 0.5 else "NOT met") + "]"))
    for key, errs in errors.items():
        print(f"{key}: errors: " + (errs if isinstance(errs, str) else "\n".join(errs)))
    if a.json:
        print(json.dumps({"gb": a.gb, "trials": a.trials, "gap_s": a.gap, "first_gap_s": a.first_gap,
                          "saves": a.saves, "summary": summary,
                          "ratios": ratios, "runs": results, "errors": errors}))
    if a.keep or errors:
        print(f"logs kept in {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if summary and not errors else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        wp = argparse.ArgumentParser()
        wp.add_argument("system", choices=("ballast", "dlrover"))
        wp.add_argument("--gb", type=float, required=True)
        wp.add_argument("--out", required=True)
        wp.add_argument("--dir", required=True)
        wp.add_argument("--saves", type=int, default=3)
        wp.add_argument("--gap", type=float, default=1.0)
        wp.add_argument("--first-gap", type=float, default=1.0)
        wp.add_argument("--reserve", action="store_true")
        wp.add_argument("--load-into", action="store_true")
        wp.add_argument("--threads", type=int, default=0)
        worker(wp.parse_args(sys.argv[2:]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_dlrover_run":
        dlrover_run(sys.argv[2:])
    else:
        sys.exit(main(sys.argv[1:]))
