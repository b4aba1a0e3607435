"""Flash checkpoint: save a state_dict to shared memory in the time of a memcpy.

See ``Checkpointer`` for the API. Two modes, same API:

* Under ``ballast run`` the agent creates one shared-memory store per local
  rank and names it in ``BALLAST_CKPT_SHM``. The store outlives this worker, so
  after a crash the restarted worker loads from memory; the agent persists
  requested steps to disk (and does a "breakpoint save" when a worker dies) and
  the master commits steps globally.
* Without an agent the Checkpointer creates its own store (unlinked when it is
  closed or the interpreter exits) and persists on a thread of this process;
  memory then does not survive the process, disk does.
"""

import ctypes
import functools
import glob
import math
import os
import re
import secrets
import sys
import time
import warnings
import weakref

import torch

from ballast import _ballast as _C
from ballast import _dtensor, _tree
from ballast import save_policy as _save_policy
from ballast._tree import Shard

CheckpointCorruptError = _C.CheckpointCorruptError

ENV_SHM = "BALLAST_CKPT_SHM"
# The stores of the replicas this node holds for other ranks (set by the agent).
ENV_REPLICAS = "BALLAST_CKPT_REPLICAS"
_DEFAULT_WAIT_S = 600.0
# How long a load waits for the agent to copy in a peer node's replica (its fetch gives up after 30 s).
_INCOMING_WAIT_S = 60.0
# save(blocking=False) copies tensors smaller than this at the call: buffers
# that forward updates in place (BatchNorm statistics) are small.
_ASYNC_CLONE_BYTES = 1 << 20
# The rollback target of silent data corruption (see _at_check_step): how long
# a check step waits to hear the previous check's verdict before it keeps the
# older target instead, and whether a newly agreed target is also persisted.
ENV_SDC_WAIT = "BALLAST_SDC_AGREE_WAIT_S"
ENV_SDC_PERSIST = "BALLAST_SDC_PERSIST"
_TARGET_PERSIST_WAIT_S = 10.0
# Checkpointers under an agent: ballast.step's fingerprint checks pin their targets.
_under_agent = weakref.WeakSet()
_sdc_warned = False


def _wait_agreed(step, timeout):
    """Waits until the agent heard that every rank's fingerprints agreed at
    ``step`` (or a newer one); the newest agreed step it heard."""
    agreed = _C.progress_sdc_agreed()
    if agreed >= step:
        return agreed
    _C.progress_sdc_wait(step)  # the agent asks the master at once, and again while we wait
    try:
        deadline = time.monotonic() + timeout
        pause = 0.001
        while agreed < step and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
            agreed = _C.progress_sdc_agreed()
    finally:
        _C.progress_sdc_wait(0)
    return agreed


def _at_check_step(step, every):
    """ballast.step's fingerprint check at ``step`` (every ``every`` steps),
    before the fingerprint goes out: keeps each Checkpointer's rollback target
    for silent data corruption pinned in memory.

    The master rolls a corrupt job back to the newest step at which every
    rank's fingerprints agreed (SdcChecker). Two slots that rotate with every
    save would lose that step after two saves, so each Checkpointer keeps
    pinned (``_pins``) the save it made at or before the newest agreed check
    step (the target; also persisted, for a node that replaces a corrupt one)
    and the one at or before the newest check step not judged yet (the next
    target). A new check step moves them on only once the previous check's
    verdict is heard, so every rank pins the same steps whatever the timing;
    the wait is normally one report to the master, since that check is
    ``every`` steps old. A verdict not heard in BALLAST_SDC_AGREE_WAIT_S (10 s;
    a master restarting) keeps the older target pinned instead."""
    global _sdc_warned
    ckpts = [c for c in list(_under_agent) if c._res.store is not None]
    if not ckpts:
        return
    agreed = _C.progress_sdc_agreed()
    prev = step - every
    # The previous check covers a target not yet agreed: hear its verdict first.
    if prev > agreed and any(c._pins and c._pins[-1][0] > agreed and prev >= c._pins[-1][0] for c in ckpts):
        timeout = float(os.environ.get(ENV_SDC_WAIT, "10") or 10)
        agreed = _wait_agreed(prev, timeout)
        if agreed < prev and not _sdc_warned:
            _sdc_warned = True
            warnings.warn(f"ballast: the master's verdict on step {prev}'s parameter fingerprints did not come in "
                          f"{timeout:g} s ({ENV_SDC_WAIT}); the rollback target stays the checkpoint of step "
                          f"{agreed} or before")
    for c in ckpts:
        c._pin_check(step, agreed)


def _dist():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed
    return None


class CheckpointLostError(RuntimeError):
    """No checkpoint covers some ranks of the new world while others hold a
    newer step: starting over would silently lose that training. Raised by
    ``Checkpointer.load()`` unless a fresh start was allowed
    (``load(allow_fresh_start=True)`` or ``BALLAST_ALLOW_FRESH_START=1``).
    Under an agent the job then fails with this message (it is not retried)."""


def _ranges(ranks):
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, run = [], []
    for r in sorted(ranks):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [r]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out)


def _all_gather_int(d, value, world):
    """Every rank's `value` (an int), in rank order."""
    t = torch.tensor([value], dtype=torch.int64)
    if d.get_backend() == "nccl":
        t = t.cuda()
    parts = [torch.zeros_like(t) for _ in range(world)]
    d.all_gather(parts, t)
    return [int(p.item()) for p in parts]


def _all_reduce_min(d, values):
    """The element-wise minimum of `values` (ints) over the world's ranks."""
    t = torch.tensor(values, dtype=torch.int64)
    if d.get_backend() == "nccl":
        t = t.cuda()
    d.all_reduce(t, op=d.ReduceOp.MIN)
    return [int(x) for x in t]


def _read_doc(snap):
    """The tree document of a snapshot ({"tree": ...}); a flat dict for foreign images."""
    entries = snap.entries()
    for i, (key, dtype, _shape, _n) in enumerate(entries):
        if key == _tree.TREE_KEY and dtype == "blob":
            return _tree.parse_header(snap.read_bytes(i), snap.source)
    # An image written without the Python layer: every entry at top level.
    items = []
    for key, dtype, _shape, _n in entries:
        items.append([key, {"B": key} if dtype == "blob" else {"t": key}])
    return {"tree": {"d": items}}


