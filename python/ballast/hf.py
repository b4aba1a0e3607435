"""Hugging Face Trainer integration: one line turns Ballast on.

::

    from ballast.hf import BallastCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[BallastCallback("/ckpt/run1")])
    trainer.train()

Run the script under ``ballast run`` / ``ballast launch`` (or torchrun). The
callback then

* flash-saves the model, the optimizer, the LR scheduler, the Trainer's state
  and every RNG state every ``save_every`` optimizer steps (a memory copy;
  with ``persist_every`` the step is also written to disk in the background);
* reports each step to the agent (``ballast.step``: hang detection, goodput,
  the replica fingerprints that find silent data corruption, and the step's
  loss, so a NaN/Inf loss or, with ``--loss-spike``, a spike rolls the job
  back to the newest step before it; the Trainer replays its own data order
  then, so a bad loss the data itself causes comes back, and the job fails
  after ``--max-rollbacks``);
* resumes on every start from the newest step that memory, a peer node's
  replica or the disk holds: ``trainer.train()`` without
  ``resume_from_checkpoint`` goes through the Trainer's own resume path
  (its data skip, its RNG restore, its epoch and step counters), with the
  state read from Ballast's checkpoint instead of a ``checkpoint-N``
  directory. A world of another size loads it too (DDP: every rank holds the
  model; FSDP2: the DTensors are resharded).

The Trainer's own ``save_strategy`` checkpoints keep working beside it; an
explicit ``trainer.train(resume_from_checkpoint=...)`` wins over Ballast's.
"""

import dataclasses
import functools
import inspect
import json
import os
import random
import shutil
import tempfile

import torch

try:
    from transformers import Trainer, TrainerCallback
except ImportError as e:  # pragma: no cover - a clear error for a missing dependency
    raise ImportError(f"ballast.hf needs Hugging Face transformers ({e}): pip install transformers") from None

from ballast import save_policy as _save_policy
from ballast.checkpoint import Checkpointer
from ballast.progress import step as report_step

_TRAINER_STATE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME


def _rng_state():
    out = {"python": random.getstate(), "cpu": torch.random.get_rng_state()}
    try:
        import numpy as np
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached": float(cached)}
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.random.get_rng_state_all()
    return out


