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
from _benchutil import patch_torch113_std

patch_torch113_std()

from dlrover.trainer.torch.elastic_run import main  # noqa: E402  (after the patch)

if __name__ == "__main__":
    main()