class _Image:
    """One snapshot with its decoded tree and an index by entry key."""

    def __init__(self, snap):
        self.snap = snap
        self.doc = _read_doc(snap)
        self.index = {e[0]: (i, e[1], tuple(e[2]), e[3]) for i, e in enumerate(snap.entries())}
        self.specs = {}  # the load's slices for this image (set by _memory_usable)

    @property
    def source(self):
        return self.snap.source

    def entry(self, key):
        try:
            return self.index[key]
        except KeyError:
            raise CheckpointCorruptError(
                f"checkpoint {self.source}: its state tree names entry '{key}', which is missing"
            ) from None

    def shard_nodes(self):
        """{key: (global_shape, offsets, shape)} of every tensor and Shard in the tree."""
        refs = []
        _tree.walk_refs(self.doc["tree"], refs)
        out = {}
        for node in refs:
            if "s" in node:
                shape = self.entry(node["s"])[2]
                out[node["s"]] = (tuple(node["gs"]), tuple(node["go"]), shape)
            elif "t" in node:
                shape = self.entry(node["t"])[2]
                out[node["t"]] = (shape, (0,) * len(shape), shape)
        return out

    def geometry(self):
        """{key: (global shape, mesh shape, placement codes)} of the saved DTensor pieces."""
        refs = []
        _tree.walk_refs(self.doc["tree"], refs)
        return _dtensor.geometry_of(refs)

    def _private(self):
        """(a private copy-on-write mapping of this image's data, see
        _PrivateData in the bindings; the entries' offsets in it), or None
        when the image is not a shared-memory slot's."""
        if not hasattr(self, "_private_data"):
            priv = self.snap.private_data()
            self._private_data = None if priv is None else (priv, self.snap.entry_offsets())
        return self._private_data

    @staticmethod
    def _view(priv, offset, dtype, shape, nbytes):
        """A tensor of `shape` over priv's bytes [offset, offset + nbytes), or
        None when this torch cannot view that dtype. Not a view of another
        tensor (no _base): its storage alone holds the mapping, so replacing
        its data (Checkpointer._release_views) lets the mapping go."""
        numel = math.prod(shape)
        if numel * _elem_size(dtype) != nbytes or len(priv) < offset + nbytes:
            raise CheckpointCorruptError(f"an entry of {nbytes} bytes at {offset} does not hold shape {shape} "
                                         f"within {len(priv)} bytes of data")
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # complex32 is "experimental" in torch 1.13
                t = torch.frombuffer(priv, dtype=dtype, count=numel, offset=offset)
        except (TypeError, ValueError, RuntimeError):
            return None
        if len(shape) != 1:
            storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
            t.set_(storage, 0, shape, _dtensor.contiguous_strides(shape))
        return t

    def materialize(self, device=None, replace=None, shards_as_tensors=(), verify=False, into=None, layout=None,
                    zero_copy=False):
        """Copies the image into tensors and rebuilds the saved state.

        replace: {key: tensor} used instead of the image's own data.
        shards_as_tensors: keys of Shard nodes to return as plain tensors.
        verify: check the data checksum while copying (when the snapshot was
            not verified yet); CheckpointCorruptError on a mismatch.
        into: {key: tensor} of the caller's tensors to fill in place (see
            Checkpointer.load); the state then holds those tensor objects.
        layout: the load's _dtensor.Layout: which Shard nodes come back as
            the caller's DTensor/ShardedTensor or as new DTensors.
        zero_copy: tensors without a target view the image (a shared-memory
            slot) through a private copy-on-write mapping instead of being
            copied: no allocation, no copy; writing to them copies the pages
            written, never changing the checkpoint; they keep the slot pinned
            (never chosen by a save) while they live. Verified first (one
            parallel read pass) when verify is set.
        """
        replace = replace or {}
        into = into or {}
        refs = []
        _tree.walk_refs(self.doc["tree"], refs)
        tensors = dict(replace)
        targets = []
        fresh = True
        copy_back = []  # (fresh tensor, caller's tensor) for targets not written directly
        private = self._private() if zero_copy and device is None else None
        if private is not None and verify:
            self.snap.verify()  # one parallel pass; the copies below then skip their check
        self.views = []
        for node in refs:
            key = node.get("t", node.get("s"))
            if key is None or key in tensors:
                continue
            i, dtype, shape, nbytes = self.entry(key)
            torch_dtype = _tree.NAME_TO_DTYPE.get(dtype)
            if torch_dtype is None:
                raise CheckpointCorruptError(
                    f"checkpoint {self.source}: entry '{key}' has dtype {dtype}, which this torch "
                    "cannot hold" if dtype != "blob" else
                    f"checkpoint {self.source}: entry '{key}' is a blob, not a tensor")
            dst = into.get(key)
            if dst is None and private is not None:
                try:
                    t = self._view(private[0], private[1][i], torch_dtype, shape, nbytes)
                except CheckpointCorruptError as e:
                    raise CheckpointCorruptError(f"checkpoint {self.source}: entry '{key}': {e}") from None
                if t is not None:
                    tensors[key] = t
                    self.views.append(t)
                    continue
            if dst is not None and (dst.dtype != torch_dtype or tuple(dst.shape) != tuple(shape)):
                raise ValueError(f"load(into=...): '{key}' is {dst.dtype} {tuple(dst.shape)} here but was saved "
                                 f"as {torch_dtype} {tuple(shape)}")
            if dst is not None and dst.device.type == "cpu" and dst.is_contiguous():
                t = dst  # straight into the caller's memory: no allocation, no page faults
                fresh = False
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # complex32 is "experimental" in torch 1.13
                    t = torch.empty(shape, dtype=torch_dtype)
                if dst is not None:
                    copy_back.append((t, dst))
            if t.numel() * t.element_size() != nbytes:
                raise CheckpointCorruptError(
                    f"checkpoint {self.source}: entry '{key}' has {nbytes} bytes for shape {shape}")
            if nbytes:
                targets.append((i, t.data_ptr()))
            tensors[key] = t if dst is None else dst
        # One parallel copy, GIL released; with verify the checksum is computed on the way.
        with torch.no_grad():
            self.snap.copy_to(targets, verify=verify, fresh=fresh)
            for src, dst in copy_back:
                dst.copy_(src)
        if device is not None:
            tensors = {k: (v if k in into else v.to(device)) for k, v in tensors.items()}

        def resolve(node):
            if "B" in node:
                return self.snap.read_bytes(self.entry(node["B"])[0])
            if "t" in node:
                t = tensors[node["t"]]
                return t.requires_grad_() if node.get("g") and not t.requires_grad and t.is_leaf else t
            key = node["s"]
            if layout is not None:
                obj = layout.finish(key, tensors[key])
                if obj is not None:
                    return obj
            if key in shards_as_tensors or key in replace:
                return tensors[key]
            return Shard(tensors[key], node["gs"], node["go"])

        return _tree.decode(self.doc["tree"], resolve)


@functools.lru_cache(maxsize=None)
def _elem_size(dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental" in torch 1.13
        return torch.empty((), dtype=dtype).element_size()


class _TargetIndex(_tree.Encoder):
    """The tensors of a state by the keys a save of it would give them
    (targets), and its DTensors and ShardedTensors (dist)."""

    def __init__(self, state):
        super().__init__()
        self.targets = {}
        self.dist = {}
        if state is not None:
            self.node(state, ())

    def _tensor(self, t, path):
        key = self._key(path)
        self.targets[key] = t
        return key

    def _dist_node(self, obj, local, path, geometry):
        key = self._key(path)
        self.dist[key] = obj
        return key


def _layout(into, shards, mesh, full):
    idx = _TargetIndex(into)
    return _dtensor.Layout(idx.targets, idx.dist, _normalize_shards(shards), mesh=mesh, full=full)


def _normalize_shards(shards):
    out = {}
    for key, spec in (shards or {}).items():
        try:
            global_shape, offsets, shape = spec
            out[key] = (tuple(int(x) for x in global_shape), tuple(int(x) for x in offsets),
                        tuple(int(x) for x in shape))
        except (TypeError, ValueError):
            raise ValueError(f"shards['{key}'] must be (global_shape, offsets, shape), "
                             f"got {spec!r}") from None
        gs, off, shape = out[key]
        if not len(gs) == len(off) == len(shape):
            raise ValueError(f"shards['{key}']: global_shape, offsets and shape differ in length")
        for d in range(len(gs)):
            if off[d] < 0 or shape[d] < 0 or off[d] + shape[d] > gs[d]:
                raise ValueError(f"shards['{key}']: dim {d} slice [{off[d]}, {off[d] + shape[d]}) "
                                 f"is outside the global size {gs[d]}")
    return out


def _fresh(shape, dtype=torch.uint8):
    """torch.empty(shape, dtype) with huge pages asked for before the first
    touch (4 KiB page faults cost more than the copy into a big buffer)."""
    t = torch.empty(shape, dtype=dtype)
    if t.numel() * t.element_size() >= (4 << 20):
        _C._advise_fresh(t.data_ptr(), t.numel() * t.element_size())
    return t


def _assemble(key, want, images, into=None):
    """The slice `want` = (global_shape, offsets, shape) of tensor `key`, from every
    image's overlapping piece; written straight into `into` (the caller's
    tensor) when it is a CPU, contiguous tensor of that shape and the saved dtype."""
    gshape, offsets, shape = want
    out = None
    boxes = []  # (lo, hi) of each piece copied, in global coordinates
    for img in images:
        pieces = img.shard_nodes()
        if key not in pieces:
            continue
        s_gshape, s_off, s_shape = pieces[key]
        if s_gshape != gshape:
            raise ValueError(f"'{key}' was saved with global shape {s_gshape}, not {gshape}")
        i, dtype, _, _ = img.entry(key)
        if out is None:
            torch_dtype = _tree.NAME_TO_DTYPE[dtype]
            if (into is not None and into.device.type == "cpu" and into.is_contiguous()
                    and into.dtype == torch_dtype and tuple(into.shape) == tuple(shape)):
                out = into
            else:
                out = _fresh(shape, torch_dtype)
        lo = [max(a, b) for a, b in zip(offsets, s_off)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, shape, s_off, s_shape)]
        if any(h <= l for l, h in zip(lo, hi)) and len(shape) > 0:
            continue
        box = [h - l for l, h in zip(lo, hi)]
        img.snap.copy_box(i, out.element_size(), list(s_shape), [l - b for l, b in zip(lo, s_off)],
                          out.data_ptr(), list(shape), [l - a for l, a in zip(lo, offsets)], box)
        boxes.append((lo, hi))
    if out is None:
        raise ValueError(f"no saved rank holds a tensor '{key}' (keys are state paths joined by "
                         "'/'; `ballast ckpt inspect` lists them)")
    missing = _uncovered(offsets, shape, boxes)
    if missing:
        raise ValueError(f"the saved shards of '{key}' leave {missing} of the {out.numel()} "
                         "requested elements uncovered (a rank's shard file is missing?)")
    return out


