"""State-dict encoding without pickle.

A saved state is one checkpoint image (src/ckpt/format.h) holding:

* one entry per tensor, keyed by its path in the state ("model/layer.0.weight",
  "optim/state/0/exp_avg": container keys joined by "/"), with the tensor's
  dtype, shape and raw bytes;
* one blob entry ``__ballast__/tree`` with a JSON document describing everything
  else: the container structure and the plain values.

The JSON tree uses plain JSON values for None, bool, int, finite float and str,
and a one-key-object tag for everything else, so decoding is unambiguous and no
code ever runs on load::

    {"t": key, "g": 1}          tensor (g: requires_grad)
    {"s": key, "gs": [...], "go": [...]}   Shard of a global tensor
        + "dm": [mesh shape], "dp": ["S0", "R", ...]   a DTensor's local piece
        + "st": 1                              a ShardedTensor's local shard
    {"d": [[k, v], ...]}        dict (keys are encoded values: int keys stay int)
    {"o": [[k, v], ...], "m": metadata}    OrderedDict (with torch's _metadata)
    {"l": [...]} / {"u": [...]} / {"z": [...]}   list / tuple / torch.Size
    {"f": "nan" | "inf" | "-inf"}          non-finite float
    {"b": base64} / {"B": key}  bytes inline / in a blob entry
    {"dt": "float32"} / {"dv": "cuda:0"}   torch.dtype / torch.device
"""

import base64
import collections
import json
import math

import torch

from ballast import _dtensor

TREE_KEY = "__ballast__/tree"
FORMAT_VERSION = 1
# bytes values larger than this get their own blob entry instead of base64.
_INLINE_BYTES = 4096

_DTYPES = [
    "float32", "float64", "float16", "bfloat16", "complex32", "complex64", "complex128",
    "uint8", "int8", "int16", "int32", "int64", "bool", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
]
# torch dtype <-> format name, for the dtypes this torch has.
DTYPE_TO_NAME = {getattr(torch, n): n for n in _DTYPES if isinstance(getattr(torch, n, None), torch.dtype)}
NAME_TO_DTYPE = {n: d for d, n in DTYPE_TO_NAME.items()}


class Shard:
    """A rank's local piece of a larger ("global") tensor, as FSDP/DTensor shard.

    Save a ``Shard`` where the state holds a sharded tensor; the checkpoint
    records the global shape and the offsets of this piece, so a different
    number of ranks can later load any slice of the global tensor
    (``Checkpointer.load(shards=...)``).

    Args:
        tensor: the local data, of shape ``tensor.shape``.
        global_shape: the shape of the whole tensor.
        offsets: where ``tensor`` starts in the global tensor, per dimension.

    Example::

        # rank r of 4 holds rows [r*25, r*25+25) of a 100 x 8 weight
        w = ballast.Shard(local_rows, global_shape=(100, 8), offsets=(r * 25, 0))
        ckpt.save(step, {"w": w})
    """

    __slots__ = ("tensor", "global_shape", "offsets")

    def __init__(self, tensor, global_shape, offsets):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Shard needs a torch.Tensor, got {type(tensor).__name__}")
        global_shape = tuple(int(x) for x in global_shape)
        offsets = tuple(int(x) for x in offsets)
        if len(global_shape) != tensor.dim() or len(offsets) != tensor.dim():
            raise ValueError(
                f"Shard of a {tensor.dim()}-d tensor needs {tensor.dim()} global dims and offsets, "
                f"got global_shape={global_shape} offsets={offsets}")
        for d, (n, o, g) in enumerate(zip(tensor.shape, offsets, global_shape)):
            if o < 0 or o + n > g:
                raise ValueError(
                    f"Shard dim {d}: offset {o} + size {n} lies outside the global size {g}")
        self.tensor = tensor
        self.global_shape = global_shape
        self.offsets = offsets

    def __repr__(self):
        return (f"Shard(shape={tuple(self.tensor.shape)}, global_shape={self.global_shape}, "
                f"offsets={self.offsets}, dtype={self.tensor.dtype})")


def _dtype_name(t, path):
    """The name a save stores t's dtype under; TypeError (naming the path)
    for a tensor a save refuses."""
    where = "/".join(path) or "<root>"
    if t.layout != torch.strided:
        raise TypeError(f"cannot checkpoint the {t.layout} tensor at '{where}': only dense "
                        "tensors are supported (call .to_dense() first)")
    if t.is_quantized:
        raise TypeError(f"cannot checkpoint the quantized tensor at '{where}' "
                        "(call .dequantize() or save its int_repr() and scale)")
    name = DTYPE_TO_NAME.get(t.dtype)
    if name is None:
        raise TypeError(f"cannot checkpoint the tensor at '{where}': dtype {t.dtype} is not supported")
    return name


