"""Ballast: elastic PyTorch training runtime; this package is its Python side.

Flash checkpoint: ``ballast.Checkpointer`` saves a state_dict into shared memory
in the time of a memcpy and persists it to disk asynchronously; under
``ballast run`` the memory survives a worker crash.

Example::

    import ballast
    ckpt = ballast.Checkpointer("/ckpt/run1", keep=3)
    step, state = ckpt.load()                      # (None, None) on a fresh start
    ckpt.save(10, {"model": model.state_dict()}, persist=True)
    ckpt.wait()

Progress: ``ballast.step(n)`` tells the agent the worker reached step n (two
stores into shared memory); ``ballast run --hang-timeout S`` restarts workers
whose progress stops. ``ballast.step(n, loss=loss)`` also watches the loss: a
NaN (or a spike) rolls the job back to the step before it (ballast.health). Under an agent, ``import ballast`` registers faulthandler
on SIGUSR1 so a hung worker's Python stacks reach the log (see ballast.progress).

Data: ``ballast.ElasticSampler`` is a DistributedSampler whose state (epoch and
global position) goes into the checkpoint, so an epoch resumes exactly, on any
world size (see ballast.sampler).
"""

from ballast._ballast import CheckpointCorruptError, __version__
from ballast._tree import Shard
from ballast.checkpoint import Checkpointer, CheckpointLostError, read_checkpoint
from ballast import progress
from ballast.progress import step
from ballast.health import BadLossError
from ballast.sampler import ElasticSampler

progress.install_stack_dump_handler()
progress.install_exit_settle()

__all__ = ["Checkpointer", "Shard", "CheckpointCorruptError", "CheckpointLostError", "read_checkpoint", "step", "progress", "BadLossError",
           "ElasticSampler", "__version__"]
