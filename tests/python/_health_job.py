"""A 2-node job of tests/integration/scripts/health_train.py under
`ballast launch`, for the training-health and chaos-drill tests."""

import json
import os
import subprocess

from _util import TestCase, ballast_bin

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = ballast_bin()
PYTHON = os.environ.get("BALLAST_PYTHON", "/usr/bin/python3")
SCRIPT = os.path.join(HERE, "../integration/scripts/health_train.py")
GLOBAL_BATCH = 4 * 4  # --batch 4 on each of 4 ranks


class HealthJob(TestCase):
    def launch(self, name, *flags, script_args=(), env=None, nodes=2, nproc=2):
        """(exit code, log, rank 0's events, output dir) of a nodes x nproc job."""
        out = os.path.join(self.tmp, name)
        os.makedirs(out)
        argv = [BIN, "launch", "--python", PYTHON, "--nodes", str(nodes), "--nproc-per-node", str(nproc), *flags,
                SCRIPT, "--out", out, *script_args]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=240,
                           env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
        log = p.stdout + p.stderr
        events = []
        if os.path.exists(os.path.join(out, "events.jsonl")):
            with open(os.path.join(out, "events.jsonl")) as f:
                events = [json.loads(line) for line in f if line.strip()]
        return p.returncode, log, events, out

    def reference(self, skip, script_args=(), name="reference", **shape):
        """The same job, no fault, `skip` samples skipped from the start."""
        rc, log, events, _ = self.launch(name, env={"BALLAST_SKIP_DATA": skip}, script_args=script_args,
                                         **shape)
        self.assertEqual(rc, 0, log[-6000:])
        return events[-1]