def _prepare_tensor(t, path, keep_device=False):
    """A CPU (or, with keep_device, the tensor's own device), contiguous,
    plain-strided tensor with the same values, and its dtype name."""
    name = _dtype_name(t, path)
    t = t.detach()
    if t.device.type != "cpu" and not keep_device:
        t = t.cpu()  # through torch: synchronizes the copy from the device
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t, name


class HostBuffers:
    """Pinned host buffers for the CUDA tensors of a state, kept from save to
    save (pinning is slow; a buffer is reused while its key keeps its shape
    and dtype), and one side stream per device for the device-to-host copies.

    The copies of one save are queued together on the side stream, which
    first waits for the work already queued on the tensor's current stream
    (the values are final), so they run back to back at full DMA speed
    without a synchronization per tensor and without stalling the training
    stream; the save then waits for the side stream before it reads the
    buffers. Memory: one pinned host copy of the state's CUDA tensors.

    UNTESTED on GPUs (no accelerator here): written and reviewed only.
    """

    def __init__(self):
        self._buffers = {}
        self._streams = {}

    def buffer(self, key, t):
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != t.dtype or buf.shape != t.shape:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._buffers[key] = buf
        return buf

    def copy(self, pairs):
        """Copies each (host buffer, device tensor) pair and waits for all."""
        by_device = {}
        for host, t in pairs:
            by_device.setdefault(t.device, []).append((host, t))
        streams = []
        for device, items in by_device.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for host, t in items:
                    host.copy_(t, non_blocking=True)
                    # The caching allocator must not reuse t's memory before the copy ran.
                    t.record_stream(stream)
            streams.append(stream)
        for stream in streams:
            stream.synchronize()


class Encoder:
    """Turns a state into the JSON tree plus (key, dtype, shape, data, nbytes) entries.

    host_buffers: a HostBuffers for CUDA tensors (pinned buffers and a side
    stream; call finish() before the entries are read); without it a CUDA
    tensor is copied with tensor.cpu().
    """

    def __init__(self, host_buffers=None):
        self.entries = []
        self.keepalive = []  # the tensors whose memory the entries point at
        self._used = {TREE_KEY}
        self._host = host_buffers
        self._d2h = []  # (pinned host buffer, device tensor) still to copy

    def _key(self, path):
        key = "/".join(path) or "."
        if key in self._used:
            n = 1
            while f"{key}#{n}" in self._used:
                n += 1
            key = f"{key}#{n}"
        self._used.add(key)
        return key

    def _tensor(self, t, path):
        cuda = self._host is not None and t.device.type == "cuda"
        t, name = _prepare_tensor(t, path, keep_device=cuda)
        key = self._key(path)
        if cuda:
            host = self._host.buffer(key, t)
            self._d2h.append((host, t))
            self.keepalive.append(t)
            t = host
        self.keepalive.append(t)
        self.entries.append((key, name, tuple(t.shape), t.data_ptr(), t.numel() * t.element_size()))
        return key

    def finish(self):
        """Completes the device-to-host copies: the entries' data is then final."""
        if self._d2h:
            self._host.copy(self._d2h)
            self._d2h = []

    def _dist_node(self, obj, local, path, geometry):
        out = {"s": self._tensor(local, path)}
        out.update(geometry)
        return out

    def node(self, obj, path):
        if obj is None or obj is True or obj is False:
            return obj
        if _dtensor.is_dtensor(obj):
            # Only this rank's piece, with its geometry: no gather.
            local, gshape, offsets, mesh_shape, codes = _dtensor.dtensor_piece(obj, path)
            return self._dist_node(obj, local, path, {"gs": list(gshape), "go": list(offsets),
                                                      "dm": list(mesh_shape), "dp": codes})
        if _dtensor.is_sharded_tensor(obj):
            local, gshape, offsets = _dtensor.sharded_tensor_piece(obj, path)
            return self._dist_node(obj, local, path, {"gs": list(gshape), "go": list(offsets), "st": 1})
        if isinstance(obj, torch.Tensor):
            out = {"t": self._tensor(obj, path)}
            if obj.requires_grad:
                out["g"] = 1
            return out
        if isinstance(obj, Shard):
            return {"s": self._tensor(obj.tensor, path), "gs": list(obj.global_shape),
                    "go": list(obj.offsets)}
        if isinstance(obj, bool):  # a bool subclass
            return bool(obj)
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            v = float(obj)
            if math.isfinite(v):
                return v
            return {"f": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if isinstance(obj, str):
            return str(obj)
        if isinstance(obj, (bytes, bytearray, memoryview)):
            data = bytes(obj)
            if len(data) <= _INLINE_BYTES:
                return {"b": base64.b64encode(data).decode("ascii")}
            key = self._key(path)
            self.keepalive.append(data)
            self.entries.append((key, "blob", (), data, len(data)))
            return {"B": key}
        if isinstance(obj, dict):
            items = [[self.node(k, path + ("<key>",)), self.node(v, path + (str(k),))]
                     for k, v in obj.items()]
            if isinstance(obj, collections.OrderedDict):
                out = {"o": items}
                meta = getattr(obj, "_metadata", None)
                if meta is not None:
                    out["m"] = self.node(meta, path + ("_metadata",))
                return out
            return {"d": items}
        if isinstance(obj, torch.Size):
            return {"z": [int(x) for x in obj]}
        if isinstance(obj, list):
            return {"l": [self.node(v, path + (str(i),)) for i, v in enumerate(obj)]}
        if isinstance(obj, tuple):
            return {"u": [self.node(v, path + (str(i),)) for i, v in enumerate(obj)]}
        if isinstance(obj, torch.dtype):
            return {"dt": str(obj).replace("torch.", "")}
        if isinstance(obj, torch.device):
            return {"dv": str(obj)}
        where = "/".join(path) or "<root>"
        raise TypeError(
            f"cannot checkpoint the {type(obj).__module__}.{type(obj).__qualname__} at '{where}': "
            "a state may hold tensors (DTensor and ShardedTensor too), ballast.Shard, None, bool, int, float, str, bytes, "
            "torch.dtype/device and dicts/lists/tuples of them (no pickle); convert it first")


class SizeEncoder(Encoder):
    """An Encoder whose entries carry each tensor's size only (data 0): what
    Store.reserve needs. Reads no tensor data and copies nothing, not even
    from a GPU."""

    def _tensor(self, t, path):
        name = _dtype_name(t, path)  # refuses what a save refuses
        key = self._key(path)
        self.entries.append((key, name, tuple(t.shape), 0, t.numel() * t.element_size()))
        return key


def encode_state(state, header, host_buffers=None, encoder=None):
    """Returns (entries for Store.save, objects to keep alive during the save).

    The tree blob comes first so that `ballast ckpt inspect` shows it on top.
    host_buffers: see Encoder. encoder: an Encoder to use instead (SizeEncoder).
    """
    enc = encoder if encoder is not None else Encoder(host_buffers)
    doc = dict(header)
    doc["format"] = FORMAT_VERSION
    doc["tree"] = enc.node(state, ())
    enc.finish()
    blob = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")
    entries = [(TREE_KEY, "blob", (), blob, len(blob))] + enc.entries
    return entries, (enc.keepalive, blob)


def parse_header(blob, source):
    """The JSON document of a tree blob; CheckpointCorruptError if it is not one."""
    from ballast._ballast import CheckpointCorruptError  # noqa: WPS433 (import cycle)
    try:
        doc = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointCorruptError(f"checkpoint {source}: unreadable state tree ({e})") from None
    if not isinstance(doc, dict) or "tree" not in doc:
        raise CheckpointCorruptError(f"checkpoint {source}: the state tree has no 'tree' field")
    if doc.get("format", 0) > FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"checkpoint {source} uses state format {doc.get('format')}, newer than this "
            f"ballast ({FORMAT_VERSION}): upgrade ballast to read it")
    return doc


