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

Chaos drill (``--chaos "nan:rank=R,at_step=S"``): rank R reports a NaN loss
at step S, in the job's first attempt (``restart=K``: the attempt with
TORCHELASTIC_RESTART_COUNT K).
"""

import collections
import math
import os
import sys
import time

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


def _chaos_nan_steps():
    """Steps at which this rank's loss is replaced by NaN (BALLAST_CHAOS nan faults)."""
    spec = os.environ.get("BALLAST_CHAOS", "")
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    steps = set()
    for fault in spec.split(";"):
        kind, _, args = fault.strip().partition(":")
        if kind.strip() != "nan":
            continue
        kv = dict(a.split("=", 1) for a in args.split(",") if "=" in a)
        try:
            if int(kv["rank"]) == rank and int(kv.get("restart", 0)) == attempt:
                steps.add(int(kv["at_step"]))
        except (KeyError, ValueError):
            raise ValueError(f"BALLAST_CHAOS: bad nan fault {fault!r}: nan:rank=R,at_step=S[,restart=K]") from None
    return steps


class _Watch:
    def __init__(self):
        self.mode = os.environ.get("BALLAST_ON_NAN", "rollback")
        if self.mode not in ("rollback", "fail", "ignore"):
            raise ValueError(f"BALLAST_ON_NAN must be rollback, fail or ignore, got {self.mode!r}")
        z = os.environ.get("BALLAST_LOSS_SPIKE", "")
        self.spike_z = float(z) if z else 0.0
        self.recent = collections.deque(maxlen=WINDOW)
        self.chaos = _chaos_nan_steps()
        self.under_agent = bool(os.environ.get("BALLAST_PROGRESS_SHM"))
        self.reported = False

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
