"""DLRover's `dlrover-run` as a baseline launcher (torch 1.13, Python 3.11).

Runs dlrover.trainer.torch.elastic_run.main (what the `dlrover-run` console
script calls) with its own command line, e.g.

    PYTHONPATH=~/.cache/ballast/dlrover-0.6.1 /usr/bin/python3 bench/dlrover_baseline.py \
        --standalone --nproc_per_node 2 --monitor_interval 5 script.py args...

With --standalone, dlrover-run starts its own job master locally (a
subprocess, `python -m dlrover.python.master.main --platform local`) and its
agent rendezvouses through it. The one change here: torch 1.13's
Std.from_str returns None for "0" on Python 3.11 (IntFlag iteration skips the
zero member), so torchrun's default --redirects/--tee 0 crash in to_map; the
same bug that keeps `python3 -m torch.distributed.run` from running here (see
torch_elastic_baseline.py). It is patched to build Std from the int.
"""
import re

from torch.distributed.elastic.multiprocessing import api as mp_api


def _from_str(cls, vm):
    if re.match(mp_api._VALUE_REGEX, vm):
        return cls(int(vm))
    if re.match(mp_api._MAPPING_REGEX, vm):
        return {int(i): cls(int(v)) for i, v in (m.split(":") for m in vm.split(","))}
    raise ValueError(f"{vm} does not match: <{mp_api._VALUE_REGEX}> or <{mp_api._MAPPING_REGEX}>")


mp_api.Std.from_str = classmethod(_from_str)

from dlrover.trainer.torch.elastic_run import main  # noqa: E402  (after the patch)

if __name__ == "__main__":
    main()
