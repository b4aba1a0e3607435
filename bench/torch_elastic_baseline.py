"""torch's own elastic agent as a baseline launcher (torch 1.13 and 2.x).

`python3 -m torch.distributed.run` crashes on Python 3.11 in torch 1.13 (to_map),
so this calls torch.distributed.launcher.api.elastic_launch directly with the
same settings torchrun would use, and explicit redirects/tee (torch 2.3+ takes
them as LaunchConfig.logs_specs, a DefaultLogsSpecs, where 1.13 took
LaunchConfig.redirects/tee).

usage: torch_elastic_baseline.py --nproc-per-node N --monitor-interval S script.py args...
"""
import argparse
import dataclasses
import sys
import uuid

from torch.distributed.elastic.multiprocessing import Std
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def output_settings():
    """Workers' stdout/stderr to the console (no redirects, no tee), in the
    form this torch's LaunchConfig takes."""
    if "logs_specs" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
        return {"logs_specs": DefaultLogsSpecs(redirects=Std.NONE, tee=Std.NONE)}
    return {"redirects": Std.NONE, "tee": Std.NONE}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--monitor-interval", type=float, default=5.0)  # torchrun's CLI default
    p.add_argument("--port", type=int, default=29400)
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=a.nproc_per_node, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{a.port}", rdzv_configs={"timeout": 60},
        max_restarts=a.max_restarts, monitor_interval=a.monitor_interval, start_method="spawn",
        **output_settings())
    elastic_launch(config, sys.executable)("-u", a.script, *a.args)


if __name__ == "__main__":
    main()
