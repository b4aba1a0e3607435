"""A worker killed by the kernel's OOM killer is reported as such: a real OOM
kill in a memory cgroup this test makes (cgroup v1 or v2, a child of the
test's own), under `ballast run --standalone`.

The worker allocates past the cgroup's limit; the kernel kills it; the agent
sees the cgroup's oom_kill count rise and classifies the SIGKILL as
"oom-killed", which is retried once only (the same batch on the same memory
fails the same way), so the job fails after one restart with that cause. Needs root (make test runs
as root here); a machine where no memory cgroup can be made fails the test.
"""

import os
import shutil
import subprocess
import tempfile
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("BALLAST_BIN", os.path.join(ROOT, "build", "bin", "ballast"))
PYTHON = os.environ.get("BALLAST_PYTHON", "/usr/bin/python3")
LIMIT = 192 << 20


def make_memory_cgroup(name):
    """A child memory cgroup of this process's, with LIMIT bytes: (path, procs file)."""
    with open("/proc/self/cgroup") as f:
        lines = [l.strip().split(":", 2) for l in f if l.strip()]
    v1 = [p for h, c, p in lines if "memory" in c.split(",")]
    if v1 and os.path.isdir(f"/sys/fs/cgroup/memory{v1[0]}"):
        path = f"/sys/fs/cgroup/memory{v1[0].rstrip('/')}/{name}"
        os.mkdir(path)
        with open(f"{path}/memory.limit_in_bytes", "w") as f:
            f.write(str(LIMIT))
        return path
    v2 = [p for h, c, p in lines if h == "0" and c == ""]
    if v2 and os.path.exists(f"/sys/fs/cgroup{v2[0]}/cgroup.controllers"):
        path = f"/sys/fs/cgroup{v2[0].rstrip('/')}/{name}"
        os.mkdir(path)
        with open(f"{path}/memory.max", "w") as f:
            f.write(str(LIMIT))
        return path
    raise RuntimeError("no memory cgroup can be made here (neither cgroup v1's memory controller nor cgroup v2); "
                       "this test needs one, as root")


class OomTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ballast-oom-")
        self.cgroup = make_memory_cgroup(f"ballast-oom-test-{os.getpid()}")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)
        try:
            os.rmdir(self.cgroup)  # empty by now: every process of the job exited
        except OSError as e:
            raise AssertionError(f"cannot remove the test's cgroup {self.cgroup}: {e}")

    def test_oom_killed_worker_is_named_and_retried_once(self):
        script = os.path.join(self.tmp, "hog.py")
        with open(script, "w") as f:
            f.write("chunks = []\n"
                    "while True:\n"
                    "    chunks.append(bytearray(16 << 20))  # zero-filled: every page is touched\n")
        # The agent joins the cgroup before it starts (so do its workers).
        cmd = (f"echo $$ > {self.cgroup}/cgroup.procs && exec {BIN} run --standalone --nproc-per-node 1 "
               f"--max-restarts 3 --no-warm-restart --python {PYTHON} {script}")
        r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=120, cwd=self.tmp,
                           env={**os.environ, "BALLAST_LOG_LEVEL": "info"})
        out = r.stdout + r.stderr
        self.assertEqual(r.returncode, 1, out[-4000:])
        self.assertIn("killed by the kernel's OOM killer", out, out[-4000:])
        # Retried once (its own limit), though --max-restarts allows 3.
        self.assertIn("restart 1/3", out, out[-4000:])
        self.assertNotIn("restart 2/3", out, out[-4000:])
        self.assertIn("oom-killed failures are retried at most 1 time(s)", out, out[-4000:])
        self.assertIn("2 failures (2 oom-killed)", out, out[-4000:])
        print("\n" + [l for l in out.splitlines() if "OOM killer" in l][0], flush=True)


if __name__ == "__main__":
    unittest.main()
