"""The pre-flight check worker (ballast.precheck): one-shot and server mode.

Real processes and a real gloo group of one rank; tiny sizes.
"""
import os
import shutil
import subprocess
import tempfile
import time
import unittest

from _util import free_port

PYTHON = os.environ.get("BALLAST_PYTHON", "/usr/bin/python3")




def wait_for(path, timeout_s=60):
    end = time.time() + timeout_s
    while time.time() < end:
        if os.path.exists(path):
            return True
        time.sleep(0.02)
    return False


def write_request(directory, seq, **fields):
    path = os.path.join(directory, f"req-0-{seq}")
    with open(path + ".tmp", "w") as f:
        for k, v in fields.items():
            f.write(f"{k} {v}\n")
    os.rename(path + ".tmp", path)


def read_result(directory, seq):
    text = open(os.path.join(directory, f"res-0-{seq}")).read()
    head, _, error = text.partition("\nerror ")
    fields = dict(line.split(" ", 1) for line in head.splitlines())
    return fields["ok"] == "1", float(fields["time_s"]), error


class PrecheckTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="ballast-precheck-test-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.env = dict(os.environ, LOCAL_RANK="0", OMP_NUM_THREADS="1")

    def request(self, **extra):
        fields = dict(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), matmul_size=32,
                      allreduce_bytes=1024, timeout_s=60, fail=0)
        fields.update(extra)
        return fields

    def test_one_shot_writes_the_time(self):
        result = os.path.join(self.dir, "result")
        env = dict(self.env, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   BALLAST_PRECHECK_MATMUL_SIZE="32", BALLAST_PRECHECK_ALLREDUCE_BYTES="1024",
                   BALLAST_PRECHECK_RESULT=result)
        p = subprocess.run([PYTHON, "-m", "ballast.precheck"], env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertGreater(float(open(result).read()), 0)

    def test_server_runs_checks_until_one_fails(self):
        log = open(os.path.join(self.dir, "server.log"), "w")
        self.addCleanup(log.close)
        server = subprocess.Popen([PYTHON, "-u", "-m", "ballast.precheck", "--serve", self.dir], env=self.env,
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            # Two checks in one process (a new group each time), then chaos.
            for seq in (1, 2):
                write_request(self.dir, seq, **self.request())
                self.assertTrue(wait_for(os.path.join(self.dir, f"res-0-{seq}")), f"no result {seq}")
                ok, t, error = read_result(self.dir, seq)
                self.assertTrue(ok, error + open(log.name).read())
                self.assertGreater(t, 0)
            self.assertIsNone(server.poll(), "the server keeps running after a passed check")
            write_request(self.dir, 3, **self.request(fail=1))
            self.assertTrue(wait_for(os.path.join(self.dir, "res-0-3")))
            ok, _, error = read_result(self.dir, 3)
            self.assertFalse(ok)
            self.assertIn("chaos check-fail", error)
            self.assertEqual(server.wait(timeout=60), 1, "a server exits after a failed check")
        finally:
            if server.poll() is None:
                server.kill()
            server.wait()

    def test_server_quits_on_request(self):
        server = subprocess.Popen([PYTHON, "-u", "-m", "ballast.precheck", "--serve", self.dir], env=self.env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        write_request(self.dir, 1, quit=1)
        self.assertEqual(server.wait(timeout=60), 0)

    def test_bad_arguments_exit_2(self):
        p = subprocess.run([PYTHON, "-m", "ballast.precheck", "--bogus"], env=self.env, capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(p.returncode, 2)
        self.assertIn("usage", p.stderr)


if __name__ == "__main__":
    unittest.main()
