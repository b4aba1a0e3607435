"""Elastic data sampler: resumes an epoch exactly after restarts and world-size changes.

``ElasticSampler`` is a drop-in for ``torch.utils.data.DistributedSampler``
whose state is global: the epoch and how many samples of the epoch's
permutation the whole world has consumed (the *position*). That state is the
same on every rank, so a checkpoint saved by N ranks resumes on M: the rest of
the epoch's permutation is split among the M ranks and no sample is repeated
or skipped within the epoch.

Example::

    import ballast
    from torch.utils.data import DataLoader

    sampler = ballast.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=4)
    step, state = ckpt.load()
    if state is not None:
        model.load_state_dict(state["model"])
        sampler.load_state_dict(state["sampler"])
    step = step or 0
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)         # the resumed epoch keeps its position
        for x, y in loader:
            train_step(x, y)
            sampler.advance(len(x))      # this rank finished len(x) samples
            step += 1
            ckpt.save(step, {"model": model.state_dict(), "sampler": sampler.state_dict()})
"""

import bisect
import math
import os
import weakref

import torch
from torch.utils.data import Sampler

_STATE_VERSION = 1

# Samplers alive in this process (id -> weak reference; a dict, so that
# ballast.step's `if _live` costs nothing): a bad loss (ballast.step(step,
# loss=)) asks them which samples the bad step trained on (bad_batch()).
_live = {}


def _samplers():
    return [s for s in (r() for r in list(_live.values())) if s is not None]


def _skips_from_env():
    """{epoch: sorted [(begin, end)]} from BALLAST_SKIP_DATA ("epoch:begin:end,...";
    the agent sets it after a rollback: the bad steps' samples)."""
    out = {}
    for item in os.environ.get("BALLAST_SKIP_DATA", "").split(","):
        if not item.strip():
            continue
        try:
            epoch, begin, end = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"BALLAST_SKIP_DATA: bad range {item!r} (expected epoch:begin:end)") from None
        if begin < 0 or end <= begin:
            raise ValueError(f"BALLAST_SKIP_DATA: bad range {item!r} (expected 0 <= begin < end)")
        out.setdefault(epoch, []).append((begin, end))
    for epoch, ranges in out.items():
        ranges.sort()
        merged = []
        for b, e in ranges:
            if merged and b <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((b, e))
        out[epoch] = merged
    return out


def bad_batch():
    """(epoch, begin, end): the global sample positions the step being
    reported trained on, from the first live ElasticSampler; None without one.
    What advance() recorded since the previous ballast.step() report, or,
    when the step is reported before its advance(), the batch about to be
    recorded (the last advance's size)."""
    for sampler in _samplers():
        r = sampler._bad_range()
        if r is not None:
            return r
    return None


def note_report():
    """ballast.step() calls this: the positions reached so far are reported."""
    for sampler in _samplers():
        sampler._reported = (sampler.epoch, sampler.position)


def _default_world():
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d.get_world_size(), d.get_rank()
    return int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))


