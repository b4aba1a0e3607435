"""Training health: a bad loss rolls the job back instead of poisoning it.

``ballast.step(step, loss=loss)`` watches this rank's loss: a NaN or Inf
always, and with ``--loss-spike Z`` a loss more than Z robust deviations
(``1.4826 * MAD`` over the last 50 finite losses) above their median. On a
bad loss, under ``ballast run`` / ``ballast launch`` (``--on-nan``, default
``rollback``):

* the worker records the step, the value and the samples the step trained on
  (from an ``ElasticSampler``) in its progress cell and stops making progress
  (it sleeps until its agent stops it), so no newer checkpoint replaces the
  good ones;
* the master rolls every rank back: the agents drop every checkpoint step
  from the bad one on (memory, peer replicas, disk), the workers restart and
  ``Checkpointer.load()`` returns the newest step before it, and the
  ElasticSamplers skip the bad step's samples (``--no-skip-data`` keeps
  them); after ``--max-rollbacks`` (default 3) the job fails naming the rank,
  step and value.

``--on-nan fail`` fails the job instead; ``--on-nan ignore`` only logs.
Without an agent a bad loss raises ``BadLossError`` (``ignore`` logs), so a
plain script does not train on.

Cost: a Python float conversion and, with spikes on, a median over 50
values, a few microseconds a step. ``float()`` of a CUDA tensor waits for
the GPU: pass the ``loss.item()`` you log anyway, or report the loss every
few steps.

Silent data corruption: ``ballast.step(step, model=model)`` fingerprints the
rank's parameters (its local shards under FSDP) every
``--replica-check-every N`` steps (default 100): the sum of their raw bits as
64-bit words (in C++ without the GIL for CPU tensors, on the device for
others), mixed over the parameters in order (a flipped bit always changes
it), and a group key (the parameters' names and local shapes, and for
a DTensor its coordinate on the sharded mesh dimensions): ranks with the same
key must hold the same values (DDP: all ranks; HSDP: each replica group).
The agent sends them to the master, which compares each group: a rank that
disagrees with the majority is blamed, its node excluded and replaced, and
the job rolls back to the newest step at which all fingerprints agreed. Two
replicas that disagree cannot tell which is wrong: the job recomputes from
that step, and fails naming both nodes if they disagree again. One pass over
the parameters (a sum on the device), every N steps.

Chaos drills (``--chaos``), in the job's first attempt (``restart=K``: the
attempt with TORCHELASTIC_RESTART_COUNT K) on the first agent of the rank's
node (``incarnation=K``, as for node faults):
``nan:rank=R,at_step=S`` rank R reports a NaN loss at step S;
``bitflip:rank=R,at_step=S`` rank R flips one bit of its first parameter at
step S (needs ``model=``): a silent divergence only the fingerprints see;
``slow:rank=R,factor=F,at_step=S`` (or ``after=T`` seconds) rank R's forward
passes take F times as long from then on (needs ``model=``): a runtime
straggler, which ``--exclude-stragglers`` replaces.

Runtime stragglers: with ``model=`` (an nn.Module) each rank also times its
forward passes (hooks on the model, or on a DDP wrapper's module, whose
forward does no communication) and publishes the median of the last 16; the
master compares the nodes' slowest ranks: the step time of synchronous
training is the same on every rank, the compute time is not. A node slower
than BALLAST_STRAGGLER_FACTOR (2) x the median is a straggler (``ballast
status``); with ``--exclude-stragglers`` one that stays so for 3 checks in a
row (about 3 s) is excluded and replaced. Cost: two clock reads and a
callback per forward pass; ``BALLAST_COMPUTE_TIMING=0`` turns the timing off
(e.g. for a model under ``torch.compile``, where Python hooks break graphs).
"""

import collections
import hashlib
import math
import os
import sys
import time

import torch

from ballast import _ballast as _C
from ballast import sampler as _sampler

