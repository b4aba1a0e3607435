"""Which ``Checkpointer.save`` calls copy: every N-th, or ``auto``.

``save_every="auto"`` (``--save-every auto`` on ``ballast launch`` / ``ballast
run``, which set ``BALLAST_SAVE_EVERY`` for the workers) picks the interval
that loses the least training time, Young/Daly style, from what the job
measures:

* C, the cost of one copied save: the time between a copied save's call and
  the next call, less the time between two calls with no copy in between
  (the blocking copy plus what the persist and replica copies behind it take
  from the next step); before a step without a copy has been seen, the
  blocking copy alone. A process's first save (it sizes and faults the
  memory, once) is left out, and the next call copies to measure a steady one;
* t, the time of a step (between calls without a copy, per step);
* M, the job's mean time between failures: a prior (``--mtbf``,
  ``BALLAST_MTBF_S``; default 1 h) counted as one failure, plus what the job
  saw: M = (W + job age) / (1 + restarts) (the job age from
  ``BALLAST_JOB_START``, the restarts from ``TORCHELASTIC_RESTART_COUNT``).
  W is the prior until the job's first failure; after it, the prior weighs
  no more time than the job has run (W = min(prior, age)), so that two
  faults in three minutes say a failure every ~minute, not every ~20 (a 1 h
  prior counted in full would outweigh the job's own evidence for hours).
  Where the job's age is unknown (no ``BALLAST_JOB_START``), W is the prior.

The interval T = sqrt(2 C M) - C (Daly's first order) minimizes C/T + T/(2M),
the fraction lost to saves plus the expected rollback per failure; in steps
round(T / t), at least 1 and never more than the user's bound (``auto:MAX``;
default 1000). Every rank measures its own costs; at each copied step the
ranks agree on the largest choice N (one all-reduce of an integer), and the
steps that are multiples of N copy: a restore needs a step every rank holds.
It is recomputed at every copy, so it follows the measurements. A failure
loses at most N steps: the state after the last copied step is exact. A call with ``persist=True`` always copies (the step
asked to be on disk must be in memory first), and so do fingerprint check
steps (``--replica-check-every``: the step a silent-data-corruption rollback
returns to).

Example::

    ckpt = ballast.Checkpointer("/ckpt/run1", save_every="auto")
    for step in range(start, steps):
        train_one_batch()
        ckpt.save(step, state)          # copies only when it pays off
"""

import math
import os
import sys
import time

ENV_SAVE_EVERY = "BALLAST_SAVE_EVERY"
ENV_MTBF = "BALLAST_MTBF_S"
ENV_JOB_START = "BALLAST_JOB_START"
DEFAULT_MTBF_S = 3600.0
DEFAULT_AUTO_MAX = 1000
_WINDOW = 16  # recent samples a median is taken over


def parse(spec):
    """(fixed N or None, auto bound or None) of a save_every value: an int
    N >= 1, "N", "auto" or "auto:MAX"; ValueError saying what is allowed."""
    if isinstance(spec, bool):
        raise ValueError(f"save_every must be a step count >= 1, 'auto' or 'auto:MAX', got {spec!r}")
    if isinstance(spec, int):
        if spec < 1:
            raise ValueError(f"save_every must be >= 1 (1: every call copies), got {spec}")
        return spec, None
    text = str(spec).strip()
    if text == "auto":
        return None, DEFAULT_AUTO_MAX
    if text.startswith("auto:"):
        bound = text[5:]
        if not bound.isdigit() or int(bound) < 1:
            raise ValueError(f"save_every {text!r}: the bound after 'auto:' must be a step count >= 1, "
                             "e.g. auto:200")
        return None, int(bound)
    if text.isdigit() and int(text) >= 1:
        return int(text), None
    raise ValueError(f"save_every must be a step count >= 1, 'auto' or 'auto:MAX' (e.g. auto:200), got {spec!r}")


