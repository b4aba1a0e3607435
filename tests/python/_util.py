"""Shared helpers for the ballast Python tests (unittest; run with /usr/bin/python3)."""

import os
import shutil
import socket
import tempfile
import unittest
import warnings

from _ports import free_port  # noqa: F401 (re-exported: tests import it from here)

import torch

import ballast
from ballast import _tree

# dtypes this torch has, for round trips.
DTYPES = [d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    getattr(torch, "complex32", None), torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
    getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None),
) if d is not None]


def random_tensor(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=g).bool()
        if dtype == getattr(torch, "complex32", None):
            # complex32 has few ops in torch 1.13: build it from raw 16-bit halves.
            n = 1
            for d in shape:
                n *= d
            raw = torch.randint(-20000, 20000, (2 * n,), generator=g, dtype=torch.int64)
            return raw.to(torch.int16).view(torch.complex32).reshape(shape)
        if dtype.is_complex:
            return torch.randn(shape, generator=g, dtype=dtype)
        if dtype.is_floating_point:
            return (torch.randn(shape, generator=g) * 100).to(dtype)
        info = torch.iinfo(dtype)
        lo, hi = max(info.min, -(2 ** 62)), min(info.max, 2 ** 62)
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def events(out, rank, kind):
    """The `kind` events rank `rank` logged in <out>/rank<rank>.jsonl
    (tests/integration/scripts/train_ckpt.py's format), oldest first."""
    import json
    path = os.path.join(out, f"rank{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [e for e in (json.loads(line) for line in f if line.strip()) if e["event"] == kind]


def final_hashes(out, world):
    """{rank: the weights' sha256 at its last "done" event} for the ranks of
    a world of `world` that logged one."""
    return {r: events(out, r, "done")[-1]["sha256"] for r in range(world) if events(out, r, "done")}


def assert_resumed_from(test, out, log, step, lost, world):
    """Every rank's last load was of `step`: the ranks in `lost` (a lost
    node's) from a peer's replica, the others from their own memory."""
    for rank in range(world):
        loads = events(out, rank, "load")
        test.assertEqual(loads[-1]["step"], step, f"rank {rank}: {loads}\n{log[-4000:]}")
        want_source = "replica" if rank in lost else "memory"
        test.assertEqual(loads[-1]["source"], want_source, f"rank {rank}: {loads}\n{log[-4000:]}")


def wait_for(what, fn, timeout, interval=0.2):
    """Polls fn() until it returns something true (returned); raises after timeout s."""
    import time
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            last = fn()
            if last:
                return last
        except (OSError, ValueError, KeyError, IndexError) as e:
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def ballast_bin():
    """The ballast binary under test (BALLAST_BIN, else the build's); a
    missing build is a failure, not a skip."""
    path = os.environ.get("BALLAST_BIN", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "../../build/bin/ballast"))
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"no ballast binary at {path}: run `make` (or set BALLAST_BIN)")
    return path


TRAIN_CKPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../integration/scripts/train_ckpt.py")


def launch_train_ckpt(test, out, *extra, steps, step_time, nodes="2", kill_step=None, kill_rank=2, script_args=(),
                      timeout=240):
    """`ballast launch` of train_ckpt.py (real DDP on gloo) on `nodes` nodes x
    2 workers, 2 restarts allowed, with launch flags `extra`, into `out` (the
    script's event logs; its flash checkpoint folder out/ckpt); with
    kill_step, the node of global rank `kill_rank` is lost at that step
    (node_loss.py). The interpreter: BALLAST_PYTHON, else Debian's. Asserts
    that the launch exits 0; returns its output."""
    import subprocess
    os.makedirs(out)
    argv = [ballast_bin(), "launch", "--python", os.environ.get("BALLAST_PYTHON", "/usr/bin/python3"),
            "--nodes", nodes, "--nproc-per-node", "2", "--max-restarts", "2", *extra,
            TRAIN_CKPT, "--out", out, "--ckpt", os.path.join(out, "ckpt"), "--steps", str(steps),
            "--step-time", str(step_time), *script_args]
    if kill_step is not None:
        argv += ["--kill-node-step", str(kill_step), "--kill-rank", str(kill_rank)]
    p = subprocess.run(argv, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout)
    test.assertEqual(p.returncode, 0, p.stdout[-6000:])
    return p.stdout


def torch2_python():
    """The pinned torch 2.x interpreter (BALLAST_TORCH2_PYTHON, the venv `make` builds)."""
    py = os.environ.get("BALLAST_TORCH2_PYTHON", "")
    if not py or not os.access(py, os.X_OK):
        raise AssertionError(f"no torch 2.x interpreter at BALLAST_TORCH2_PYTHON={py!r}: run `make test` (it builds "
                             "the venv with scripts/torch2-venv.sh) or set BALLAST_TORCH2_PYTHON")
    return py


def raw_bytes(t):
    """The tensor's bytes in row-major order (bitwise identity, NaN-safe)."""
    c = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return bytes(c.view(torch.uint8).numpy()) if c.numel() else b""


class TestCase(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ballast-pytest-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self._ckpts = []

    def checkpointer(self, sub="ckpt", **kw):
        c = ballast.Checkpointer(os.path.join(self.tmp, sub), **kw)
        self.addCleanup(c.close)
        return c

    def assertBitwise(self, a, b, what=""):
        self.assertIsInstance(b, torch.Tensor, what)
        self.assertEqual(a.dtype, b.dtype, what)
        self.assertEqual(tuple(a.shape), tuple(b.shape), what)
        self.assertEqual(raw_bytes(a), raw_bytes(b), what)
        nan = (a.is_floating_point() or a.is_complex()) and a.dtype != getattr(torch, "complex32", None) \
            and bool(torch.isnan(a.detach()).any())
        if a.dtype != getattr(torch, "complex32", None) and a.numel() and not nan:
            self.assertTrue(torch.equal(a.detach().cpu().resolve_conj(), b), what)

    def assertStateEqual(self, a, b, path="state"):
        """Same structure, types, plain values and bitwise-equal tensors."""
        if isinstance(a, torch.Tensor):
            self.assertBitwise(a, b, path)
            self.assertEqual(a.requires_grad, b.requires_grad, path)
            return
        if isinstance(a, ballast.Shard):
            self.assertIsInstance(b, ballast.Shard, path)
            self.assertEqual((a.global_shape, a.offsets), (b.global_shape, b.offsets), path)
            self.assertBitwise(a.tensor, b.tensor, path)
            return
        self.assertIs(type(a), type(b), f"{path}: {type(a)} vs {type(b)}")
        if isinstance(a, dict):
            self.assertEqual(list(a.keys()), list(b.keys()), path)
            for k in a:
                self.assertIs(type(k), type(next(x for x in b if x == k)), f"{path} key {k!r}")
                self.assertStateEqual(a[k], b[k], f"{path}/{k}")
            if hasattr(a, "_metadata"):
                self.assertEqual(a._metadata, b._metadata, path)
        elif isinstance(a, (list, tuple)):
            self.assertEqual(len(a), len(b), path)
            for i, (x, y) in enumerate(zip(a, b)):
                self.assertStateEqual(x, y, f"{path}/{i}")
        elif isinstance(a, float) and a != a:
            self.assertTrue(b != b, path)
        else:
            self.assertEqual(a, b, path)


def shm_exists(name):
    return os.path.exists("/dev/shm" + name)
