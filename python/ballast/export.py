"""Exports one step of a Ballast checkpoint as a file plain ``torch.load`` reads,
or as a torch.distributed.checkpoint (DCP) directory.

Run as ``ballast ckpt export DIR --to FILE [--step N] [--rank R] [--full]`` (the
C++ CLI runs this module) or ``python3 -m ballast.export DIR --to FILE ...``.
Sharded tensors (``ballast.Shard``, DTensor and ShardedTensor pieces) become the
rank's local tensor, or with ``--full`` the whole global tensor assembled from
every rank's file.

``--format dcp`` writes the step as a DCP checkpoint directory (torch >= 2.2):
every sharded tensor whole, assembled from every rank's file, the plain values
as rank 0 saved them; ``torch.distributed.checkpoint.load`` reads it into any
world (DCP reshards it onto the DTensors it loads into).

Example::

    ballast ckpt export /ckpt/run1 --step 100 --rank 0 --to model.pt
    python3 -c "import torch; print(torch.load('model.pt').keys())"
    ballast ckpt export /ckpt/run1 --format dcp --to /ckpt/run1-dcp
"""

import argparse
import os
import sys
import warnings

import torch

from ballast import _tree
from ballast._ballast import CheckpointCorruptError
from ballast.checkpoint import read_checkpoint


def _plain(obj):
    """The state with every ballast.Shard replaced by its local tensor."""
    if isinstance(obj, _tree.Shard):
        return obj.tensor
    if isinstance(obj, dict):
        out = type(obj)((k, _plain(v)) for k, v in obj.items())
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = meta
        return out
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(_plain(v) for v in obj)
    return obj


def export(dir, to, step=None, rank=0, full=False):
    """Writes step ``step`` (default: latest) of rank ``rank`` to ``to`` with torch.save.

    Returns the exported step.

    Example::

        from ballast.export import export
        export("/ckpt/run1", "model.pt", step=100, rank=0)
    """
    step, state = read_checkpoint(dir, step, rank, full=full)
    tmp = f"{to}.tmp.{os.getpid()}"
    torch.save(_plain(state), tmp)
    os.replace(tmp, to)
    return step


def export_dcp(dir, to, step=None):
    """Writes step ``step`` (default: latest) as a DCP checkpoint directory ``to``.

    Returns the exported step. The whole state is assembled in this process
    (its memory must hold it).

    Example::

        from ballast.export import export_dcp
        export_dcp("/ckpt/run1", "/ckpt/run1-dcp")
        # in a training script, any world size:
        torch.distributed.checkpoint.load({"model": model.state_dict()}, checkpoint_id="/ckpt/run1-dcp")
    """
    try:
        import torch.distributed.checkpoint as dcp
        save = dcp.save
    except (ImportError, AttributeError):
        raise ValueError(f"--format dcp needs torch >= 2.2 (torch.distributed.checkpoint.save); this is torch "
                         f"{torch.__version__}: pass --python with a newer torch") from None
    if os.path.exists(to) and (not os.path.isdir(to) or os.listdir(to)):
        raise ValueError(f"{to} exists and is not an empty directory: choose another --to (DCP writes a directory)")
    step, state = read_checkpoint(dir, step, 0, full=True)
    tmp = f"{to.rstrip('/')}.tmp.{os.getpid()}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process": it is
        save(_plain(state), checkpoint_id=tmp, no_dist=True)
    if os.path.isdir(to):
        os.rmdir(to)
    os.replace(tmp, to)
    return step


def main(argv=None):
    p = argparse.ArgumentParser(prog="ballast ckpt export",
                                description="Export a checkpoint step as a torch.load-able file.")
    p.add_argument("dir", help="checkpoint directory")
    p.add_argument("--to", required=True, help="output file (.pt), or directory with --format dcp")
    p.add_argument("--format", choices=["pt", "dcp"], default="pt",
                   help="pt: a torch.save file of one rank's state; dcp: a torch.distributed.checkpoint "
                        "directory of the whole state")
    p.add_argument("--step", type=int, default=None, help="step to export (default: latest)")
    p.add_argument("--rank", type=int, default=0, help="rank whose shard to export (default 0)")
    p.add_argument("--full", action="store_true",
                   help="assemble sharded tensors from every rank into whole tensors")
    args = p.parse_args(argv)
    try:
        if args.format == "dcp":
            step = export_dcp(args.dir, args.to, args.step)
        else:
            step = export(args.dir, args.to, args.step, args.rank, args.full)
    except FileNotFoundError as e:
        print(f"ballast ckpt export: {e} (`ballast ckpt ls {args.dir}` lists the steps)",
              file=sys.stderr)
        return 1
    except CheckpointCorruptError as e:
        print(f"ballast ckpt export: {e} (`ballast ckpt verify {args.dir}` checks every file; "
              "export another step with --step)", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"ballast ckpt export: {e}", file=sys.stderr)
        return 1
    if args.format == "dcp":
        print(f"exported step {step} of {args.dir} (every rank, whole tensors) to the DCP checkpoint {args.to}")
    else:
        print(f"exported step {step} rank {args.rank} of {args.dir} to {args.to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