def _set_rng_state(s):
    version, internal, gauss = s["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.random.set_rng_state(s["cpu"])
    if "numpy" in s:
        import numpy as np
        n = s["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"]))
    if "cuda" in s and torch.cuda.is_available():
        states = s["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.random.set_rng_state_all(states)


def _find_trainer():
    """The Trainer whose __init__ is calling on_init_end (up the stack)."""
    frame = inspect.currentframe()
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj
        frame = frame.f_back
    return None


class BallastCallback(TrainerCallback):
    """Flash checkpoints, step reports and resume for a Hugging Face Trainer.

    Args:
        dir: the checkpoint directory (default: ``$BALLAST_CKPT_DIR``, else
            ``<output_dir>/ballast``).
        save_every: flash-save every this many optimizer steps (default 1:
            a failure then loses at most the step in flight), or ``"auto"`` /
            ``"auto:MAX"``: the interval that loses the least training time,
            from the measured save cost, step time and failure rate
            (ballast.save_policy).
        persist_every: also write every this-many-th saved step to disk, in
            the background (default: none; under an agent the master's
            persist policy and a dying worker's breakpoint save still apply).
        keep: steps kept on disk.
        trainer: the Trainer, when the callback is added after it was built
            (``trainer.add_callback(BallastCallback(trainer=trainer))``);
            passed in ``Trainer(callbacks=[...])`` it finds the Trainer itself.

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[BallastCallback()])
        trainer.train()   # resumes from Ballast's newest step on a restart
    """

    def __init__(self, dir=None, *, save_every=1, persist_every=None, keep=3, trainer=None):
        fixed, _ = _save_policy.parse(save_every)  # ValueError saying what is allowed
        if fixed is not None:
            save_every = fixed
        if persist_every is not None and persist_every < 1:
            raise ValueError(f"persist_every must be >= 1 or None, got {persist_every}")
        self.dir = dir
        self.save_every = save_every
        self.persist_every = persist_every
        self.keep = keep
        self.ckpt = None
        self.resumed_step = None  # the step the last train() resumed from (None: a fresh start)
        self._trainer = None
        self._restore = None      # (directory handed to the Trainer, loaded state)
        self.reserved_bytes = None  # what Checkpointer.reserve sized the memory for (save_every > 1)
        self._loss = None         # the running step's loss (Trainer.training_step's, summed)
        if trainer is not None:
            self.attach(trainer)

    # -- wiring ------------------------------------------------------------

    def on_init_end(self, args, state, control, **kwargs):
        if self._trainer is None:
            trainer = _find_trainer()
            if trainer is None:
                raise RuntimeError("BallastCallback could not find its Trainer: pass it, "
                                   "BallastCallback(trainer=trainer), when adding the callback later")
            self.attach(trainer)

    def attach(self, trainer):
        """Routes the Trainer's resume through Ballast's checkpoint."""
        if self._trainer is trainer:
            return
        self._trainer = trainer
        train = trainer.train

        @functools.wraps(train)
        def train_with_resume(resume_from_checkpoint=None, *args, **kwargs):
            self._cleanup()
            self.resumed_step = None
            self._loss = None
            if resume_from_checkpoint is None or resume_from_checkpoint is False:
                resume_from_checkpoint = self._restore_point(trainer) or None
            try:
                return train(resume_from_checkpoint, *args, **kwargs)
            finally:
                self._cleanup()

        trainer.train = train_with_resume
        training_step = trainer.training_step

        @functools.wraps(training_step)
        def training_step_watched(*args, **kwargs):
            # The step's loss, summed over its gradient-accumulation batches,
            # for on_step_end to report (the Trainer passes callbacks none).
            loss = training_step(*args, **kwargs)
            if isinstance(loss, torch.Tensor):
                loss = loss.detach()
                self._loss = loss if self._loss is None else self._loss + loss
            return loss

        trainer.training_step = training_step_watched
        for name in ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state", "_load_scaler"):
            setattr(trainer, name, self._loader(name, getattr(trainer, name)))

    def _checkpointer(self, args):
        if self.ckpt is None:
            d = self.dir or os.environ.get("BALLAST_CKPT_DIR") or os.path.join(args.output_dir, "ballast")
            self.ckpt = Checkpointer(d, keep=self.keep,
                                     save_every=None if isinstance(self.save_every, int) else self.save_every)
        return self.ckpt

    def _restore_point(self, trainer):
        """A directory holding the Trainer's state of Ballast's newest step
        (the Trainer reads it to skip the data trained on), or None."""
        step, state = self._checkpointer(trainer.args).load()
        if state is None:
            return None
        d = tempfile.mkdtemp(prefix=f"ballast-hf-step{step}-")
        with open(os.path.join(d, _TRAINER_STATE), "w") as f:
            f.write(state["trainer_state"])
        self._restore = (d, state)
        self.resumed_step = step
        return d

    def _loader(self, name, original):
        """The Trainer's loader `name`, reading Ballast's state when asked for
        the restore point's directory."""
        def load(checkpoint=None, *args, **kwargs):
            if self._restore is None or checkpoint != self._restore[0]:
                return original(checkpoint, *args, **kwargs)
            state, trainer = self._restore[1], self._trainer
            if name == "_load_from_checkpoint":
                model = args[0] if args else kwargs.get("model") or trainer.model
                model.load_state_dict(state["model"])
            elif name == "_load_optimizer_and_scheduler":
                trainer.optimizer.load_state_dict(state["optim"])
                if state.get("sched") is not None and trainer.lr_scheduler is not None:
                    trainer.lr_scheduler.load_state_dict(state["sched"])
            elif name == "_load_rng_state":
                _set_rng_state(state["rng"])
            elif name == "_load_scaler" and state.get("scaler") is not None:
                scaler = getattr(trainer.accelerator, "scaler", None)
                if scaler is not None:
                    scaler.load_state_dict(state["scaler"])
        return load

    def _cleanup(self):
        if self._restore is not None:
            shutil.rmtree(self._restore[0], ignore_errors=True)
            self._restore = None

    # -- training ------------------------------------------------------------

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        step = state.global_step
        # With the model: its replicas' fingerprints are compared every
        # --replica-check-every steps (silent data corruption); with the loss:
        # a NaN/Inf (or a spike) rolls the job back (ballast.health).
        loss, self._loss = self._loss, None
        # float() of a GPU tensor waits for the device; the Trainer's own NaN
        # filter (logging_nan_inf_filter, on by default) already does each step.
        report_step(step, loss=None if loss is None else float(loss), model=model)
        ckpt = self._checkpointer(args)
        persist = self.persist_every is not None and step % self.persist_every == 0
        due = ckpt.due(step, persist) if not isinstance(self.save_every, int) else step % self.save_every == 0
        if not due:
            if self.reserved_bytes is None:
                # The first step created the optimizer's state: size and fault
                # the shared memory for it now, so the first save only copies.
                self.reserved_bytes = ckpt.reserve(self._snapshot(state, model, optimizer, lr_scheduler))
            return
        ckpt.save(step, self._snapshot(state, model, optimizer, lr_scheduler), persist=persist)

    def _snapshot(self, state, model, optimizer, lr_scheduler):
        """What a save holds: everything the Trainer's own checkpoint has."""
        snapshot = {
            "model": model.state_dict(),
            "optim": optimizer.state_dict(),
            "sched": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True),  # as save_to_json writes it
            "rng": _rng_state(),
        }
        scaler = getattr(getattr(self._trainer, "accelerator", None), "scaler", None)
        if scaler is not None:
            snapshot["scaler"] = scaler.state_dict()
        return snapshot

    def on_train_end(self, args, state, control, **kwargs):
        if self.ckpt is not None:
            self.ckpt.wait()  # the steps asked to persist are on disk
