"""Writes what the worker sees of its own start as JSON to $OUT_DIR/start-rank<RANK>-<restart>.json
(no torch import of its own): warm and cold starts must look the same to a script."""
import json
import os
import signal
import sys

seen = {
    "name": __name__,
    "file": __file__,
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "path0": sys.path[0],
    "path": sys.path[1:],
    "flags": [getattr(sys.flags, f) for f in ("optimize", "dont_write_bytecode", "inspect", "isolated")],
    "stdin_fd": sys.stdin.fileno() if sys.stdin else None,
    "env": {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "BALLAST_ROUND")},
    "signals": {s: str(signal.getsignal(getattr(signal, s))) for s in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGPIPE",
                                                                       "SIGCHLD", "SIGHUP")},
    "spec": __spec__ is None,
    "main_is_this": sys.modules["__main__"].__dict__ is globals(),
    "open_fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2),
}
out = os.environ["OUT_DIR"]
with open(os.path.join(out, f"start-rank{os.environ['RANK']}-{os.environ['TORCHELASTIC_RESTART_COUNT']}.json"),
          "w") as f:
    json.dump(seen, f, indent=1, sort_keys=True)
if os.environ.get("FAIL_FIRST") and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    # FAIL_FIRST names a file: rank 1's first start fails once it exists.
    import time
    while not os.path.exists(os.environ["FAIL_FIRST"]):
        time.sleep(0.05)
    sys.exit(5)
