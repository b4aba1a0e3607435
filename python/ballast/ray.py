"""Run a Ballast job on a Ray cluster from Python: ``ballast ray run`` as a call.

Example (on a node of the cluster, or in a script ``ray job submit`` runs)::

    import ballast.ray
    result = ballast.ray.run("train.py", ["--epochs", "3"], nodes="2:4", nproc_per_node=8,
                             gpus_per_node=8, save_every="auto")
    print(result.exit_code, result.summary)

Every keyword is the command's flag of the same name (``nproc_per_node=8`` is
``--nproc-per-node 8``; ``True`` gives a bare flag, ``False`` and ``None``
leave it out; a list repeats it): ``ballast ray run --help`` lists them. The
job's output goes to this process's stdout as it comes; the call returns when
the job ended. This module does not import Ray: the job's Ray bridge does.
"""
import os
import shutil
import subprocess
import sys
from typing import NamedTuple, Optional, Sequence


class JobResult(NamedTuple):
    exit_code: int          # the job's: 0 succeeded, 1 failed, 2 bad flags, 128+N stopped by signal N
    summary: Optional[str]  # the job summary line ("job J summary: goodput ..."), None if it never got that far


def _binary():
    """The ballast binary beside this package (a wheel's, or the build tree's), else the one on PATH."""
    here = os.path.dirname(os.path.abspath(__file__))
    for path in (os.path.join(here, "_bin", "ballast"), os.path.join(here, "..", "..", "bin", "ballast")):
        if os.access(path, os.X_OK):
            return os.path.normpath(path)
    found = os.environ.get("BALLAST_BIN") or shutil.which("ballast")
    if not found:
        raise FileNotFoundError("no ballast binary: reinstall Ballast (pip install 'ballast[ray]') or set BALLAST_BIN")
    return found


def flags_to_argv(flags):
    """``{"nproc_per_node": 8, "network_check": True}`` -> ``["--nproc-per-node", "8", "--network-check"]``."""
    argv = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                argv += [flag, str(v)]
        else:
            argv += [flag, str(value)]
    return argv


def run(script: str, args: Sequence[str] = (), *, nodes, python: Optional[str] = None, env=None,
        **flags) -> JobResult:
    """Runs ``ballast ray run [flags] script args`` to its end; see the module doc."""
    argv = [_binary(), "ray", "run", "--nodes", str(nodes), "--python", python or sys.executable,
            *flags_to_argv(flags), script, *[str(a) for a in args]]
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("BALLAST_PYTHON", sys.executable)
    summary = None
    with subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as p:
        try:
            for line in p.stdout:
                sys.stdout.write(line)
                if " summary: " in line and "] info job " in line:
                    summary = line.split("] info ", 1)[1].strip()
        except KeyboardInterrupt:
            p.terminate()  # the driver stops the agents and their workers
            p.wait()
            raise
        rc = p.wait()
    return JobResult(rc, summary)
