"""The wheel as a user installs it: `pip install ballast-*.whl` into a fresh
venv of another CPython than the build's (pyenv's 3.12, with PyPI's torch),
then a 2 nodes x 2 workers DDP job there with flash checkpoints, peer replicas
and an ElasticSampler, a worker killed (it resumes from memory and ends
bitwise equal to the same job without the fault); then `pip uninstall
ballast` leaves the venv as it was.

The wheel comes from BALLAST_WHEEL_DIR (`make test` builds it:
scripts/build-wheels.sh --out build/wheels 3.11 3.12), torch for 3.12 from
BALLAST_OTHER_TORCH_PYTHON (scripts/torch2-venv.sh --python 3.12), made
visible in the fresh venv through a .pth. Nothing here uses the build tree's
PYTHONPATH or binary.
"""

import glob
import json
import os
import re
import subprocess
import sys
import unittest
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "../integration/scripts/health_train.py")
OTHER = "3.12"
TAG = "cp" + OTHER.replace(".", "")
# What a manylinux wheel may take from the system: the manylinux policy's libraries
# (glibc, the GCC runtime, zlib; auditwheel's manylinux-policy.json) and the loader.
SYSTEM_LIBS = {"linux-vdso.so.1", "ld-linux-x86-64.so.2", "libc.so.6", "libm.so.6", "libmvec.so.1",
               "libpthread.so.0", "libdl.so.2", "librt.so.1", "libutil.so.1", "libresolv.so.2", "libanl.so.1",
               "libnsl.so.1", "libatomic.so.1", "libgcc_s.so.1", "libstdc++.so.6", "libz.so.1", "libexpat.so.1"}


def run(argv, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=kw.pop("timeout", 300), **kw)


def files_under(root):
    out = set()
    for d, _, names in os.walk(root):
        for n in names:
            out.add(os.path.relpath(os.path.join(d, n), root))
    return out


