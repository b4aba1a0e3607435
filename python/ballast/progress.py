"""Progress reporting and hang diagnosis for workers run by a ballast agent.

``ballast.step(n)`` (the C function ``ballast._ballast.step``) writes the step
into this worker's shared-memory progress cell, which the agent of
``ballast run`` reads: with ``--hang-timeout S`` a worker whose step stops
changing for S seconds is hung, and the step times feed the master's straggler
detection. Without an agent it only records locally.

Under an agent (``BALLAST_NODE_ID`` set), ``import ballast`` also registers
``faulthandler`` on SIGUSR1 (all threads, to stderr): the agent sends it to a
hung worker's node before killing it, so the Python stacks land in the log.
Plain scripts that import ballast outside an agent keep their SIGUSR1.

Example::

    import ballast
    for step in range(start, steps):
        train_one_batch()
        ballast.step(step)
"""

import atexit
import contextlib
import faulthandler
import os
import signal
import sys

from ballast import _ballast as _C
from ballast import health as _health
from ballast import sampler as _sampler

_record = _C.step
_live = _sampler._live


def step(n, loss=None, model=None):
    """Tells the agent this worker reached training step ``n``; with ``loss``
    (a float or a 0-d tensor) also watches it: a NaN/Inf loss (or, with
    ``--loss-spike``, a spike) rolls the job back to the newest checkpoint
    before step n. With ``model`` (the nn.Module, or a dict of tensors) every
    ``--replica-check-every`` steps its parameters' fingerprint goes to the
    master, which finds a rank whose replica diverged (silent data
    corruption). See ballast.health.

    Two stores into shared memory without ``loss``; a few microseconds with it;
    with ``model``, one pass over the parameters every N steps.

    Example::

        for step in range(start, steps):
            loss = train_one_batch()
            sampler.advance(batch_size)
            ckpt.save(step, state)
            ballast.step(step, loss=loss.item(), model=model)
    """
    if loss is not None:
        _health.observe(n, loss)
    if model is not None:
        _health.observe_model(n, model)
    if _live:
        _sampler.note_report()
    _record(n)


@contextlib.contextmanager
def checkpointing():
    """Marks a checkpoint save: the agent allows its checkpoint grace period
    (BALLAST_HANG_CHECKPOINT_GRACE_S) instead of the hang timeout meanwhile.

    Example::

        with ballast.progress.checkpointing():
            torch.save(state, path)
    """
    _C.progress_checkpoint(True)
    try:
        yield
    finally:
        _C.progress_checkpoint(False)


def state():
    """This worker's progress cell: dict(step, timestamp_ns, checkpoint_ns, reports, cell)."""
    return _C.progress_state()


def _settle_collectives():
    # The training loop is over: tell the agent, whose hang timeout would
    # otherwise count the interpreter's teardown (torch 2.x: 1-4 s on a busy
    # machine) as a step that never came (BALLAST_HANG_EXIT_GRACE_S applies).
    _C.progress_exiting()
    # torch 2.x: a gloo thread drops the last collective's tensors a moment
    # after wait() returned, and needs the GIL to; once the interpreter is
    # finalizing, taking it ends the thread inside a noexcept destructor
    # (std::terminate: the worker aborts after its work is done, and its
    # agent, or torchrun, restarts a job that had finished). Give those threads the GIL
    # before finalization starts. Costs 50 ms at exit, only after torch.distributed was used.
    if "torch.distributed" not in sys.modules:
        return
    import gc
    import time
    gc.collect()
    time.sleep(0.05)


def install_exit_settle():
    """Lets torch's collective threads finish before the interpreter
    finalizes (see _settle_collectives), under any launcher: an agent's
    worker, torchrun's, or a plain process, and marks the worker's progress
    cell as exiting; returns True."""
    atexit.register(_settle_collectives)
    return True


def install_stack_dump_handler():
    """Registers faulthandler on SIGUSR1 (all threads, to stderr) when this
    process runs under a ballast agent; returns whether it did."""
    if not os.environ.get("BALLAST_NODE_ID") or not hasattr(signal, "SIGUSR1"):
        return False
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    except (ValueError, RuntimeError, OSError, AttributeError):
        return False  # e.g. stderr has no file descriptor
    return True