WINDOW = 50       # recent finite losses the spike test looks at
MIN_HISTORY = 10  # losses needed before a spike can be called

_NONFINITE, _SPIKE = 1, 2


class BadLossError(RuntimeError):
    """A NaN/Inf loss (or a spike) reported with ``ballast.step(step, loss=)``
    outside an agent, which would roll the job back.

    Example::

        try:
            ballast.step(step, loss=loss)
        except ballast.BadLossError as e:
            print("stopping:", e)
    """


def _chaos_faults(kind, usage):
    """(text, key=value dict) of BALLAST_CHAOS's faults of `kind` that hit
    this rank in this attempt (restart=K) and agent incarnation (incarnation=K)."""
    spec = os.environ.get("BALLAST_CHAOS", "")
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # The agent's incarnation (ballast launch numbers a node rank's agents):
    # a replacement node's workers start a new count of attempts.
    incarnation = int(os.environ.get("BALLAST_CHAOS_INCARNATION", "1") or 1)
    out = []
    for fault in spec.split(";"):
        name, _, args = fault.strip().partition(":")
        if name.strip() != kind:
            continue
        kv = dict(a.split("=", 1) for a in args.split(",") if "=" in a)
        try:
            if (int(kv["rank"]) == rank and int(kv.get("restart", 0)) == attempt
                    and int(kv.get("incarnation", 1)) == incarnation):
                out.append((fault, kv))
        except (KeyError, ValueError):
            raise ValueError(f"BALLAST_CHAOS: bad {kind} fault {fault!r}: {usage}") from None
    return out


def _chaos_steps(kind):
    """Steps at which a worker fault of `kind` hits this rank (BALLAST_CHAOS)."""
    usage = f"{kind}:rank=R,at_step=S[,restart=K]"
    steps = set()
    for fault, kv in _chaos_faults(kind, usage):
        try:
            steps.add(int(kv["at_step"]))
        except (KeyError, ValueError):
            raise ValueError(f"BALLAST_CHAOS: bad {kind} fault {fault!r}: {usage}") from None
    return steps


def _chaos_slow():
    """(factor, at_step, after_s) of a slow fault on this rank (BALLAST_CHAOS), or None."""
    usage = "slow:rank=R,factor=F,after=T|at_step=S[,restart=K]"
    for fault, kv in _chaos_faults("slow", usage):
        try:
            return (float(kv["factor"]), int(kv["at_step"]) if "at_step" in kv else None,
                    float(kv["after"]) if "after" in kv else None)
        except (KeyError, ValueError):
            raise ValueError(f"BALLAST_CHAOS: bad slow fault {fault!r}: {usage}") from None
    return None


