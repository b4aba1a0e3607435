"""Helpers the benchmarks share (run them as `python bench/NAME.py`: this
directory is then on sys.path)."""
import re
import socket


def free_port():
    """A TCP port on 127.0.0.1 free now (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def patch_torch113_std():
    """torch 1.13's Std.from_str returns None for "0" on Python 3.11 (IntFlag
    iteration skips the zero member), so torchrun's default --redirects/--tee
    0 crash in to_map, which keeps `python3 -m torch.distributed.run` (and
    dlrover-run, built on it) from running here. Builds Std from the int."""
    from torch.distributed.elastic.multiprocessing import api as mp_api

    def _from_str(cls, vm):
        if re.match(mp_api._VALUE_REGEX, vm):
            return cls(int(vm))
        if re.match(mp_api._MAPPING_REGEX, vm):
            return {int(i): cls(int(v)) for i, v in (m.split(":") for m in vm.split(","))}
        raise ValueError(f"{vm} does not match: <{mp_api._VALUE_REGEX}> or <{mp_api._MAPPING_REGEX}>")

    mp_api.Std.from_str = classmethod(_from_str)


def make_state(nbytes):
    """A model-like state of ~nbytes: 16 MiB float32 tensors plus small ones
    (the flash-checkpoint benchmarks share it; nothing here imports ballast,
    which DLRover's workers run without)."""
    import torch

    big = 16 << 20
    state = {"model": {}, "opt": {"step": 10, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}}
    left, i = nbytes, 0
    while left > 0:
        n = min(big, left)
        state["model"][f"layer{i}.weight"] = torch.randn(max(n // 4, 1))
        left -= n
        i += 1
    state["model"]["norm.bias"] = torch.zeros(1024)
    return state