def _median(xs):
    s = sorted(xs)
    n = len(s)
    return 0.0 if n == 0 else (s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2)


def _rank0_log():
    """Where a decision is said: stderr on rank 0 (one line per job), nowhere on the others."""
    if os.environ.get("RANK", "0") == "0":
        return lambda msg: sys.stderr.write(msg + "\n")
    return lambda msg: None


def _env_float(name, default):
    text = os.environ.get(name, "")
    try:
        return float(text) if text else default
    except ValueError:
        raise ValueError(f"${name}={text!r} is not a number of seconds") from None


class SaveInterval:
    """The decision of one Checkpointer (see the module comment).

    Args:
        spec: save_every (None: $BALLAST_SAVE_EVERY, else 1).
        mtbf_s: the prior MTBF (None: $BALLAST_MTBF_S, else 1 h).
        restarts, job_age_s: the failures and age the job had when this
            process started (None: from the environment).
        check_every: fingerprint check interval (None: $BALLAST_REPLICA_CHECK_EVERY under an agent, else off).
        clock: seconds, monotonic (tests pass their own).
        log: where the chosen interval is said (default: stderr, rank 0).
        agree: the interval the world's ranks agree on, from this rank's
            choice (the Checkpointer's: the largest over the process group).
    """

    def __init__(self, spec=None, *, mtbf_s=None, restarts=None, job_age_s=None, check_every=None,
                 clock=time.monotonic, log=None, agree=None):
        if spec is None:
            spec = os.environ.get(ENV_SAVE_EVERY) or 1
        self.fixed, self.bound = parse(spec)
        self.mtbf_prior_s = _env_float(ENV_MTBF, DEFAULT_MTBF_S) if mtbf_s is None else float(mtbf_s)
        if self.mtbf_prior_s <= 0:
            raise ValueError(f"the MTBF prior must be > 0 seconds, got {self.mtbf_prior_s}")
        if restarts is None:
            restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if job_age_s is None:
            start = _env_float(ENV_JOB_START, 0.0)
            job_age_s = max(0.0, time.time() - start) if start > 0 else 0.0
        if check_every is None:
            check_every = int(os.environ.get("BALLAST_REPLICA_CHECK_EVERY", "0") or 0) \
                if os.environ.get("BALLAST_NODE_ID") else 0
        self.restarts = int(restarts)
        self.check_every = int(check_every)
        self._clock = clock
        self._agree = agree if agree is not None else (lambda n: n)
        self._t0 = clock()
        self._age0 = float(job_age_s)
        self._age_known = self._age0 > 0  # from BALLAST_JOB_START (or given)
        self._log = log if log is not None else _rank0_log()
        self.interval = self.fixed or 1   # steps between copies now
        self.last_copied = None           # the newest step copied
        self._last_call = None            # (step, time, whether it copied, its blocking seconds)
        self._plain = []                  # seconds per step between calls without a copy
        self._after_copy = []             # (seconds per step, blocking seconds) after a copied call
        self._blocking = []               # blocking seconds of copied saves
        self._said = None                 # the interval last logged
        self._first_copy = None           # this process's first copied step (its save sizes the memory)

    @property
    def auto(self):
        return self.fixed is None

    def mtbf_s(self):
        """The MTBF estimate now: the prior as one failure, plus the job's own."""
        age = self._age0 + (self._clock() - self._t0)
        weight = self.mtbf_prior_s
        if self.restarts > 0 and self._age_known:
            weight = min(weight, age)  # the job's own failures outweigh the prior (module comment)
        return (weight + age) / (1 + self.restarts)

    def cost(self):
        """(seconds a copied save costs, seconds per step), from the measurements; (0, 0) before any."""
        plain = _median(self._plain)
        blocking = _median(self._blocking)
        if plain > 0 and self._after_copy:
            after = _median([dt for dt, _ in self._after_copy])
            return max(after - plain, blocking, 0.0), plain
        if self._after_copy:
            return blocking, max(_median([dt - b for dt, b in self._after_copy]), 1e-6)
        return blocking, 0.0

    def due(self, step, persist=False):
        """Whether the call for ``step`` copies. Records the call's time once per step."""
        step = int(step)
        now = self._clock()
        last = self._last_call
        if last is not None and step > last[0]:
            per_step = (now - last[1]) / (step - last[0])
            if last[2] and last[0] == self._first_copy:
                pass  # the process's first save sizes its memory once: not what a save costs
            elif last[2]:
                self._after_copy.append((per_step, last[3]))
                del self._after_copy[:-_WINDOW]
            else:
                self._plain.append(per_step)
                del self._plain[:-_WINDOW]
        if last is not None and step == last[0]:
            return last[2]  # asked again for the same step: the same answer
        if self.auto:
            # The multiples of the interval: the same steps on every rank,
            # whatever step a restart resumed at (see _choose).
            due = step % self.interval == 0
        else:
            due = step - self.last_copied >= self.interval if self.last_copied is not None else True
        copy = (self.last_copied is None or persist or step < self.last_copied or due
                or (self.check_every > 0 and step % self.check_every == 0))
        self._last_call = (step, now, copy, 0.0)
        return copy

    def copied(self, step, blocking_s):
        """Records the copy of ``step`` (its blocking seconds) and, with
        ``auto``, chooses the next interval."""
        if self._first_copy is None:
            self._first_copy = int(step)
            blocking_s = None
        self.last_copied = int(step)
        if blocking_s is None:
            if self.auto:
                self.interval = 1  # measure a steady save at the next call
            return
        if self._last_call is not None and self._last_call[0] == int(step):
            self._last_call = self._last_call[:3] + (float(blocking_s),)
        self._blocking.append(float(blocking_s))
        del self._blocking[:-_WINDOW]
        if self.auto:
            self.interval = self._choose()

    def _choose(self):
        c, t = self.cost()
        m = self.mtbf_s()
        best = 1
        if c > 0 and t > 0:
            period = max(math.sqrt(2 * c * m) - c, 0.0) if c < m / 2 else m
            best = int(min(max(round(period / t), 1), self.bound))
        # Every rank must copy the same steps (a restore needs one step that
        # all of them hold), but each measured its own costs: the ranks take
        # the largest choice (``agree``, a collective: every rank calls it at
        # every copied step but a process's first, whatever it measured).
        n = int(self._agree(best))
        if n <= 1 and (c <= 0 or t <= 0):
            return n  # nothing measured yet here: nothing to say
        if self._said is None or n >= 2 * self._said or 2 * n <= self._said:
            self._said = n
            self._log(f"ballast: save_every auto: copying every {n} step(s) (a save costs {c:.3f} s, a step "
                      f"{t:.3f} s, MTBF {m:.0f} s: {self.restarts} restart(s) in {self._age0 + self._clock() - self._t0:.0f} s "
                      f"and the {self.mtbf_prior_s:.0f} s prior)")
        return n