def _uncovered(offsets, shape, boxes):
    """Elements of the box (offsets, shape) that no (lo, hi) box covers."""
    def volume(lo, hi):
        v = 1
        for l, h in zip(lo, hi):
            v *= max(0, h - l)
        return v

    total = volume(offsets, [a + n for a, n in zip(offsets, shape)])
    disjoint = all(any(h1 <= l2 or h2 <= l1 for l1, h1, l2, h2 in zip(lo1, hi1, lo2, hi2))
                   for k, (lo1, hi1) in enumerate(boxes) for lo2, hi2 in boxes[:k])
    if disjoint or not shape:
        return max(0, total - sum(volume(lo, hi) for lo, hi in boxes)) if shape else (0 if boxes else 1)
    # Overlapping saved pieces (a replicated shard): count with a mask.
    covered = torch.zeros(shape, dtype=torch.bool)
    for lo, hi in boxes:
        covered[tuple(slice(l - a, h - a) for l, h, a in zip(lo, hi, offsets))] = True
    return int(covered.numel() - covered.sum())


class _PendingSave:
    """A save(blocking=False) copying on the store's own copy thread (C++, at
    idle priority, never holding the GIL: a Python thread per save would cost
    its start and take the GIL from training at the copy's start and end)."""

    def __init__(self, store, step, entries, keepalive, parallel):
        self.step = step
        self._store = store
        # The entries (small tensors' bytes) and the tensors they point into, until the copy is done.
        self._keepalive = (entries, keepalive)
        store.save_async(step, entries, parallel=parallel)

    def done(self):
        return self._store.async_done()

    def wait(self):
        """Waits for the copy; raises its error, if any."""
        try:
            self._store.wait_async()
        finally:
            self._keepalive = None


class _Resources:
    """What a Checkpointer owns; closed by close(), GC or interpreter exit."""

    def __init__(self, store):
        self.store = store
        self.persister = None
        self.pending = None  # a _PendingSave

    def close(self):
        if self.pending is not None:
            pending, self.pending = self.pending, None
            try:
                pending.wait()
            except Exception:  # noqa: BLE001 - closing: an unfinished save is not committed, nothing to report to
                pass
        if self.persister is not None:
            self.persister.close()  # finishes a pending persist
            self.persister = None
        if self.store is not None:
            self.store.close()  # unlinks the shared memory if we created it
            self.store = None


