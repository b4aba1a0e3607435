"""Distributed tensors in flash checkpoints: DTensor (FSDP2, TP, HSDP) and
ShardedTensor (FSDP1's SHARDED_STATE_DICT).

A rank saves only its local piece, with its geometry: the global shape, the
piece's offsets in it and, for a DTensor, the device mesh's shape and the
placements. On load the pieces of every saved rank are cut and pasted into the
pieces the new world's DTensors hold (any world size, mesh and split, uneven
ones included), so N ranks' checkpoint loads on M.

Placements supported: ``Shard(d)`` and ``Replicate()`` on meshes of any
dimension. ``Partial`` (pending reduction) values and ``_StridedShard`` (FSDP2
over TP) are refused with what to do instead.

torch 1.13 has neither DTensor nor a usable mesh: everything here is then a
no-op, and a ShardedTensor is still handled.

Nothing is imported from torch.distributed.tensor until a DTensor is met
(importing it costs 0.4 s on torch 2.15, at every `import ballast`
otherwise): an object can only be a DTensor once its module is loaded.
"""

import math
import sys
import types
import warnings

import torch

_DTENSOR_MODULE = "torch.distributed.tensor"
_SHARDED_TENSOR_MODULE = "torch.distributed._shard.sharded_tensor"
_api = None


def _dt():
    """torch's DTensor API (a namespace), or None on a torch without it."""
    global _api
    if _api is None:
        try:  # torch >= 2.4
            from torch.distributed.tensor import DTensor, Replicate, Shard
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
            _api = types.SimpleNamespace(DTensor=DTensor, Replicate=Replicate, Shard=Shard,
                                         local_shape_and_offset=compute_local_shape_and_global_offset)
        except ImportError:  # torch 1.13
            _api = False
    return _api or None


def is_dtensor(obj):
    mod = sys.modules.get(_DTENSOR_MODULE)
    return mod is not None and isinstance(obj, getattr(mod, "DTensor", ()))


def is_sharded_tensor(obj):
    mod = sys.modules.get(_SHARDED_TENSOR_MODULE)
    return mod is not None and isinstance(obj, getattr(mod, "ShardedTensor", ()))


def _where(path):
    return "/".join(str(p) for p in path) or "<root>"


def encode_placements(placements, ndim, path):
    """["S0", "R", ...] for the placements of a DTensor; TypeError for those a
    checkpoint cannot hold as a piece of the global tensor."""
    out = []
    for p in placements:
        if type(p) is _dt().Shard:  # noqa: E721 (_StridedShard is a subclass: a different layout)
            out.append(f"S{p.dim % max(ndim, 1)}")
        elif isinstance(p, _dt().Replicate):
            out.append("R")
        elif p.is_partial():
            raise TypeError(
                f"cannot checkpoint the DTensor at '{_where(path)}': its placement {p} holds a pending "
                "reduction; save t.redistribute(placements=[Replicate()]) (or t.full_tensor()) instead")
        else:
            raise TypeError(
                f"cannot checkpoint the DTensor at '{_where(path)}': placement {p} is not supported "
                "(Shard(d) and Replicate() are); save t.redistribute(...) to those, or t.full_tensor()")
    return out


def decode_placements(codes):
    api = _dt()
    return [api.Replicate() if c == "R" else api.Shard(int(c[1:])) for c in codes]


def local_box(global_shape, mesh, placements, where=""):
    """(offsets, shape) of this rank's piece of a DTensor of global_shape laid
    out on mesh with placements (torch's own split: uneven ones included)."""
    shape, offsets = _dt().local_shape_and_offset(torch.Size(global_shape), mesh, placements)
    if len(shape) != len(global_shape) or (len(offsets) != len(global_shape) and math.prod(shape) != 0):
        raise ValueError(f"this rank holds no piece of the DTensor '{where}' on mesh {mesh} "
                         "(is it a member of the mesh?)")
    if len(offsets) != len(global_shape):
        offsets = (0,) * len(global_shape)
    return tuple(int(x) for x in offsets), tuple(int(x) for x in shape)


def dtensor_piece(t, path):
    """(local tensor, global shape, offsets, mesh shape, placement codes) of a DTensor."""
    where = _where(path)
    gshape = tuple(int(x) for x in t.shape)
    codes = encode_placements(t.placements, len(gshape), path)
    offsets, shape = local_box(gshape, t.device_mesh, t.placements, where)
    local = t._local_tensor  # to_local() may wrap it for autograd; the data is the same
    if tuple(local.shape) != shape:
        raise TypeError(f"cannot checkpoint the DTensor at '{where}': its local tensor is {tuple(local.shape)}, "
                        f"not the {shape} its placements {list(t.placements)} give (padded?)")
    return local, gshape, offsets, tuple(int(x) for x in t.device_mesh.shape), codes