class ElasticSampler(Sampler):
    """A ``DistributedSampler`` that resumes mid-epoch, on any number of ranks.

    Args:
        dataset: a dataset with ``len()`` (its size must not change).
        num_replicas, rank: this process's share; default torch.distributed's
            world size and rank when it is initialized, else $WORLD_SIZE and
            $RANK, else 1 and 0.
        shuffle: permute the indices with ``torch.randperm`` seeded by
            ``seed + epoch`` (as ``DistributedSampler``).
        seed: the shuffle seed; the same on every rank.
        drop_last: what to do with a remainder that does not split evenly
            (see "The tail" below).

    Iteration: the epoch's permutation (the same as ``DistributedSampler``'s
    for the same seed and epoch) from ``position`` on, split by striding: rank
    r of W gets ``rest[r::W]``. With nothing resumed (position 0), every rank
    gets exactly the indices ``DistributedSampler`` would give it. Because the
    split is strided, when every rank has trained k samples, the world has
    consumed exactly the first ``k * W`` samples of the rest: the position is
    a prefix of the permutation, independent of which rank did what.

    Recording progress: a ``DataLoader`` draws indices ahead of training
    (prefetch, worker processes), so the sampler cannot tell from its own
    iterator what was trained. Call ``advance(n)`` once a step's batch of n
    samples (this rank's, e.g. ``len(x)`` or the loader's ``batch_size``) is
    part of the state you are about to save; the position moves by
    ``n * num_replicas``. ``state_dict()`` then describes exactly the
    samples whose effect the saved model holds.

    The tail: with R samples left and W ranks, each rank gets ``ceil(R / W)``
    indices and the last ``(-R) % W`` slots are padded with the epoch's first
    indices (``drop_last=False``: as ``DistributedSampler``, up to W - 1
    samples are trained twice, in the epoch's last step; the same ones
    whether or not the epoch was resumed), or each rank gets
    ``R // W`` and the last ``R % W`` samples of the permutation are skipped
    (``drop_last=True``). Either way, once a rank's share is consumed the
    epoch is complete (position = ``len(dataset)``): a world of another size
    that resumes from there does not revisit the padding or the dropped tail.

    Epochs: ``set_epoch(e)`` with a new epoch starts it at position 0; with
    the current epoch (as a resumed training loop calls it) it keeps the
    position. A saved state at the end of an epoch resumes as an empty
    iteration of that epoch, then the next one.

    Example::

        sampler = ballast.ElasticSampler(dataset, seed=1)
        loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)
        sampler.load_state_dict(saved)         # e.g. {"epoch": 2, "position": 96, ...}
        for epoch in range(sampler.epoch, 10):
            sampler.set_epoch(epoch)
            for batch in loader:               # this rank's share of samples 96.. of epoch 2
                train(batch)
                sampler.advance(4)             # the last batch may be shorter: capped
    """

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False):
        if num_replicas is None or rank is None:
            world, own = _default_world()
            num_replicas = world if num_replicas is None else num_replicas
            rank = own if rank is None else rank
        num_replicas, rank = int(num_replicas), int(rank)
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, num_replicas={num_replicas})")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.position = 0  # samples of this epoch's permutation the world has consumed
        # Positions a rollback skips (the bad steps' samples), by epoch.
        self._skips = _skips_from_env()
        self._reported = (0, 0)   # (epoch, position) at the last ballast.step() report
        self._last_advance = 0    # global positions the last advance() consumed
        key = id(self)
        _live[key] = weakref.ref(self, lambda _, key=key: _live.pop(key, None))

    # -- the split -------------------------------------------------------------

    @property
    def dataset_size(self):
        return len(self.dataset)

    def _skipped(self, position):
        """The skipped ranges of this epoch that end after `position`."""
        return [(max(b, position), e) for b, e in self._skips.get(self.epoch, ()) if e > position]

    def _rest(self, position):
        """Positions from `position` to the end of the epoch, skipped ones left out."""
        out, at = [], position
        for b, e in self._skipped(position):
            out.extend(range(at, min(b, self.dataset_size)))
            at = max(at, e)
        out.extend(range(at, self.dataset_size))
        return out

    def _forward(self, position, count):
        """The position `count` samples (not skipped) after `position`."""
        for b, e in self._skipped(position):
            if position + count <= b:
                break
            count -= max(0, b - position)
            position = e
        return min(self.dataset_size, position + count)

    def _share(self, position):
        """Indices each rank gets from `position` to the end of the epoch."""
        rest = self.dataset_size - position - sum(min(e, self.dataset_size) - b for b, e in self._skipped(position)
                                                  if b < self.dataset_size)
        if rest <= 0:
            return 0
        return rest // self.num_replicas if self.drop_last else math.ceil(rest / self.num_replicas)

    def permutation(self, epoch=None):
        """The whole order of an epoch (default: the current one), before the split.

        Example::

            order = sampler.permutation(3)   # torch.randperm(n) seeded seed + 3
        """
        epoch = self.epoch if epoch is None else int(epoch)
        n = self.dataset_size
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=g).tolist()

    def __len__(self):
        """How many indices this rank's next iteration yields (the rest of the epoch)."""
        return self._share(self.position)

    def __iter__(self):
        per_rank = self._share(self.position)
        total = per_rank * self.num_replicas
        order = self.permutation()
        rest = [order[i] for i in self._rest(self.position)]
        if total > len(rest):  # pad, as DistributedSampler: with the epoch's first samples
            pad = total - len(rest)
            # The same ones whether or not the epoch was resumed (a resumed
            # job trains exactly what an uninterrupted one would).
            head = [order[i] for i in self._rest(0)[:pad]]
            rest += (head * math.ceil(pad / len(head)))[:pad]
        return iter(rest[self.rank:total:self.num_replicas])

    # -- progress --------------------------------------------------------------

    def set_epoch(self, epoch):
        """Selects the epoch; a different one starts at position 0, the current
        one (after ``load_state_dict``) continues where it stopped.

        Example::

            for epoch in range(sampler.epoch, epochs):
                sampler.set_epoch(epoch)
        """
        epoch = int(epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def advance(self, num_samples):
        """Records that this rank finished training ``num_samples`` more of its
        indices (every rank does the same per step); returns the new position.

        The world's position moves by ``num_samples * num_replicas``; reaching
        this rank's share (a short or padded last batch, or any larger count)
        completes the epoch. Call it after the step whose effect goes into the
        checkpoint, before ``state_dict()``.

        Example::

            for x, y in loader:
                train_step(x, y)
                sampler.advance(len(x))
                ckpt.save(step, {"model": model.state_dict(), "sampler": sampler.state_dict()})
        """
        n = int(num_samples)
        if n < 0:
            raise ValueError(f"num_samples must be >= 0, got {n}")
        if n == 0:
            return self.position
        before = self.position
        if n >= self._share(self.position):
            self.position = self.dataset_size
        else:
            self.position = self._forward(self.position, n * self.num_replicas)
        self._last_advance = n * self.num_replicas
        self._advanced_from = (self.epoch, before)
        return self.position

    def _bad_range(self):
        """See bad_batch()."""
        epoch, pos = self._reported
        if (self.epoch, self.position) != (epoch, pos):
            begin = pos if epoch == self.epoch else getattr(self, "_advanced_from", (self.epoch, 0))[1]
            return (self.epoch, begin, self.position) if self.position > begin else None
        if self._last_advance and self.position < self.dataset_size:
            return (self.epoch, self.position, self._forward(self.position, self._last_advance))
        return None

    @property
    def epoch_done(self):
        """Whether nothing of the current epoch is left for this world."""
        return self._share(self.position) == 0

    # -- state -----------------------------------------------------------------

    def state_dict(self):
        """The global sampling state, as plain Python values (the same on every rank).

        ``{"epoch", "position", "seed", "shuffle", "dataset_size", "version"}``:
        position counts the samples of the epoch's permutation the whole world
        has consumed (recorded with ``advance``).

        Example::

            ckpt.save(step, {"model": model.state_dict(), "sampler": sampler.state_dict()})
        """
        return {"version": _STATE_VERSION, "epoch": self.epoch, "position": self.position,
                "seed": self.seed, "shuffle": self.shuffle, "dataset_size": self.dataset_size}

    def load_state_dict(self, state):
        """Restores a ``state_dict()``, saved by any rank of any world size.

        Raises ValueError when the state was saved for a dataset of another
        size (its permutation would differ) or is malformed.

        Example::

            step, state = ckpt.load()
            if state is not None:
                sampler.load_state_dict(state["sampler"])
        """
        try:
            version = int(state.get("version", _STATE_VERSION))
            epoch, position = int(state["epoch"]), int(state["position"])
            seed, shuffle = int(state["seed"]), bool(state["shuffle"])
            size = int(state.get("dataset_size", self.dataset_size))
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not an ElasticSampler state: {state!r} ({e})") from None
        if version > _STATE_VERSION:
            raise ValueError(f"ElasticSampler state version {version} is newer than this "
                             f"ballast's ({_STATE_VERSION})")
        if size != self.dataset_size:
            raise ValueError(f"the sampler state was saved for a dataset of {size} samples, "
                             f"this one has {self.dataset_size}: the permutation would differ")
        if not 0 <= position <= size or epoch < 0:
            raise ValueError(f"sampler state out of range: epoch {epoch}, position {position} "
                             f"of {size}")
        self.epoch, self.position, self.seed, self.shuffle = epoch, position, seed, shuffle

    def __repr__(self):
        return (f"ElasticSampler(epoch={self.epoch}, position={self.position}/{self.dataset_size}, "
                f"rank={self.rank}/{self.num_replicas}, shuffle={self.shuffle}, seed={self.seed}, "
                f"drop_last={self.drop_last})")
