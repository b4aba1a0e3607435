#!python
# The `ballast` command a wheel installs on the environment's PATH (pip points
# the first line at the environment's interpreter): it execs the binary inside
# the installed package, ballast/_bin/ballast, in place (same pid, so signals
# from Slurm, Kubernetes or a shell reach the binary itself). It finds the
# package without importing it: `import ballast` imports torch, seconds this
# command must not spend.
import importlib.util
import os
import sys


def _binary():
    candidates = []
    spec = importlib.util.find_spec("ballast")
    if spec is not None:
        candidates += [os.path.join(d, "_bin", "ballast") for d in (spec.submodule_search_locations or [])]
    # An editable install (`pip install -e .`) maps the package to the sources;
    # the built binary stays in the environment's site directory.
    candidates += [os.path.join(d, "ballast", "_bin", "ballast") for d in sys.path if d]
    for path in candidates:
        if os.access(path, os.X_OK):
            return path
    sys.exit("ballast: the ballast package's binary (ballast/_bin/ballast) is not in this environment "
             f"({sys.executable}); reinstall it: {sys.executable} -m pip install --force-reinstall ballast")


if __name__ == "__main__":
    exe = _binary()
    # The interpreter Ballast is installed for: `ballast ray run` talks to Ray
    # with it, `ballast ckpt export` reads checkpoints with it.
    os.environ.setdefault("BALLAST_PYTHON", sys.executable)
    os.execv(exe, ["ballast"] + sys.argv[1:])