def sharded_tensor_piece(t, path):
    """(local tensor, global shape, offsets) of a ShardedTensor holding at most
    one local shard (what FSDP1's sharded state dicts hold)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's "deprecating ShardedTensor": the user's choice
        gshape = tuple(int(x) for x in t.size())
        shards = t.local_shards()
    if len(shards) > 1:
        raise TypeError(f"cannot checkpoint the ShardedTensor at '{_where(path)}': it holds {len(shards)} local "
                        "shards on this rank (one is supported); save each as a ballast.Shard")
    if not shards:  # this rank holds nothing of it (an uneven split): an empty piece
        empty = torch.empty((0,) + gshape[1:], dtype=t.dtype) if gshape else torch.empty((), dtype=t.dtype)
        return empty, gshape, (0,) * len(gshape)
    md = shards[0].metadata
    return shards[0].tensor, gshape, tuple(int(x) for x in md.shard_offsets)


def contiguous_strides(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


class Layout:
    """What a load must produce: the slices (global shape, offsets, shape) to
    assemble, the caller's tensors to fill, and how to hand back distributed
    tensors.

    - ``shards``: the caller's explicit ``load(shards=...)``;
    - every DTensor / ShardedTensor in ``into``: its local piece is filled in
      place and the state holds that very object;
    - a saved DTensor with no target in ``into`` (an optimizer's state before
      its first step) comes back as a DTensor with its saved placements on the
      current mesh: ``mesh``, else the mesh of a DTensor in ``into`` of the
      same dimension, else a 1-D mesh over the world; or as the full tensor
      with ``full=True`` (or when torch.distributed is not initialized).
    """

    def __init__(self, targets, dist_targets, shards, mesh=None, full=False):
        self.targets = dict(targets)  # key -> plain tensor to fill
        self.fixed = dict(shards)     # key -> (global shape, offsets, shape)
        self.wrap = {}                # key -> the caller's DTensor/ShardedTensor
        self.mesh = mesh
        self.full = full
        self.meshes = []
        self.made = {}                # key -> (mesh, placements) of a DTensor to build
        self._world_mesh = None
        for key, obj in dist_targets.items():
            path = key.split("/")
            if is_dtensor(obj):
                local, gshape, offsets, _, _ = dtensor_piece(obj, path)
                if obj.device_mesh not in self.meshes:
                    self.meshes.append(obj.device_mesh)
            else:
                local, gshape, offsets = sharded_tensor_piece(obj, path)
            self.fixed[key] = (gshape, offsets, tuple(local.shape))
            self.targets[key] = local
            self.wrap[key] = obj

    def specs(self, geometry):
        """{key: (global shape, offsets, shape)} for a checkpoint whose saved
        DTensors have ``geometry`` ({key: (global shape, mesh shape, placement
        codes)}, see geometry_of)."""
        out = dict(self.fixed)
        for key, (gshape, mesh_shape, codes) in geometry.items():
            if key in out:
                continue
            mesh, placements = self._mesh_for(mesh_shape, codes)
            if mesh is None:
                out[key] = (gshape, (0,) * len(gshape), gshape)
                self.made.pop(key, None)
                continue
            offsets, shape = local_box(gshape, mesh, placements, key)
            out[key] = (gshape, offsets, shape)
            self.made[key] = (mesh, placements, gshape)
        return out

    def _mesh_for(self, mesh_shape, codes):
        if self.full or _dt() is None:
            return None, None
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return None, None
        placements = decode_placements(codes)
        cands = ([self.mesh] if self.mesh is not None else []) + self.meshes
        same = [m for m in cands if m.ndim == len(codes)]
        if same:
            exact = [m for m in same if tuple(m.shape) == tuple(mesh_shape)]
            return (exact or same)[0], placements
        if cands:
            # Another dimension: keep the saved sharding's dimension on a 1-D mesh.
            one_d = [m for m in cands if m.ndim == 1]
            if one_d:
                shard = next((p for p in placements if not isinstance(p, _dt().Replicate)), _dt().Replicate())
                return one_d[0], [shard]
        # No mesh to follow: a 1-D mesh over the world, sharded along the
        # saved sharding's dimension. Made from the default group (no new
        # group: ranks reach this point at different times, so it must not be
        # a collective).
        if self._world_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh
            device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
            self._world_mesh = DeviceMesh.from_group(torch.distributed.group.WORLD, device)
        shard = next((p for p in placements if not isinstance(p, _dt().Replicate)), _dt().Replicate())
        return self._world_mesh, [shard]

    def finish(self, key, tensor):
        """The object the loaded state holds for a saved DTensor/ShardedTensor
        piece `key` whose data is now in `tensor`; None when it stays a plain
        tensor (or ballast.Shard)."""
        obj = self.wrap.get(key)
        if obj is not None:
            local = self.targets.get(key)
            if local is not None and tensor is not local and local.numel():
                with torch.no_grad():
                    local.copy_(tensor)
            return obj
        made = self.made.get(key)
        if made is not None:
            mesh, placements, gshape = made
            t = tensor.to(mesh.device_type) if tensor.device.type != mesh.device_type else tensor
            return _dt().DTensor.from_local(t, mesh, placements, run_check=False, shape=torch.Size(gshape),
                                      stride=contiguous_strides(gshape))
        return None


def geometry_of(tree_refs):
    """{key: (global shape, mesh shape, placement codes)} of the DTensor pieces
    among a state tree's nodes."""
    out = {}
    for node in tree_refs:
        if "s" in node and "dm" in node:
            out[node["s"]] = (tuple(node["gs"]), tuple(node["dm"]), tuple(node["dp"]))
    return out