class WheelInFreshVenv(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        wheel_dir = os.environ.get("BALLAST_WHEEL_DIR", os.path.join(HERE, "../../build/wheels"))
        wheels = sorted(glob.glob(os.path.join(wheel_dir, f"ballast-*-{TAG}-{TAG}-*.whl")))
        if not wheels:
            raise RuntimeError(f"no {TAG} wheel in {wheel_dir}: `make test` builds it "
                               f"(scripts/build-wheels.sh --out {wheel_dir} {OTHER})")
        cls.wheel = wheels[-1]
        torch_python = os.environ.get("BALLAST_OTHER_TORCH_PYTHON")
        if not torch_python or not os.access(torch_python, os.X_OK):
            raise RuntimeError(f"no torch venv for CPython {OTHER} ({torch_python}): "
                               f"scripts/torch2-venv.sh --python {OTHER} builds it")
        cls.torch_site = run([torch_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                             ).stdout.strip()
        # The venv's base interpreter: pyenv's CPython 3.12.
        with open(os.path.join(os.path.dirname(os.path.dirname(torch_python)), "pyvenv.cfg")) as f:
            home = dict(line.split(" = ", 1) for line in f.read().splitlines() if " = " in line)["home"]
        cls.base_python = os.path.join(home, "python3")
        out_root = os.environ.get("BALLAST_TEST_OUTPUT", "/tmp")
        os.makedirs(out_root, exist_ok=True)
        import tempfile
        cls.tmp = tempfile.mkdtemp(prefix="test_wheel.", dir=out_root)
        cls.venv = os.path.join(cls.tmp, "venv")
        p = run([cls.base_python, "-m", "venv", cls.venv])
        assert p.returncode == 0, p.stderr
        cls.python = os.path.join(cls.venv, "bin", "python")
        cls.site = run([cls.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
        with open(os.path.join(cls.site, "torch-from-cache.pth"), "w") as f:
            f.write(cls.torch_site + "\n")
        cls.before = files_under(cls.venv)
        # A user's environment: no build tree on the path.
        cls.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BALLAST_BIN", "BALLAST_PYTHON")}
        cls.env.update(OMP_NUM_THREADS="1", PATH=os.path.join(cls.venv, "bin") + os.pathsep + os.environ["PATH"])
        p = run([cls.python, "-m", "pip", "install", "--disable-pip-version-check", "--no-index", "--no-deps",
                 cls.wheel], env=cls.env)
        assert p.returncode == 0, p.stdout + p.stderr
        cls.ballast = os.path.join(cls.venv, "bin", "ballast")

    @classmethod
    def tearDownClass(cls):
        import shutil
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_1_the_wheel_is_self_contained_and_one_version(self):
        name = os.path.basename(self.wheel)
        version = name.split("-")[1]
        self.assertRegex(name, rf"^ballast-[0-9.]+-{TAG}-{TAG}-manylinux_2_\d+_x86_64\.whl$")
        p = run([self.ballast, "--version"], env=self.env)
        self.assertEqual((p.returncode, p.stdout.strip()), (0, f"ballast {version}"), p.stderr)
        p = run([self.python, "-c", "import ballast; print(ballast.__version__, ballast.__file__)"], env=self.env)
        self.assertEqual(p.returncode, 0, p.stderr)
        got_version, where = p.stdout.split()
        self.assertEqual(got_version, version)
        self.assertTrue(where.startswith(self.site), where)
        # Every library the binary and the extension load is in the wheel or is glibc/GCC's.
        with zipfile.ZipFile(self.wheel) as z:
            bundled = [n for n in z.namelist() if n.startswith("ballast.libs/")]
        self.assertTrue(any("grpc" in n for n in bundled), bundled)
        for elf in [os.path.join(self.site, "ballast", "_bin", "ballast"),
                    *glob.glob(os.path.join(self.site, "ballast", "_ballast*.so"))]:
            p = run(["ldd", elf])
            self.assertEqual(p.returncode, 0, p.stderr)
            for line in p.stdout.splitlines():
                self.assertNotIn("not found", line, f"{elf}: {p.stdout}")
                lib = line.split()[0]
                m = re.search(r"=> (\S+)", line)
                if m and os.path.realpath(m.group(1)).startswith(os.path.join(self.site, "ballast.libs") + "/"):
                    continue
                self.assertIn(os.path.basename(lib), SYSTEM_LIBS, f"{elf} loads {line.strip()} from the system")

    def test_2_a_two_node_job_with_a_worker_killed_resumes_from_memory(self):
        def launch(name, *flags):
            out = os.path.join(self.tmp, name)
            os.makedirs(out)
            p = run([self.ballast, "launch", "--python", self.python, "--nodes", "2", "--nproc-per-node", "2",
                     *flags, SCRIPT, "--out", out, "--steps", "24", "--persist-every", "0"], env=self.env)
            with open(os.path.join(out, "events.jsonl")) as f:
                events = [json.loads(line) for line in f if line.strip()]
            return p.returncode, p.stdout + p.stderr, events

        rc, log, clean = launch("clean")
        self.assertEqual(rc, 0, log[-6000:])
        rc, log, events = launch("killed", "--chaos", "kill-worker:rank=1,at_step=12")
        self.assertEqual(rc, 0, log[-6000:])
        starts = [e for e in events if e["ev"] == "start"]
        self.assertEqual([s["source"] for s in starts], [None, "memory"], starts)
        self.assertGreaterEqual(starts[1]["step"], 10, starts)
        self.assertTrue(all(s["package"].startswith(self.site) for s in starts), starts)
        self.assertEqual((events[-1]["ev"], events[-1]["step"]), ("done", 24), events[-1])
        self.assertEqual(events[-1]["sha256"], clean[-1]["sha256"])

    def test_3_uninstall_leaves_nothing_behind(self):
        p = run([self.python, "-m", "pip", "uninstall", "-y", "--disable-pip-version-check", "ballast"], env=self.env)
        self.assertEqual(p.returncode, 0, p.stderr)
        left = files_under(self.venv) - self.before
        self.assertEqual(left, set(), "pip uninstall ballast left these behind")
        p = run([self.python, "-c", "import ballast"], env=self.env)
        self.assertNotEqual(p.returncode, 0)
        self.assertFalse(os.path.exists(self.ballast))


if __name__ == "__main__":
    unittest.main()