ENV_COPY_SHARE = "BALLAST_CKPT_COPY_SHARE"
DEFAULT_COPY_SHARE = 0.25
_MAX_PERSIST_EVERY = 1024


def parse_share(text):
    """The --ckpt-copy-share value as a float in (0, 1]; ValueError saying what is allowed."""
    try:
        share = float(text)
    except (TypeError, ValueError):
        share = None
    if share is None or not 0 < share <= 1:
        raise ValueError(f"the checkpoint copy share must be a fraction of the time in (0, 1], e.g. 0.25 "
                         f"(1: persist every step asked for), got {text!r}")
    return share


class _SharePace:
    """What PersistPace and ReplicaPace share: the copy share and the step
    time measured between save() calls."""

    def __init__(self, share, clock, log):
        if share is None:
            share = os.environ.get(ENV_COPY_SHARE) or DEFAULT_COPY_SHARE
        self.share = parse_share(share)
        self._clock = clock
        self._log = log if log is not None else _rank0_log()
        self.every = 1            # k: at most one copy per block of k steps
        self._last_call = None    # (step, time) of the previous save() call
        self._steps = []          # seconds per step between save() calls

    def _note_step(self, step):
        now = self._clock()
        if self._last_call is not None and step > self._last_call[0]:
            self._steps.append((now - self._last_call[1]) / (step - self._last_call[0]))
            del self._steps[:-_WINDOW]
        self._last_call = (step, now)

    def _every_for(self, cost, cap):
        """k for copies of ``cost`` seconds: the smallest power of two (at most
        ``cap``) with cost / (k x step) <= share; None while unmeasured or
        with a share of 1."""
        t = _median(self._steps)
        if cost <= 0 or t <= 0 or self.share >= 1:
            return None
        k = 1
        while cost / (k * t) > self.share and k < cap:
            k *= 2
        return k