class Checkpointer:
    """Flash checkpoints of a training state: in memory in the time of a memcpy,
    on disk asynchronously.

    Args:
        dir: checkpoint directory (``step-<N>/rank-<R>.ballast`` + ``latest``).
        keep: complete steps kept on disk (older ones are deleted).
        rank, world_size: this process's shard; default torch.distributed's when
            initialized, else $RANK / $WORLD_SIZE, else 0 / 1.
        shm: shared-memory store to use; default $BALLAST_CKPT_SHM (set by
            ``ballast run``); without one the Checkpointer makes its own.
        verify: verify checksums when loading from memory (disk is always verified).
        save_every: which ``save`` calls copy: every N-th step (default
            ``$BALLAST_SAVE_EVERY``, else 1: every call), or ``"auto"`` /
            ``"auto:MAX"``: the interval that loses the least training time
            from the measured cost of a save, the step time and the job's
            failure rate (ballast.save_policy; ``--save-every auto``).
        copy_share: under ``ballast run``, the share of the time the agent's
            writes of ``persist=True`` steps may take (default
            ``$BALLAST_CKPT_COPY_SHARE``, else 0.25; ``--ckpt-copy-share``):
            when a write takes longer, only the first such step of every k
            steps is written (ballast.save_policy.PersistPace); ``wait()``
            writes the newest one left out. 1: every step asked for. The
            same share bounds the agent's copies of saved steps to peer
            nodes (``--ckpt-replicas``): when they take longer, every rank
            sends only the first copied save of every k steps, the same k on
            all ranks (ballast.save_policy.ReplicaPace), and a node loss
            resumes from a step up to k saves old.

    Example::

        import ballast
        ckpt = ballast.Checkpointer("/ckpt/run1", keep=3)
        step, state = ckpt.load()                  # (None, None) on a fresh start
        if state is not None:
            model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
        for step in range(step or 0, steps):
            train_step()
            ckpt.save(step, {"model": model.state_dict(), "opt": opt.state_dict()},
                      persist=step % 100 == 0)
        ckpt.wait()
    """

    def __init__(self, dir, keep=3, *, rank=None, world_size=None, shm=None, verify=True, save_every=None,
                 copy_share=None):
        if (rank is None) != (world_size is None):
            raise ValueError("pass both rank and world_size, or neither")
        if rank is not None and not 0 <= int(rank) < int(world_size):
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if int(keep) < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        # Through a weak reference: a bound method would make a cycle, and the
        # Checkpointer would outlive its last reference (its memory with it).
        me = weakref.ref(self)
        self._interval = _save_policy.SaveInterval(
            save_every, agree=lambda n: me()._agree_interval(n) if me() is not None else n)
        self.dir = os.path.abspath(os.fspath(dir))
        self.keep = int(keep)
        self.verify = bool(verify)
        self._rank = None if rank is None else int(rank)
        self._world_size = None if world_size is None else int(world_size)
        self.last_load_source = None
        self._requested = None  # newest step asked to be persisted
        self._pending_persist = None  # (step, rank, world) of a save(blocking=False, persist=True)
        # Overlapped saves copy on one thread (the store's copy thread) until
        # one of them makes training wait, then on every copy thread; a set
        # BALLAST_CKPT_COPY_THREADS means every copy thread from the start.
        # The first overlapped save does not count: it also sizes and faults
        # its slot.
        self._copy_parallel = bool(os.environ.get("BALLAST_CKPT_COPY_THREADS"))
        self._overlapped_saves = 0
        self._largest_image = 0  # bytes of the largest image saved (a bigger one sizes the memory)
        self._growth_noted = False
        self._persist_key = None
        self._host = None  # _tree.HostBuffers for CUDA tensors (GPU saves)
        self._views = []  # weakrefs to the tensors that view a memory slot (load's zero copy)
        # The rollback targets of silent data corruption kept in memory
        # (_at_check_step): [check step, saved step, pinning snapshot], oldest first.
        self._pins = []
        self._target_persist = None  # a pinned target's persist not known durable yet
        name = shm or os.environ.get(ENV_SHM) or None
        if name:
            store = _C.open_store(name)
            self.agent = True
        else:
            name = f"/ballast-{os.getpid()}-{secrets.token_hex(6)}"
            store = _C.create_store(name)
            self.agent = False
        self._res = _Resources(store)
        self._finalizer = weakref.finalize(self, self._res.close)
        if self.agent:
            _under_agent.add(self)
        # Under an agent, which persist=True saves ask for a write (the agent
        # says what a write took); in-process persists are written by wait().
        self._pace = _save_policy.PersistPace(copy_share) if self.agent else None
        # Under an agent that sends this rank's steps to peer nodes, which
        # copied saves it sends: the same steps on every rank (a collective).
        # Every rank under an agent takes part in the agreement, whether its
        # agent sends replicas or not (agents started with different
        # --ckpt-replicas must not leave a collective half joined); only the
        # ones whose agent sends ask for copies.
        self._replicas_on = os.environ.get(_save_policy.ENV_REPLICA_PEERS, "") not in ("", "0")
        self._replica_pace = _save_policy.ReplicaPace(
            copy_share, agree=lambda k: me()._agree_interval(k) if me() is not None else k,
            log=None if self._replicas_on else (lambda msg: None)
        ) if self.agent else None
        self._pending_replica = None  # the step of a save(blocking=False) to send to the peers once copied
        self._thinned = None  # the newest persist=True step the pace left out

    # -- helpers ---------------------------------------------------------------

    @property
    def _store(self):
        if self._res.store is None:
            raise RuntimeError("this Checkpointer is closed")
        return self._res.store

    def rank_world(self):
        """(rank, world_size) this Checkpointer saves and loads as.

        Example::

            rank, world = ckpt.rank_world()
        """
        if self._rank is not None:
            return self._rank, self._world_size
        d = _dist()
        if d is not None:
            return d.get_rank(), d.get_world_size()
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

    def _collective(self, world):
        d = _dist()
        return d if d is not None and d.get_world_size() == world else None

    # -- save ------------------------------------------------------------------

    def _agree_interval(self, n):
        """The largest of the ranks' save_every auto choices (every rank must
        copy the same steps)."""
        d = self._collective(self.rank_world()[1])
        return -_all_reduce_min(d, [-int(n)])[0] if d is not None else n

    @property
    def save_interval(self):
        """Steps between the saves that copy now (1 unless ``save_every`` says otherwise)."""
        return self._interval.interval

    def due(self, step, persist=False):
        """Whether ``save(step, ...)`` would copy (``save_every``): a caller
        whose state dict is costly to build can skip building it. Asking
        twice for a step gives the same answer.

        Example::

            if ckpt.due(step):
                ckpt.save(step, build_state())
        """
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self._interval.due(step, persist)

    def save(self, step, state_dict, persist=False, *, blocking=True):
        """Copies ``state_dict`` into shared memory as ``step``; returns when it is there.

        With ``save_every`` other than 1 only the calls it picks copy (every
        call with ``persist=True`` does); the others return at once. Returns
        whether this call copied.

        Every rank of the world saves the same steps (a restore needs one step
        that every rank holds), and some calls are collective (one
        all-reduce of one integer): under ``ballast run`` the first copied
        save and one every 32 steps after (the ranks agree on which copies go
        to the peer nodes), and with ``save_every="auto"`` the calls that
        choose the interval. So every rank calls ``save`` for the same steps,
        as it calls its training collectives.

        Tensors (any dtype and shape, non-contiguous or on CUDA) are copied from
        their memory with the GIL released; everything else is encoded without
        pickle. With ``persist=True`` the step is also queued to be written to
        ``dir`` (by the ``ballast run`` agent, or a thread of this process);
        ``wait()`` blocks until it is durable.

        With ``blocking=False`` the copy runs on a thread while training goes
        on, and the call returns at once: the next step's forward and backward
        only read the parameters and optimizer state. Until ``wait_saved()``
        returns, do not change the saved tensors in place: call it before
        ``optimizer.step()`` (``ckpt.guard(optimizer)`` does that for you).
        Tensors under 1 MiB (buffers that forward updates, such as BatchNorm
        statistics) are copied at the call. A step is committed only once its
        copy is complete, as for a blocking save; the next save or load waits
        for the pending one.

        Example::

            ckpt.save(100, {"model": model.state_dict(), "opt": opt.state_dict(),
                            "epoch": 3}, persist=True)
            # overlapped with training:
            opt = ckpt.guard(opt)              # opt.step() waits for the copy first
            for step in range(start, steps):
                loss = model(batch()).sum(); loss.backward()
                opt.step(); opt.zero_grad()
                ckpt.save(step, {"model": model.state_dict(), "opt": opt.state_dict()},
                          blocking=False)
        """
        if self._pace is not None and int(step) >= 0:
            store = self._store
            self._pace.note(step, store.durable_step(), store.durable_write_s())
            if self._replica_pace is not None:
                self._replica_pace.note(step, store.replicated_step(), store.replica_put_s())
        if not self.due(step, persist):
            return False
        step = int(step)
        if persist and self._pace is not None and not self._pace.wants(step):
            persist = False  # kept in memory; wait() writes the newest one left out
            self._thinned = step
        # wants() first: it is collective on every rank under an agent.
        replicate = self._replica_pace is not None and self._replica_pace.wants(step) and self._replicas_on
        self.wait_saved()
        t0 = time.perf_counter()
        try:
            self._save(step, state_dict, blocking, persist, replicate)
        finally:
            # What training waited for this save (the master's checkpoint part).
            blocked = time.perf_counter() - t0
            _C.progress_ckpt_stall(blocked, 1)
        self._interval.copied(step, blocked)
        return True

    def _save(self, step, state_dict, blocking, persist, replicate=False):
        """save() once the pending overlapped save is done."""
        self._store.wait_incoming(_INCOMING_WAIT_S)  # the agent is the store's writer until then
        rank, world = self.rank_world()
        self._name_dir(rank, world)
        if not blocking:
            self._release_views()
            entries, keepalive = _tree.encode_state(
                state_dict, {"rank": rank, "world_size": world, "step": step}, self._host_buffers())
            # Small tensors by value now; the rest is read by the copy thread.
            entries = [(k, n, shape, ctypes.string_at(data, nbytes)
                        if isinstance(data, int) and 0 < nbytes < _ASYNC_CLONE_BYTES else data, nbytes)
                       for k, n, shape, data, nbytes in entries]
            self._res.pending = _PendingSave(self._store, step, entries, keepalive, self._copy_parallel)
            self._overlapped_saves += 1
            self._pending_persist = (step, rank, world) if persist else None
            self._pending_replica = step if replicate else None
            return
        # The agent's hang detection allows a save its checkpoint grace period.
        _C.progress_checkpoint(True)
        try:
            entries, keepalive = _tree.encode_state(
                state_dict, {"rank": rank, "world_size": world, "step": step}, self._host_buffers())
            stats = self._store.save(step, entries)
            del keepalive
        finally:
            _C.progress_checkpoint(False)
        self._note_growth(step, stats)
        if replicate:
            self._store.request_replica(step)
        if persist:
            self._request_persist(step, rank, world)
        if self._pins:
            # ballast.step(S, model=) came before save(S): S's own save is the check's target.
            if self._pins[-1][0] == step and self._pins[-1][1] < step:
                snap = self._store.restore(step=step, verify=False)
                if snap is not None:
                    self._pins[-1] = [step, step, snap]
                    if os.environ.get(ENV_SDC_PERSIST, "1") != "0" and step > self._store.requested_persist_step():
                        self._request_persist(step, rank, world)
                        self._target_persist = step
            # The verdict on the pinned next target came: it is the target now
            # (the older one's slot goes back to the saves at once).
            elif len(self._pins) > 1:
                agreed = _C.progress_sdc_agreed()
                if agreed >= self._pins[-1][0]:
                    self._promote(agreed)

    def _promote(self, agreed):
        """The newest target agreed by ``agreed`` and the targets not judged
        yet stay pinned, the rest are let go. Returns the targets still
        awaiting a verdict."""
        judged = [p for p in self._pins if p[0] <= agreed]
        waiting = [p for p in self._pins if p[0] > agreed]
        self._pins = judged[-1:] + waiting
        return waiting

    def _pin_check(self, check, agreed):
        """_at_check_step for this Checkpointer: _promote, then, with no
        target awaiting a verdict, the newest save at or before ``check``
        becomes the next one, and is persisted: a node that replaces a
        corrupt one reads it from disk (a later persist request waits for it,
        since the persister writes only the newest one requested)."""
        self.wait_saved()
        if self._promote(agreed):
            return
        # Two pinned targets and the saves' two slots fill the store: tensors
        # that still view the loaded step's slot (an optimizer's state after
        # load) get their own memory now, once, so that slot is free again.
        self._release_views()
        held = [s for s in self._store.steps() if s <= check]
        if not held:
            return
        snap = self._store.restore(step=max(held), verify=False)
        if snap is None:
            return
        self._pins.append([check, max(held), snap])
        if os.environ.get(ENV_SDC_PERSIST, "1") != "0" and max(held) > self._store.requested_persist_step():
            rank, world = self.rank_world()
            self._request_persist(max(held), rank, world)
            self._target_persist = max(held)

    def reserve(self, state_dict, *, blocking=True):
        """Prepares the shared memory for saves of a state like ``state_dict``, in the background.

        A job's first save otherwise creates its shared memory and faults every
        page in while it copies (about 0.3 s per GiB on a small VM, more than
        the copy itself); later saves reuse that memory. ``reserve`` sizes and
        faults it on a background thread while training goes on, so the first
        save only copies. It reads no tensor data (shapes and dtypes only) and
        returns at once with the bytes a save of this state takes. A save that
        comes before the memory is ready waits for the rest of it, so it is
        never slower than without ``reserve``.

        Call it once the state has its final shapes: after the optimizer's
        first step (AdamW's moments exist only from then on), with the same
        ``blocking`` as the saves (an overlapped saver keeps one more slot).
        ``ballast.hf.BallastCallback`` calls it for you.

        Example::

            loss.backward(); opt.step()          # the first step creates opt's state
            ckpt.reserve({"model": model.state_dict(), "opt": opt.state_dict()})
        """
        rank, world = self.rank_world()
        entries, _ = _tree.encode_state(state_dict, {"rank": rank, "world_size": world, "step": 0},
                                        encoder=_tree.SizeEncoder())
        return self._store.reserve(entries, background=not blocking)

    def _track_views(self, views):
        self._views = [r for r in self._views if r() is not None]
        self._views.extend(weakref.ref(t) for t in views)

    def _release_views(self):
        """Gives the loaded tensors that still view a memory slot their own
        memory (a copy), so the slot is unpinned: an overlapped save keeps the
        two newest steps and needs all three slots."""
        live = [t for t in (r() for r in self._views) if t is not None]
        self._views = []
        with torch.no_grad():
            for t in live:
                t.data = t.clone()

    def _host_buffers(self):
        """Pinned host buffers for CUDA tensors (created at the first save
        that needs them; None without CUDA)."""
        if self._host is None and torch.cuda.is_available():
            self._host = _tree.HostBuffers()
        return self._host

    def _note_growth(self, step, stats):
        """Says once when a save was slow because it sized the shared memory (the first ones)."""
        size = stats.get("image_bytes", 0) if isinstance(stats, dict) else 0
        grew = size > self._largest_image
        self._largest_image = max(size, self._largest_image)
        if grew and stats.get("seconds", 0) > 0.25 and not self._growth_noted:
            self._growth_noted = True
            sys.stderr.write(
                f"ballast: checkpoint step {step}: this save of {size / (1 << 30):.2f} GiB took "
                f"{stats['seconds']:.2f} s because it sized and faulted the shared memory; later saves "
                "reuse it (the other slot is grown in the background now)\n")

    def wait_saved(self):
        """Waits for a ``save(blocking=False)`` to finish copying; raises its error, if any.

        After it returns the saved tensors may change again. Cheap when
        nothing is pending.

        Example::

            ckpt.save(step, state, blocking=False)
            loss.backward()
            ckpt.wait_saved()
            opt.step()
        """
        pending = self._res.pending
        if pending is None:
            return
        self._res.pending = None
        persist, self._pending_persist = self._pending_persist, None
        replicate, self._pending_replica = self._pending_replica, None
        if not pending.done():  # training waits for the copy: a checkpoint stall
            # One copy thread was not enough to finish within the step: the
            # next overlapped saves copy on all of them.
            self._copy_parallel = self._copy_parallel or self._overlapped_saves > 1
            t0 = time.perf_counter()
            try:
                pending.wait()
            finally:
                _C.progress_ckpt_stall(time.perf_counter() - t0, 0)
        else:
            pending.wait()
        if replicate is not None:
            self._store.request_replica(replicate)
        if persist is not None:
            self._request_persist(*persist)

    def guard(self, optimizer):
        """Makes ``optimizer.step()`` first wait for a pending ``save(blocking=False)``.

        torch 1.13 has no optimizer pre-step hook: this wraps the optimizer's
        ``step`` method (once) and returns the optimizer.

        Example::

            opt = ckpt.guard(torch.optim.AdamW(model.parameters()))
        """
        step = optimizer.step
        if getattr(step, "_ballast_guarded", False):
            return optimizer

        @functools.wraps(step)
        def guarded_step(*args, **kwargs):
            self.wait_saved()
            return step(*args, **kwargs)

        guarded_step._ballast_guarded = True
        optimizer.step = guarded_step
        return optimizer

    def _name_dir(self, rank, world):
        """Under an agent: tells it where this rank's shards go, from the
        first save on, so that when the agent exits (a preemption, a stop, a
        failed job) it writes the newest step there even if no save asked
        for disk (at a restart it writes only for ranks that did)."""
        key = (self.dir, rank, world, self.keep)
        if self.agent and key != self._persist_key:
            self._store.set_persist_config(self.dir, rank, world, self.keep)
            self._persist_key = key

    def _request_persist(self, step, rank, world):
        key = (self.dir, rank, world, self.keep)
        target, self._target_persist = self._target_persist, None
        if self.agent and target is not None and step > target and self._store.durable_step() < target:
            # The agent persists only the newest step asked for: the rollback
            # target's write goes first (one shard, in flight since its
            # check; the wait ends at once if the agent reported it failed).
            self._store.wait_durable(target, _TARGET_PERSIST_WAIT_S)
        if self.agent:
            self._name_dir(rank, world)
            self._store.request_persist(step)
        else:
            if key != self._persist_key or self._res.persister is None:
                if self._res.persister is not None:
                    self._res.persister.close()
                self._res.persister = _C.LocalPersister(self._store, self.dir, rank, world, self.keep)
                self._persist_key = key
            self._res.persister.request(step)
        self._requested = step if self._requested is None else max(self._requested, step)

    def _persist_thinned(self):
        """Asks for the newest persist=True step the pace left out, when it
        is newer than the steps asked for (or, overwritten by later saves,
        the newest step held in memory instead: newer state, on every rank)."""
        thinned, self._thinned = self._thinned, None
        if thinned is None or (self._requested is not None and thinned <= self._requested):
            return
        held = self._store.steps()
        step = thinned if thinned in held else max((s for s in held if s > thinned), default=None)
        if step is not None:
            rank, world = self.rank_world()
            self._request_persist(step, rank, world)

    def wait(self, timeout=_DEFAULT_WAIT_S):
        """Blocks until every step saved with ``persist=True`` is durable on disk.

        Raises TimeoutError after ``timeout`` seconds (under ``ballast run``:
        when no agent made the step durable), OSError when the write failed.

        Example::

            ckpt.save(step, state, persist=True)
            ckpt.wait()          # the file is fsync'ed; safe to stop the job
        """
        self.wait_saved()
        self._persist_thinned()
        if self._requested is None:
            return
        step = self._requested
        if self.agent:
            if not self._store.wait_durable(step, float(timeout)):
                err = self._store.persist_error()
                if err is not None and err[0] >= step:
                    raise OSError(f"checkpoint step {step} could not be made durable: {err[1]}")
                raise TimeoutError(
                    f"checkpoint step {step} was not made durable within {timeout:g} s: no "
                    f"ballast agent persisted the shared memory {self._store.name} "
                    f"(durable step is {self._store.durable_step()}). Run the job under "
                    f"`ballast run`, or unset {ENV_SHM} to persist from this process")
        else:
            self._res.persister.wait(step, float(timeout))

    # -- queries ---------------------------------------------------------------

    def latest_step(self):
        """The newest step complete and durable on disk (``<dir>/latest``), or None.

        Example::

            ckpt.save(7, state, persist=True); ckpt.wait()
            assert ckpt.latest_step() == 7
        """
        return _C.read_latest_step(self.dir)

    def memory_step(self):
        """The newest step this rank holds in shared memory, or None.

        Example::

            ckpt.save(8, state)
            assert ckpt.memory_step() == 8
        """
        self.wait_saved()
        return self._store.memory_step()

    # -- load ------------------------------------------------------------------

    def load(self, shards=None, *, step=None, device=None, into=None, allow_fresh_start=None, mesh=None,
             full=False, from_dcp=None):
        """Loads the newest checkpoint: ``(step, state_dict)``, or ``(None, None)``.

        Memory is used when its step is the newest step that every rank holds
        (ranks agree through torch.distributed when it is initialized) and was
        saved by this rank in this world size; otherwise the latest complete
        step on disk, which a rank still holding that step in its own memory
        (a survivor, beside a replacement that reads the disk) reads from
        memory. ``last_load_source`` says which ("memory", "replica":
        memory that the agent of a replacement node copied in from a peer
        node's replica, or "disk").
        Tensors come back on the CPU (or ``device``). From this rank's own
        memory, those without a target in ``into`` view the checkpoint
        through a private copy-on-write mapping (no allocation, no copy: the
        default load costs a checksum pass): writing to them copies the pages
        written and never changes the checkpoint, and while any of them
        lives the step's memory slot stays pinned (saves use the other
        slots). ``load_state_dict`` copies them; an optimizer's
        ``load_state_dict`` keeps them as its state (its first update then
        copies the pages it writes).

        Args:
            shards: ``{key: (global_shape, offsets, shape)}``: return for each key
                (the tensor's path joined by "/", e.g. "model/fc.weight") a
                tensor of ``shape`` holding that slice of the global tensor,
                assembled from every saved rank's pieces (reshard on load:
                a checkpoint saved by N ranks loads on M).
            step: load this step instead of the newest.
            device: move the tensors there (e.g. "cuda").
            into: a state shaped like the saved one (e.g. ``{"model":
                model.state_dict(), "opt": opt.state_dict()}``): its tensors
                are filled in place (same dtype and shape as saved), so the
                model and optimizer hold the checkpoint without a new
                allocation or a ``load_state_dict`` copy, the way
                torch.distributed.checkpoint loads. The returned state holds
                those tensors; plain values come back as saved. When there
                is nothing to load (a job's first start), the memory for
                saves of a state like it is sized in the background, as
                ``reserve`` does, so the first save only copies.
            mesh: the DeviceMesh on which a saved DTensor that has no target
                in ``into`` comes back (default: the mesh of a DTensor in
                ``into`` with as many dimensions, else a 1-D mesh over the
                world).
            full: return such DTensors as whole (global) tensors instead.
            from_dcp: a torch.distributed.checkpoint directory to start
                from when no Ballast checkpoint exists yet (memory or disk):
                it is loaded into ``into`` (required; DCP reshards onto its
                DTensors) and the step is the state's top-level "step" when
                it holds an int, else 0 (``last_load_source``: "dcp").
                Default: ``BALLAST_FROM_DCP`` in the environment.
            allow_fresh_start: when no checkpoint (memory, replica, disk)
                covers some ranks while other ranks hold a step in memory,
                return ``(None, None)`` (every rank starts over) instead of
                raising CheckpointLostError. Default: ``BALLAST_ALLOW_FRESH_START=1``
                in the environment, else False. When the disk holds an older
                step than memory does, every rank loads that step and a
                warning names the steps lost.

        Distributed tensors (FSDP2, DTensor; FSDP1's ShardedTensor) are
        saved as each rank's local piece and resharded on load: pass the new
        world's state in ``into`` (e.g. ``model.state_dict()`` of the FSDP2
        model) and each DTensor's local piece is filled from whichever saved
        pieces overlap it, for any world size, mesh and split. A saved DTensor
        with no target (an optimizer's state before its first step) comes back
        as a DTensor with its saved placements on the current mesh, so
        ``optimizer.load_state_dict(state["optim"])`` restores it.

        Memory is verified as it is copied (one pass over the data, not two);
        a corrupt in-memory step makes every rank load from disk.

        Example::

            step, state = ckpt.load()
            # in place, after a restart (the model and optimizer exist already):
            step, state = ckpt.load(into={"model": model.state_dict(), "opt": opt.state_dict()})
            if state is not None:
                opt.load_state_dict(state["opt"])   # param groups, step counts
            # 2 ranks reading a 100 x 8 weight saved by 4 ranks as ballast.Shard:
            step, state = ckpt.load(shards={"w": ((100, 8), (50 * rank, 0), (50, 8))})
            w = state["w"]   # torch.Tensor of shape (50, 8)
        """
        got = self._load(shards, step=step, device=device, into=into, allow_fresh_start=allow_fresh_start,
                         mesh=mesh, full=full, from_dcp=from_dcp)
        if self.agent:
            # The step every rank resumes from is the first rollback target
            # of silent data corruption (_at_check_step) until a check agrees.
            self._pins = []
            snap = None if got[0] is None else self._store.restore(step=got[0], verify=False)
            if snap is not None:
                self._pins = [[got[0], got[0], snap]]
        return got

    def _load(self, shards, *, step, device, into, allow_fresh_start, mesh, full, from_dcp):
        """load() itself."""
        self.wait_saved()
        if not self._store.wait_incoming(_INCOMING_WAIT_S):
            warnings.warn(f"the agent's copy of this rank's replica did not finish in {_INCOMING_WAIT_S:.0f} s; "
                          "loading without it")
        rank, world = self.rank_world()
        layout = _layout(into, shards, mesh, full)
        mem_img, mem_step = self._memory_image(step, rank, world, layout)
        if step is not None:
            disk_step = step if os.path.isdir(_C.step_dir(self.dir, step)) else -1
        else:
            latest = _C.read_latest_step(self.dir)
            disk_step = -1 if latest is None else latest
        mem_min, disk_min, disk_max = mem_step, disk_step, disk_step
        d = self._collective(world)

        if d is not None:
            mem_min, disk_min, neg_disk_max = _all_reduce_min(d, [mem_step, disk_step, -disk_step])
            disk_max = -neg_disk_max
        # The newest step every rank holds: a rank whose newest step is newer
        # (a replica lagging one save behind, a rank that saved once more
        # before the failure) may still hold that step in its other slot.
        if step is None and mem_min >= 0 and mem_min < mem_step and mem_min >= disk_max:
            mem_img = None
            mem_img, mem_step = self._memory_image(mem_min, rank, world, layout)
        held = 1 if mem_step >= 0 and mem_step == mem_min else 0
        if d is not None and mem_min >= 0:
            held = _all_reduce_min(d, [held])[0]
        if held and mem_step >= disk_max:
            state, ok = None, 1
            try:
                state = mem_img.materialize(device, shards_as_tensors=set(mem_img.specs), verify=self.verify,
                                            into=layout.targets, layout=layout, zero_copy=True)
                self._track_views(mem_img.views)
            except CheckpointCorruptError as e:
                warnings.warn(f"ignoring the in-memory checkpoint: {e}")
                ok = 0
            # Every rank uses memory, or none does (one rank's corrupt image
            # would otherwise leave the world on two different steps).
            if d is not None:
                ok = _all_reduce_min(d, [ok])[0]
            if ok:
                # A replacement node's agent copied this rank's step in from a
                # peer node's replica.
                self.last_load_source = "replica" if mem_img.source.startswith("replica:") else "memory"
                return mem_step, state
        del mem_img
        if d is not None:
            # Not every rank holds its own step: memory anywhere in the world
            # (a survivor's stores, the replicas nodes hold for lost ones) may
            # still have one step of every rank of a world, resharded here.
            got = self._load_exchange(d, step, rank, world, disk_max, layout, device)
            if got is not None:
                return got
        if disk_min < 0 and disk_max >= 0:
            raise RuntimeError(
                f"some ranks find no checkpoint in {self.dir} while others find step "
                f"{disk_max}: every rank must see the same checkpoint directory")
        if d is not None and step is None:
            self._check_lost(d, rank, world, mem_step, disk_min, allow_fresh_start)
        if disk_min < 0:
            from_dcp = from_dcp if from_dcp is not None else os.environ.get("BALLAST_FROM_DCP") or None
            if from_dcp is not None and step is None:
                got = self._load_dcp(from_dcp, into)
                self._reserve_fresh(into)
                return got
            if step is None:
                self._check_rollback_target(rank, allow_fresh_start)
            self.last_load_source = None
            self._reserve_fresh(into)
            return None, None
        # Every rank loads the newest step on disk. A rank that still holds
        # that very step in its own memory (a survivor of a lost node) reads
        # it from there: the same bytes, without the disk read; the others
        # (the replacement) read the disk. A corrupt image falls back to disk:
        # the step stays the same either way.
        if disk_min == disk_max:
            img, held_step = self._memory_image(disk_min, rank, world, layout)
            if img is not None and held_step == disk_min:
                try:
                    state = img.materialize(device, shards_as_tensors=set(img.specs), verify=self.verify,
                                            into=layout.targets, layout=layout, zero_copy=True)
                    self._track_views(img.views)
                    self.last_load_source = "memory"
                    return disk_min, state
                except CheckpointCorruptError as e:
                    warnings.warn(f"ignoring the in-memory checkpoint: {e}; reading step {disk_min} from disk")
            del img
        state = self._load_disk(disk_min, rank, world, device, layout)
        self.last_load_source = "disk"
        self._reserve_like(disk_min, rank)
        return disk_min, state

    def _reserve_fresh(self, into):
        """A start with nothing in this rank's memory yet and ``into``, the
        state the script fills and then saves: the memory of its first save is
        sized and faulted now, in the background, as ``reserve`` does, so
        that save only copies. A state that grows after this (an optimizer's
        moments, created at its first step) grows the rest at that save."""
        if into is None or max(self._store.capacities(), default=0) > 0:
            return
        try:
            self.reserve(into)
        except Exception as e:  # noqa: BLE001 (a head start, never a reason for load to fail)
            warnings.warn(f"ballast: the memory for the first save was not sized ahead ({e}); "
                          "that save sizes it itself")

    def _reserve_like(self, step, rank):
        """After a load from disk (a new node, a job restarted from its
        files): this rank's next save will be about the size of its shard, so
        its memory is sized and faulted now, in the background, and the first
        save only copies, as ``reserve`` does when the script calls it."""
        try:
            size = os.path.getsize(_C.shard_path(self.dir, step, rank))
        except OSError:
            return  # saved by fewer ranks (a reshard): the first save sizes it
        self._store.reserve_bytes(size)

    def _load_dcp(self, path, into):
        """A job's start from a DCP checkpoint (load(from_dcp=...))."""
        if into is None:
            raise ValueError("load(from_dcp=...) needs into=: DCP loads in place into the state it is given, e.g. "
                             "{'model': model.state_dict(), 'optim': opt.state_dict(), 'step': 0} (an optimizer "
                             "needs its state first: torch.distributed.checkpoint.state_dict.get_state_dict)")
        try:
            from torch.distributed.checkpoint import load as dcp_load
        except ImportError:
            raise ValueError(f"load(from_dcp=...) needs torch >= 2.2 (torch.distributed.checkpoint.load); this is "
                             f"torch {torch.__version__}") from None
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise FileNotFoundError(f"no DCP checkpoint at {path} (no .metadata file): check from_dcp= "
                                    "(or BALLAST_FROM_DCP)")
        dcp_load(into, checkpoint_id=path)
        step = into.get("step") if isinstance(into, dict) else None
        self.last_load_source = "dcp"
        return (step if isinstance(step, int) and not isinstance(step, bool) else 0), into

    def _check_lost(self, d, rank, world, mem_step, disk_step, allow_fresh_start):
        """Memory could not serve the world: when some ranks hold a newer step
        than the disk's (disk_step, -1: none), say what is lost. No step at
        all on disk: raise CheckpointLostError (every rank alike) unless a
        fresh start was allowed; an older one: warn (rank 0)."""
        held = _all_gather_int(d, mem_step, world)
        newest = max(held)
        if newest <= disk_step:
            return
        holders = [r for r, s in enumerate(held) if s == newest]
        missing = [r for r, s in enumerate(held) if s < newest]
        what = (f"ranks {_ranges(holders)} hold step {newest} in memory, but no checkpoint in memory, in a "
                f"peer's replica or on disk covers step {newest} for ranks {_ranges(missing)} of this world "
                f"of {world}")
        if disk_step >= 0:
            if rank == 0:
                warnings.warn(f"{what}: every rank resumes from step {disk_step} on disk "
                              f"({newest - disk_step} step(s) of training are repeated)")
            return
        if allow_fresh_start is None:
            allow_fresh_start = os.environ.get("BALLAST_ALLOW_FRESH_START", "") == "1"
        if allow_fresh_start:
            if rank == 0:
                warnings.warn(f"{what}, and none is on disk in {self.dir}: every rank starts over from "
                              f"step 0 (allowed by allow_fresh_start / BALLAST_ALLOW_FRESH_START=1)")
            return
        raise CheckpointLostError(
            f"{what}, and none is on disk in {self.dir}: starting every rank from step 0 would lose "
            f"{newest + 1} step(s) of training. Keep peer replicas on (--ckpt-replicas 1, the default) or "
            f"persist steps to disk (save(..., persist=True)); to start over anyway, call "
            f"load(allow_fresh_start=True) or set BALLAST_ALLOW_FRESH_START=1")

    def _check_rollback_target(self, rank, allow_fresh_start):
        """A rollback round (BALLAST_ROLLBACK_BELOW, set by the agent) that
        finds no step at all: say so instead of starting over silently."""
        below = int(os.environ.get("BALLAST_ROLLBACK_BELOW", "0") or 0)
        if below <= 1:
            return  # nothing before the bad step was ever agreed: step 0 is the target
        what = (f"the job rolled back to the newest checkpoint before step {below}, but no rank holds one in "
                f"memory, in a peer's replica or on disk in {self.dir}")
        if allow_fresh_start is None:
            allow_fresh_start = os.environ.get("BALLAST_ALLOW_FRESH_START", "") == "1"
        if allow_fresh_start:
            if rank == 0:
                warnings.warn(f"{what}: every rank starts over from step 0 (allowed by allow_fresh_start / "
                              "BALLAST_ALLOW_FRESH_START=1)")
            return
        raise CheckpointLostError(
            f"{what}: starting over from step 0 would repeat {below - 1} step(s) of training. Report parameter "
            f"fingerprints with ballast.step(step, model=model) (the target is then kept pinned) or persist "
            f"steps (save(..., persist=True)); to start over anyway, set BALLAST_ALLOW_FRESH_START=1")

    def _inventory(self, step):
        """[_Image] of every step this rank can read in memory: its own
        store's and those of the replicas its node holds for other ranks
        (BALLAST_CKPT_REPLICAS). Each stays pinned while referenced."""
        stores = [self._store]
        for name in filter(None, os.environ.get(ENV_REPLICAS, "").split(",")):
            try:
                stores.append(_C.open_store(name, prefault=False))
            except (FileNotFoundError, OSError, ValueError) as e:
                warnings.warn(f"cannot open the replica store {name}: {e}")
        images = []
        for store in stores:
            for s in store.steps():
                if step is not None and s != step:
                    continue
                try:
                    snap = store.restore(step=s, verify=False)
                    img = snap and _Image(snap)
                except (CheckpointCorruptError, FileNotFoundError, ValueError) as e:
                    warnings.warn(f"ignoring an in-memory checkpoint: {e}")
                    continue
                if img is not None and "rank" in img.doc and "world_size" in img.doc:
                    images.append(img)
        return images

    def _load_exchange(self, d, step, rank, world, disk_max, layout, device):
        """The newest step that memory somewhere in the world holds for every
        rank of the world that saved it (not older than disk's latest),
        exchanged between the ranks over the process group and resharded
        like a disk load; (step, state), or None (then disk) when there is
        none or any rank fails. Collective: every rank calls it."""
        local = self._inventory(step)
        meta = [(img.doc["rank"], img.doc["world_size"], img.snap.step, img.snap.image_bytes,
                 img.source.startswith("replica:"),
                 {k: v for k, v in img.shard_nodes().items() if v[0] != v[2]}, img.geometry())
                for img in local]
        everyone = [None] * world
        d.all_gather_object(everyone, meta)
        # (world, step) -> {saved rank: [(new rank, index in its inventory)]}
        held = {}
        for r, items in enumerate(everyone):
            for i, (j, w, s, _n, _rep, _p, _g) in enumerate(items):
                held.setdefault((w, s), {}).setdefault(j, []).append((r, i))
        complete = [(s, w == world, w) for (w, s), ranks in held.items()
                    if s >= disk_max and all(j in ranks for j in range(w))]
        if not complete:
            return None
        s, _, w = max(complete)  # newest step; a tie goes to this world's size, then the larger
        ranks = held[(w, s)]

        def info(j):
            r, i = ranks[j][0]
            return everyone[r][i]

        shards = layout.specs(info(0)[6])  # the saved DTensors' slices in this world
        targets = layout.targets

        # The saved ranks this rank needs: its own (rank, or rank 0's for the
        # plain entries when it is new) and, to reshard, every saved shard
        # that overlaps a requested slice.
        own = rank if rank < w else (0 if shards else None)
        need = set() if own is None else {own}
        for key, (gs, off, shape) in shards.items():
            for j in range(w):
                piece = info(j)[5].get(key)
                if piece is not None and piece[0] == gs and all(
                        a < b + m and b < a + n for a, n, b, m in zip(off, shape, piece[1], piece[2])):
                    need.add(j)
        mine = {}  # saved rank -> this rank's own image of it
        for img in local:
            if (img.doc["world_size"], img.snap.step) == (w, s):
                mine.setdefault(img.doc["rank"], img)
        wants = [None] * world
        d.all_gather_object(wants, (own is not None, sorted(need - set(mine))))
        if not all(ok for ok, _ in wants):
            return None  # a new rank without shards=: the disk load says what to do
        # Each missing image comes from one of its holders: the saving rank's
        # own memory before a replica, spread over the holders.
        sends, recvs, load = [], {}, {}
        for dst, (_, missing) in enumerate(wants):
            for j in missing:
                src, i = min(ranks[j], key=lambda h: (everyone[h[0]][h[1]][4], load.get(h[0], 0), h[0]))
                load[src] = load.get(src, 0) + 1
                if src == rank:
                    sends.append((j, dst))
                if dst == rank:
                    recvs[j] = (src, everyone[src][i][4])
        images, ok = dict(mine), 1
        try:
            works = []
            nccl = d.get_backend() == "nccl"
            inbox = {}
            for j, (src, _) in sorted(recvs.items()):
                buf = torch.empty(info(j)[3], dtype=torch.uint8, device="cuda") if nccl else _fresh(info(j)[3])
                inbox[j] = buf
                works.append(d.irecv(buf, src=src, tag=j))
            outbox = []
            for j, dst in sends:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # read-only memory: sending only reads it
                    t = torch.frombuffer(mine[j].snap.image_view(), dtype=torch.uint8)
                outbox.append(t.cuda() if nccl else t)
                works.append(d.isend(outbox[-1], dst=dst, tag=j))
            for work in works:
                work.wait()
            del outbox
            for j, buf in inbox.items():
                buf = buf.cpu()
                src, replica = recvs[j]
                img = _Image(_C._snapshot_at(buf.data_ptr(), buf.numel(),
                                             f"{'replica:' if replica else ''}rank{src}:step{s}:saved-rank{j}"))
                img.keepalive = buf
                images[j] = img
            state = None
            used = [images[j] for j in sorted(need)]
            if not shards:
                state = images[own].materialize(device, verify=self.verify, into=targets,
                                                layout=layout)  # verified as copied
            else:
                if self.verify:
                    for img in used:
                        img.snap.verify()
                own_pieces = images[own].shard_nodes()
                for key in shards:
                    if key not in own_pieces:
                        raise ValueError(f"shards names '{key}', which is not a tensor of checkpoint step {s}")
                assembled = {key: _assemble(key, want, used, targets.get(key)) for key, want in shards.items()}
                state = images[own].materialize(device, replace=assembled, into=targets, layout=layout)
        except (CheckpointCorruptError, ValueError) as e:
            warnings.warn(f"not loading step {s} from the world's memory: {e}")
            ok = 0
        if not _all_reduce_min(d, [ok])[0]:  # every rank uses memory, or none does
            return None
        self.last_load_source = "replica" if any(img.source.startswith("replica:") for img in used) else "memory"
        got = ", ".join(f"saved rank {j} from rank {src}{' (a replica)' if rep else ''}"
                        for j, (src, rep) in sorted(recvs.items()))
        print(f"ballast: rank {rank}: checkpoint step {s} of {w} ranks loaded from the world's memory in a "
              f"world of {world}{'; ' + got if got else ''}", file=sys.stderr, flush=True)
        return s, state

    def _memory_image(self, step, rank, world, layout):
        """(image, its step) of `step` (None: the newest) in this rank's memory,
        or (image or None, -1) when there is none this rank and world can use.
        Not verified here: the load verifies while it copies."""
        try:
            snap = self._store.restore(step=step, verify=False)
            if snap is None:
                return None, -1
            img = _Image(snap)
            return img, (snap.step if self._memory_usable(img, rank, world, layout) else -1)
        except CheckpointCorruptError as e:
            # Shared memory is a cache of the disk: fall back rather than fail.
            warnings.warn(f"ignoring the in-memory checkpoint: {e}")
            return None, -1

    @staticmethod
    def _memory_usable(img, rank, world, layout):
        """Whether this rank's own image serves the load as it is: saved by
        this rank in this world, with every requested slice (shards=, the
        DTensors' pieces on the current mesh) the very piece it saved. Sets
        img.specs to the load's slices."""
        doc = img.doc
        img.specs = layout.specs(img.geometry())
        # (An image without a tree, written by another tool, records no rank.)
        if doc.get("rank", rank) != rank or doc.get("world_size", world) != world:
            return False
        pieces = img.shard_nodes()  # also checks that every referenced entry exists
        for key, (gs, off, shape) in img.specs.items():
            if pieces.get(key) != (gs, off, shape):
                return False
        return True

    def _load_disk(self, step, rank, world, device, layout):
        targets = layout.targets
        path = _C.shard_path(self.dir, step, rank)
        own = None
        if os.path.exists(path):
            # Disk is always verified: here while it is copied.
            own = _Image(_C.read_file(path, verify=False))
            usable = self._memory_usable(own, rank, world, layout)
            if usable or not own.specs:
                return own.materialize(device, shards_as_tensors=set(own.specs), verify=True, into=targets,
                                       layout=layout)
        missing = (f"Checkpoint step {step} in {self.dir} has no shard for rank {rank}: it was saved by fewer "
                   "ranks; pass shards= (or the new world's DTensors in into=) to reshard sharded tensors")
        try:
            # This rank's file is read already: verified, not read again.
            images = _read_all_ranks(self.dir, step, have={} if own is None else {rank: own})
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e}. {missing}") from None
        own = own or images[0][1]
        shards = layout.specs(own.geometry())
        if not shards:
            raise FileNotFoundError(missing)
        imgs = [img for _, img in images]
        own_pieces = own.shard_nodes()
        for key in shards:
            if key not in own_pieces:
                raise ValueError(f"shards names '{key}', which is not a tensor of checkpoint step "
                                 f"{step} (it has: {', '.join(sorted(own_pieces)) or 'none'})")
        assembled = {key: _assemble(key, want, imgs, targets.get(key)) for key, want in shards.items()}
        return own.materialize(device, replace=assembled, into=targets, layout=layout)

    # -- lifetime --------------------------------------------------------------

    def close(self):
        """Finishes pending persistence and releases the shared memory.

        Example::

            with ballast.Checkpointer("/ckpt") as ckpt:
                ckpt.save(1, state)
        """
        self._pins = []
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read_all_ranks(dir, step, have=None):
    """[(rank, _Image)] of every rank-*.ballast file of step, verified.
    have: {rank: _Image} of files the caller read already (verified here)."""
    step_dir = _C.step_dir(dir, step)
    out = []
    for path in glob.glob(os.path.join(glob.escape(step_dir), "rank-*.ballast")):
        m = re.fullmatch(r"rank-(\d+)\.ballast", os.path.basename(path))
        if m:
            r = int(m.group(1))
            img = (have or {}).get(r)
            if img is not None:
                img.snap.verify()
            else:
                img = _Image(_C.read_file(path))
            out.append((r, img))
    if not out:
        raise FileNotFoundError(f"checkpoint step {step} has no shard files in {step_dir}")
    out.sort(key=lambda x: x[0])
    return out


