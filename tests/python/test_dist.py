"""Ranks agree on memory vs disk through torch.distributed (gloo, 2 processes)."""

import json
import os
import subprocess
import sys
import unittest

from _util import TestCase, free_port

WORKER = r"""
import json, os, sys, torch, torch.distributed as dist, ballast
dist.init_process_group("gloo")
rank = dist.get_rank()
ckpt = ballast.Checkpointer(sys.argv[1])
log = []
def load():
    step, state = ckpt.load()
    log.append([step, ckpt.last_load_source, None if state is None else int(state["v"])])
load()                                                  # nothing anywhere
ckpt.save(1, {"v": torch.tensor(10 + rank)}, persist=True)
ckpt.wait()
dist.barrier()
load()                                                  # both hold 1 in memory
if rank == 0:
    ckpt.save(2, {"v": torch.tensor(20)})               # only rank 0 has step 2
load()                                                  # both still hold 1 -> memory step 1
ckpt.save(3, {"v": torch.tensor(30 + rank)})
load()                                                  # both hold 3 -> memory
if rank == 0:
    ckpt.save(4, {"v": torch.tensor(40)})               # rank 0 holds 3 and 4,
    ckpt.save(5, {"v": torch.tensor(50)})               # then 4 and 5: no step in common
load()                                                  # -> step 1: rank 0 from disk, rank 1
                                                        #    from memory (its other slot)
json.dump(log, open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w"))
dist.destroy_process_group()
"""


class Distributed(TestCase):
    def test_ranks_use_the_newest_step_all_hold_in_memory_else_disk(self):
        port = free_port()
        procs = []
        for rank in range(2):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE="2", LOCAL_RANK=str(rank))
            env.pop("BALLAST_CKPT_SHM", None)
            procs.append(subprocess.Popen(
                [sys.executable, "-c", WORKER, os.path.join(self.tmp, "ckpt"), self.tmp], env=env))
        for p in procs:
            self.assertEqual(p.wait(timeout=120), 0)
        for rank in range(2):
            with open(os.path.join(self.tmp, f"rank{rank}.json")) as f:
                log = json.load(f)
            self.assertEqual(log, [
                [None, None, None],
                [1, "memory", 10 + rank],
                [1, "memory", 10 + rank],
                [3, "memory", 30 + rank],
                [1, "disk" if rank == 0 else "memory", 10 + rank],
            ])


if __name__ == "__main__":
    unittest.main()