class PersistPace(_SharePace):
    """Which ``save(step, state, persist=True)`` calls ask the agent to write
    the step to disk: as often as asked, unless the writes would take more
    than ``share`` of the time (``--ckpt-copy-share``, default 0.25).

    A persist is a copy of the whole state to disk by the agent's thread, beside
    training: on a machine whose cores the training uses, it slows the steps
    (memory bandwidth and kernel work, which a lower priority does not give
    back). So with a write of W seconds and steps of t seconds, persists go out
    at most once per k steps, k the smallest power of two with W / (k t) <=
    share: the first ``persist=True`` call of each block of k steps (blocks at
    the multiples of k). The steps a rank leaves out stay in memory; ``wait()``
    asks for the newest of them, so the last step saved with ``persist=True``
    before a ``wait()`` is on disk as before.

    Every rank measures its own W and t, and every rank must write the same
    steps (a step on disk is complete only with every rank's shard). With k a
    power of two that is safe without agreeing: a block of the larger k is a
    union of blocks of a smaller one, so a call first in its block of the larger
    k is first in its smaller block too: the steps the slowest rank writes are
    written by all.

    Args:
        share: the fraction in (0, 1] (None: $BALLAST_CKPT_COPY_SHARE, else
            0.25); 1 persists every step asked for, whatever a write takes.
        clock: seconds, monotonic (tests pass their own).
        log: where a change of k is said (default: stderr, rank 0).
    """

    def __init__(self, share=None, *, clock=time.monotonic, log=None):
        super().__init__(share, clock, log)
        self._writes = []         # seconds the agent took to write a step
        self._durable = 0         # the newest durable step seen
        self._last_persist_call = None  # (step, answer) of the previous persist=True save

    def note(self, step, durable_step=0, write_s=0.0):
        """Records a save() call for ``step`` and what the store says of the
        newest durable step and its write time."""
        step = int(step)
        self._note_step(step)
        if durable_step > self._durable:
            self._durable = int(durable_step)
            if write_s > 0:
                self._writes.append(float(write_s))
                del self._writes[:-_WINDOW]
                self._choose()

    def _choose(self):
        w, t = _median(self._writes), _median(self._steps)
        k = self._every_for(w, _MAX_PERSIST_EVERY)
        if k is not None and k != self.every:
            self.every = k
            self._log(f"ballast: persisting at most once every {k} step(s): a write to disk takes {w:.3f} s, "
                      f"a step {t:.3f} s (writes kept under {self.share:.0%} of the time: --ckpt-copy-share)"
                      if k > 1 else
                      f"ballast: persisting every step asked for again (a write {w:.3f} s, a step {t:.3f} s)")

    def wants(self, step):
        """Whether a ``persist=True`` save of ``step`` asks for the write (see the class comment)."""
        step = int(step)
        prev = self._last_persist_call
        if prev is not None and step == prev[0]:
            return prev[1]  # asked again for the same step: the same answer
        want = prev is None or step // self.every != prev[0] // self.every or step < prev[0]
        self._last_persist_call = (step, want)
        return want