class _ComputeTimer:
    """Times this rank's forward passes with hooks on the model (inside a DDP
    wrapper: its module, whose forward does no communication) and publishes
    the median of the last 16 in the progress cell (compute_ns), for the
    master's runtime straggler check: the step time is the same on every rank
    of synchronous training, the compute time is not. On an accelerator the
    passes are timed with its events, read once they completed."""

    def __init__(self, model, slow):
        inner = getattr(model, "module", None)
        self.module = inner if isinstance(inner, torch.nn.Module) else model
        self.recent = collections.deque(maxlen=16)
        self.calls = 0
        self.t0 = 0
        self.pending = collections.deque()
        self.cuda = any(p.is_cuda for p in self.module.parameters())
        self.slow = slow          # chaos: (factor, at_step, after_s) or None
        self.factor = 1.0
        self.started = time.monotonic()
        self.module.register_forward_pre_hook(self._pre)
        self.module.register_forward_hook(self._post)

    def at_step(self, step):
        if self.slow is None or self.factor != 1.0:
            return
        factor, at_step, after = self.slow
        if (at_step is not None and step >= at_step) or (after is not None and
                                                          time.monotonic() - self.started >= after):
            self.factor = factor
            print(f"ballast chaos: slow: rank {os.environ.get('RANK', '0')}'s forward passes take {factor:g}x as "
                  f"long from step {step} on", file=sys.stderr, flush=True)

    def _pre(self, module, args):
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.t0 = start
        else:
            self.t0 = time.perf_counter_ns()

    def _post(self, module, args, out):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((self.t0, end))
            while self.pending and self.pending[0][1].query():
                a, b = self.pending.popleft()
                self._add(int(a.elapsed_time(b) * 1e6))
            return
        dt = time.perf_counter_ns() - self.t0
        if self.factor != 1.0:  # chaos slow: this rank computes factor x slower
            time.sleep(dt * (self.factor - 1.0) / 1e9)
            dt = time.perf_counter_ns() - self.t0
        self._add(dt)

    def _add(self, ns):
        self.recent.append(ns)
        self.calls += 1
        if self.calls % 4 == 0 or self.calls < 4:
            _C.progress_compute(sorted(self.recent)[len(self.recent) // 2])


class _Watch:
    def __init__(self):
        self.mode = os.environ.get("BALLAST_ON_NAN", "rollback")
        if self.mode not in ("rollback", "fail", "ignore"):
            raise ValueError(f"BALLAST_ON_NAN must be rollback, fail or ignore, got {self.mode!r}")
        z = os.environ.get("BALLAST_LOSS_SPIKE", "")
        self.spike_z = float(z) if z else 0.0
        self.recent = collections.deque(maxlen=WINDOW)
        self.chaos = _chaos_steps("nan")
        self.bitflips = _chaos_steps("bitflip")
        self.check_every = int(os.environ.get("BALLAST_REPLICA_CHECK_EVERY", "100") or 0)
        self.under_agent = bool(os.environ.get("BALLAST_PROGRESS_SHM"))
        self.reported = False
        self.compute = None  # _ComputeTimer, from the first ballast.step(model=) of an nn.Module

    def check(self, step, value):
        """None, or (kind, median, z) when `value` is a bad loss."""
        if not math.isfinite(value):
            return (_NONFINITE, 0.0, 0.0)
        if self.spike_z > 0 and len(self.recent) >= MIN_HISTORY:
            ordered = sorted(self.recent)
            median = ordered[len(ordered) // 2]
            mad = sorted(abs(x - median) for x in ordered)[len(ordered) // 2]
            scale = 1.4826 * max(mad, 1e-3 * abs(median), 1e-12)
            z = (value - median) / scale
            if z > self.spike_z:
                return (_SPIKE, median, z)
        self.recent.append(value)
        return None


_watch = None


def observe(step, loss):
    """ballast.step's loss check (see the module doc)."""
    global _watch
    if _watch is None:
        _watch = _Watch()
    w = _watch
    value = float(loss)
    if w.chaos and step in w.chaos:
        w.chaos.discard(step)
        print(f"ballast chaos: nan: rank {os.environ.get('RANK', '0')} reports a NaN loss at step {step}",
              file=sys.stderr, flush=True)
        value = float("nan")
    bad = w.check(step, value)
    if bad is None:
        return
    kind, median, z = bad
    what = (f"non-finite loss ({value}) at step {step}" if kind == _NONFINITE else
            f"loss spike at step {step}: {value:.6g}, {z:.1f} robust deviations above the median "
            f"{median:.6g} of the last {len(w.recent)} losses (--loss-spike {w.spike_z:g})")
    rank = os.environ.get("RANK", "0")
    if w.mode == "ignore":
        print(f"ballast: rank {rank}: {what} (ignored: --on-nan ignore)", file=sys.stderr, flush=True)
        return
    if not w.under_agent:
        raise BadLossError(f"rank {rank}: {what}; under `ballast run`/`ballast launch` the job would roll back "
                           "to the newest checkpoint before it")
    if w.reported:
        return
    w.reported = True
    r = _sampler.bad_batch() or (0, 0, 0)
    _C.progress_health(kind, step, value, median, z, *r)
    print(f"ballast: rank {rank}: {what}; waiting for the agent to "
          f"{'roll the job back' if w.mode == 'rollback' else 'stop the job'}", file=sys.stderr, flush=True)
    # No more steps (and no newer checkpoint over the good ones) until the
    # agent stops this worker.
    while True:
        time.sleep(3600)


def _tensors(model):
    if hasattr(model, "named_parameters"):
        return list(model.named_parameters())
    if isinstance(model, dict):
        return [(k, v) for k, v in model.items() if isinstance(v, torch.Tensor)]
    raise TypeError(f"ballast.step(model=...) takes an nn.Module or a dict of tensors, not {type(model).__name__}")


def _local(t):
    """(the rank's local tensor, the part of the group key a DTensor adds)."""
    to_local = getattr(t, "to_local", None)
    placements = getattr(t, "placements", None)
    if to_local is None or placements is None:
        return t, ""
    coord = t.device_mesh.get_coordinate() or []
    sharded = [f"{d}:{coord[d]}" for d, p in enumerate(placements) if p.is_shard() and d < len(coord)]
    return to_local(), ",".join(sharded)


def _word_sum(t):
    """The sum of t's raw bits as 64-bit words, mod 2**64 (on the device for
    an accelerator's tensor: as 64, else 32, 16 or 8-bit words)."""
    b = t.detach().contiguous().reshape(-1)
    if b.device.type == "cpu":
        return _C.word_sum(b.data_ptr(), b.numel() * b.element_size())
    raw = b.view(torch.uint8)
    for dtype, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if raw.numel() % width == 0:
            try:
                return int(raw.view(dtype).sum(dtype=torch.int64)) & 0xFFFFFFFFFFFFFFFF
            except RuntimeError:  # a view the storage offset does not allow
                continue
    return int(raw.sum(dtype=torch.int64)) & 0xFFFFFFFFFFFFFFFF


def fingerprint(model):
    """(value, group) of this rank's parameters; see the module doc.

    Example::

        value, group = ballast.health.fingerprint(model)
    """
    value = 0
    key = hashlib.blake2b(digest_size=8)
    with torch.no_grad():
        for name, t in _tensors(model):
            local, coord = _local(t)
            key.update(f"{name}{tuple(local.shape)}{coord};".encode())
            if local.numel():
                value = (value * 1000003 + _word_sum(local)) & 0xFFFFFFFFFFFFFFFF
    return value, int.from_bytes(key.digest(), "little")


def _flip_a_bit(model):
    for name, t in _tensors(model):
        local, _ = _local(t)
        if local.numel() and local.is_floating_point():
            with torch.no_grad():
                first = local.reshape(-1)[:1]
                byte = first.view(torch.uint8)[min(1, first.element_size() - 1):][:1]
                byte.bitwise_xor_(0x10)
            return name
    return None


def observe_model(step, model):
    """ballast.step's parameter check (see the module doc)."""
    global _watch
    if _watch is None:
        _watch = _Watch()
    w = _watch
    if (w.compute is None and w.under_agent and isinstance(model, torch.nn.Module)
            and os.environ.get("BALLAST_COMPUTE_TIMING", "1") != "0"):
        w.compute = _ComputeTimer(model, _chaos_slow())
    if w.compute is not None:
        w.compute.at_step(step)
    if w.bitflips and step in w.bitflips:
        w.bitflips.discard(step)
        name = _flip_a_bit(model)
        print(f"ballast chaos: bitflip: rank {os.environ.get('RANK', '0')} flipped a bit of {name} at step {step}",
              file=sys.stderr, flush=True)
    if not w.under_agent or w.check_every <= 0 or step % w.check_every:
        return
    from ballast import checkpoint  # the Checkpointers' pinned rollback targets move with the checks
    checkpoint._at_check_step(step, w.check_every)
    value, group = fingerprint(model)
    _C.progress_fingerprint(step, value, group)
