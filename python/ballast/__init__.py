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
"""

from ballast._ballast import CheckpointCorruptError
from ballast._tree import Shard
from ballast.checkpoint import Checkpointer, read_checkpoint

__version__ = "0.1.0"

__all__ = ["Checkpointer", "Shard", "CheckpointCorruptError", "read_checkpoint", "__version__"]