ENV_REPLICA_PEERS = "BALLAST_CKPT_REPLICA_PEERS"
_MAX_REPLICATE_EVERY = 64
# The ranks agree on the interval at the first copied save of each block of
# this many steps (one all-reduce of one integer).
_REPLICA_AGREE_STEPS = 32


class ReplicaPace(_SharePace):
    """Which copied saves the ``ballast run`` agent sends to peer nodes
    (``--ckpt-replicas``): every one, unless sending them would take more than
    ``share`` of the time (``--ckpt-copy-share``, default 0.25).

    A replica is a copy of the rank's whole state over the network by the
    agent's thread, beside training: on a node whose cores training uses it
    slows the steps (measured: +7-20 % of a CPU-bound step with 64 MiB a rank
    and a copy every step). With a copy of P seconds (the agent says how long
    its last one to every holder took) and steps of t seconds, the copies go
    out once per k steps, k the smallest power of two with P / (k t) <= share
    (at most 64): the first copied save of each block of k steps.

    Unlike persists, the ranks must agree on k: a restore after a node loss
    needs one step that every rank holds, the lost node's ranks from their
    replicas and the others from their own memory, where the agent keeps each
    rank's last replicated step. So the ranks take the largest k (``agree``, a
    collective: every rank calls it at the first copied save of each block of
    32 steps). A node loss then resumes from a step up to k saves old.

    Args:
        share: the fraction in (0, 1] (None: $BALLAST_CKPT_COPY_SHARE, else
            0.25); 1 sends every copied save, whatever a copy takes.
        agree: the k the world's ranks agree on, from this rank's (the
            Checkpointer's: the largest over the process group).
        clock: seconds, monotonic (tests pass their own).
        log: where a change of k is said (default: stderr, rank 0).
    """

    def __init__(self, share=None, *, agree=None, clock=time.monotonic, log=None):
        super().__init__(share, clock, log)
        self._agree = agree if agree is not None else (lambda k: k)
        self._puts = []             # seconds the agent took to send a step to its holders
        self._replicated = 0        # the newest replicated step seen
        self._prev = None           # (step, answer) of the previous copied save

    def note(self, step, replicated_step=0, put_s=0.0):
        """Records a save() call for ``step`` and what the store says of the
        newest replicated step and what sending it took."""
        step = int(step)
        self._note_step(step)
        if replicated_step != self._replicated:
            self._replicated = int(replicated_step)
            if put_s > 0:
                self._puts.append(float(put_s))
                del self._puts[:-_WINDOW]

    def wish(self):
        """This rank's k from its own measurements."""
        return self._every_for(_median(self._puts), _MAX_REPLICATE_EVERY) or 1

    def wants(self, step):
        """Whether the copied save of ``step`` asks the agent to send it (see
        the class comment). Call it for every copied save, in order, on every
        rank: it is collective at the first of each block of 32 steps."""
        step = int(step)
        prev = self._prev
        if prev is not None and step == prev[0]:
            return prev[1]  # asked again for the same step: the same answer
        back = prev is not None and step < prev[0]
        if prev is None or back or step // _REPLICA_AGREE_STEPS != prev[0] // _REPLICA_AGREE_STEPS:
            k = max(1, int(self._agree(self.wish())))
            if k != self.every:
                p, t = _median(self._puts), _median(self._steps)
                self._log(f"ballast: copying a step to the peer nodes at most once every {k} step(s): a copy takes "
                          f"{p:.3f} s, a step {t:.3f} s (copies kept under {self.share:.0%} of the time: "
                          f"--ckpt-copy-share)" if k > 1 else
                          f"ballast: copying every saved step to the peer nodes again (a copy {p:.3f} s, a step "
                          f"{t:.3f} s)")
                self.every = k
        want = prev is None or back or step // self.every != prev[0] // self.every
        self._prev = (step, want)
        return want