def read_checkpoint(dir, step=None, rank=0, *, full=False):
    """Reads one rank's state of a step from disk, without shared memory.

    Args:
        dir: checkpoint directory.
        step: the step (default: ``<dir>/latest``).
        rank: whose shard to read.
        full: return every ``ballast.Shard`` as its whole global tensor,
            assembled from all ranks' files (else as the rank's own Shard).

    Returns ``(step, state)``. Raises FileNotFoundError when there is no such
    step, CheckpointCorruptError when a file fails its checksums.

    Example::

        step, state = ballast.read_checkpoint("/ckpt/run1", rank=0, full=True)
        torch.save(state, "model.pt")
    """
    dir = os.path.abspath(os.fspath(dir))
    if step is None:
        step = _C.read_latest_step(dir)
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {dir} (no 'latest' file): "
                                    "pass the step explicitly, `ballast ckpt ls` lists them")
    if not full:
        return step, _Image(_C.read_file(_C.shard_path(dir, step, rank))).materialize()
    images = _read_all_ranks(dir, step)
    own = next((img for r, img in images if r == rank), images[0][1])
    imgs = [img for _, img in images]
    wants = {k: (gs, (0,) * len(gs), gs) for k, (gs, _off, _shape) in own.shard_nodes().items()}
    sharded = {}
    refs = []
    _tree.walk_refs(own.doc["tree"], refs)
    for node in refs:
        if "s" in node:
            sharded[node["s"]] = _assemble(node["s"], wants[node["s"]], imgs)
    return step, own.materialize(replace=sharded)