def walk_refs(node, out):
    """Appends every tensor/shard/blob node of the tree to out."""
    if isinstance(node, dict):
        if "t" in node or "s" in node or "B" in node:
            out.append(node)
            return
        for tag in ("d", "o"):
            if tag in node:
                for k, v in node[tag]:
                    walk_refs(k, out)
                    walk_refs(v, out)
        for tag in ("l", "u"):
            if tag in node:
                for v in node[tag]:
                    walk_refs(v, out)
        if "m" in node:
            walk_refs(node["m"], out)


def decode(node, resolve):
    """Rebuilds the state; resolve(node) returns the object of a t/s/B node."""
    if not isinstance(node, dict):
        return node
    if "t" in node or "s" in node or "B" in node:
        return resolve(node)
    if "d" in node:
        return {_hashable(decode(k, resolve)): decode(v, resolve) for k, v in node["d"]}
    if "o" in node:
        out = collections.OrderedDict(
            (_hashable(decode(k, resolve)), decode(v, resolve)) for k, v in node["o"])
        if "m" in node:
            out._metadata = decode(node["m"], resolve)
        return out
    if "l" in node:
        return [decode(v, resolve) for v in node["l"]]
    if "u" in node:
        return tuple(decode(v, resolve) for v in node["u"])
    if "z" in node:
        return torch.Size(node["z"])
    if "f" in node:
        return float(node["f"])
    if "b" in node:
        return base64.b64decode(node["b"])
    if "dt" in node:
        return getattr(torch, node["dt"])
    if "dv" in node:
        return torch.device(node["dv"])
    from ballast._ballast import CheckpointCorruptError
    raise CheckpointCorruptError(f"unknown node in the checkpoint's state tree: {sorted(node)}")


def _hashable(key):
    # Dict keys were hashable when saved; lists only appear inside tuple keys.
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key
