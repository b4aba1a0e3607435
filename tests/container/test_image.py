"""The container image as the Dockerfile builds it: Debian 12 (a base made here
with debootstrap from Debian's packages, scripts/container-base.sh), the cp311
wheel pip-installed into a venv beside Debian's torch 1.13 (the Dockerfile's
runtime stage; WHEELS=context takes the wheel `make test` built instead of
compiling it in a build stage), built with buildah. Then, in containers of the
image: `ballast --version`, and a 2 nodes x 1 worker DDP job with flash
checkpoints, the sampler and a worker killed, which resumes from memory.

Build and containers run with buildah's chroot isolation inside a network
namespace made here with only loopback (the build fetches nothing: the base
has the runtime packages, the wheel is self-contained). Not crun: on these
machines it can neither set a container's rlimits (no CAP_SYS_RESOURCE) nor
use cgroups in hybrid mode. Run with /usr/bin/python3; needs root.
"""

import glob
import json
import os
import shutil
import subprocess
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "../.."))
SCRIPTS = os.path.join(ROOT, "tests/integration/scripts")


def run(argv, timeout=600, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def loopback_only(argv):
    """argv run in a new network namespace whose only interface is loopback."""
    return ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]


class DockerfileImage(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        wheel_dir = os.environ.get("BALLAST_WHEEL_DIR", os.path.join(ROOT, "build/wheels"))
        wheels = sorted(glob.glob(os.path.join(wheel_dir, "ballast-*-cp311-cp311-*.whl")))
        if not wheels:
            raise RuntimeError(f"no cp311 wheel in {wheel_dir}: `make test` builds it "
                               f"(scripts/build-wheels.sh --out {wheel_dir} 3.11)")
        p = run([os.path.join(ROOT, "scripts/container-base.sh")], timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"scripts/container-base.sh failed:\n{p.stderr}")
        cls.base = p.stdout.strip()
        out_root = os.environ.get("BALLAST_TEST_OUTPUT", "/tmp")
        os.makedirs(out_root, exist_ok=True)
        cls.tmp = tempfile.mkdtemp(prefix="test_image.", dir=out_root)
        # The build context: only what WHEELS=context reads (dist/).
        ctx = os.path.join(cls.tmp, "context")
        os.makedirs(os.path.join(ctx, "dist"))
        shutil.copy(wheels[-1], os.path.join(ctx, "dist"))
        cls.wheel = os.path.basename(wheels[-1])
        cls.image = f"localhost/ballast-test:{os.getpid()}"
        cls.containers_before = cls.storage_containers()
        p = run(loopback_only(["buildah", "build", "--isolation", "chroot", "-f",
                               os.path.join(ROOT, "Dockerfile"), "--build-arg", f"BASE={cls.base}",
                               "--build-arg", "WHEELS=context", "-t", cls.image, ctx]), timeout=900)
        cls.build_log = p.stdout + p.stderr
        if p.returncode != 0:
            cls.tearDownClass()  # unittest skips it when setUpClass fails
            raise RuntimeError(f"buildah build of the Dockerfile failed:\n{cls.build_log[-6000:]}")

    @staticmethod
    def storage_containers():
        p = run(["podman", "ps", "--all", "--external", "--format", "{{.ID}}"])
        return set(p.stdout.split())

    @classmethod
    def tearDownClass(cls):
        run(["buildah", "rmi", "--force", cls.image])
        # buildah 1.28 leaves a working container of the `wheels` stage behind (its
        # COPY --from): remove the ones this build made, then the stage images.
        for ctr in cls.storage_containers() - cls.containers_before:
            run(["podman", "rm", "--force", ctr])
        run(["buildah", "rmi", "--prune"])
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def container_run(self, *argv, volumes=(), timeout=300):
        """argv in a new container of the image (its environment: PATH has the venv's bin/)."""
        p = run(["buildah", "from", self.image])
        self.assertEqual(p.returncode, 0, p.stderr)
        ctr = p.stdout.strip()
        self.addCleanup(run, ["buildah", "rm", ctr])
        vols = [a for src, dst in volumes for a in ("-v", f"{src}:{dst}")]
        return run(loopback_only(["buildah", "run", "--isolation", "chroot", "-e", "OMP_NUM_THREADS=1", *vols, ctr,
                                  "--", *argv]), timeout=timeout)

    def test_1_version_and_import(self):
        version = self.wheel.split("-")[1]
        p = self.container_run("ballast", "--version")
        self.assertEqual((p.returncode, p.stdout.strip()), (0, f"ballast {version}"), p.stderr)
        # The build stage was skipped (WHEELS=context): nothing compiled in the image.
        self.assertNotIn("build-wheels.sh", self.build_log)

    def test_2_a_job_with_a_worker_killed_resumes_from_memory(self):
        out = os.path.join(self.tmp, "job")
        os.makedirs(out)
        p = self.container_run("ballast", "launch", "--python", "python", "--nodes", "2", "--nproc-per-node", "1",
                            "--chaos", "kill-worker:rank=1,at_step=8", "/job/health_train.py", "--out", "/out",
                            "--steps", "16", "--persist-every", "0",
                            volumes=((SCRIPTS, "/job:ro"), (out, "/out")))
        log = p.stdout + p.stderr
        self.assertEqual(p.returncode, 0, log[-6000:])
        with open(os.path.join(out, "events.jsonl")) as f:
            events = [json.loads(line) for line in f if line.strip()]
        starts = [e for e in events if e["ev"] == "start"]
        self.assertEqual([s["source"] for s in starts], [None, "memory"], starts)
        self.assertTrue(all(s["package"].startswith("/opt/ballast/") for s in starts), starts)
        self.assertEqual((events[-1]["ev"], events[-1]["step"]), ("done", 16), events[-1])


if __name__ == "__main__":
    unittest.main()
