"""A world that changed size loads from the memory the world still holds.

Four ranks saved step 7 (a row-sharded tensor as ballast.Shard, a replicated
tensor, a plain value) into four shared-memory stores, and to disk. Then the
world is two ranks (gloo, real processes): rank 0 holds saved rank 0's store
and, as the replicas its node kept for a lost node, saved ranks 2 and 3's
(BALLAST_CKPT_REPLICAS); rank 1 holds saved rank 1's. No rank holds its own
step in a world of its size, yet every saved rank's step is somewhere: the
ranks exchange the images they lack over the process group and reshard, with
no disk read. A corrupted image fails its checksum on arrival and the whole
world loads from disk instead (same step, same data).
"""

import glob
import json
import os
import secrets
import subprocess
import sys
import unittest

import torch

import ballast
from ballast import _ballast
from _util import TestCase, free_port, random_tensor, raw_bytes

GLOBAL = random_tensor((10, 6), torch.float32, seed=11)
OLD_ROWS = [(0, 3), (3, 3), (6, 2), (8, 2)]  # saved rank -> (first row, rows)
NEW_ROWS = [(0, 5), (5, 5)]

WORKER = r"""
import json, os, sys, torch, torch.distributed as dist, ballast
dist.init_process_group("gloo")
rank = dist.get_rank()
ckpt = ballast.Checkpointer(sys.argv[1])
first, rows = json.loads(sys.argv[3])[rank]
out = {}
step, state = ckpt.load()                       # plain: this rank's saved state
out["plain"] = [step, ckpt.last_load_source, state["rank"], state["w"].tensor.shape[0]]
step, state = ckpt.load(shards={"w": ((10, 6), (first, 0), (rows, 6))})
out["sharded"] = [step, ckpt.last_load_source, state["rank"], state["w"].tolist(), state["r"].tolist()]
json.dump(out, open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w"))
dist.destroy_process_group()
"""


class WorldMemory(TestCase):
    def setUp(self):
        super().setUp()
        self.dir = os.path.join(self.tmp, "ckpt")
        tag = f"/ballast-pytest-{os.getpid()}-{secrets.token_hex(4)}"
        self.stores = []
        for j, (first, rows) in enumerate(OLD_ROWS):
            state = {"w": ballast.Shard(GLOBAL[first:first + rows].clone(), (10, 6), (first, 0)),
                     "r": torch.arange(4) * 3, "rank": j}
            disk = ballast.Checkpointer(self.dir, rank=j, world_size=4)
            disk.save(7, state, persist=True)
            disk.wait()
            disk.close()
            store = _ballast.create_store(f"{tag}-s{j}")  # owned here: unlinked when closed
            self.addCleanup(store.close)
            self.stores.append(store)
            mem = ballast.Checkpointer(self.dir, rank=j, world_size=4, shm=store.name)
            mem.save(7, state)
            mem.close()

    def run_world(self):
        port = free_port()
        procs = []
        for rank in range(2):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE="2", LOCAL_RANK=str(rank), BALLAST_CKPT_SHM=self.stores[rank].name,
                       BALLAST_CKPT_REPLICAS=(f"{self.stores[2].name},{self.stores[3].name}" if rank == 0 else ""))
            procs.append(subprocess.Popen(
                [sys.executable, "-X", "faulthandler", "-c", WORKER, self.dir, self.tmp, json.dumps(NEW_ROWS)], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=120)[0] for p in procs]
        for p, log in zip(procs, logs):
            self.assertEqual(p.returncode, 0, log)
        out = []
        for rank in range(2):
            with open(os.path.join(self.tmp, f"rank{rank}.json")) as f:
                out.append(json.load(f))
        return out, logs

    def check(self, out, source, plain_source="memory"):
        for rank, got in enumerate(out):
            self.assertEqual(got["plain"], [7, plain_source, rank, OLD_ROWS[rank][1]])
            first, rows = NEW_ROWS[rank]
            step, src, saved_rank, w, r = got["sharded"]
            self.assertEqual((step, src, saved_rank), (7, source, rank))
            self.assertTrue(torch.equal(torch.tensor(w), GLOBAL[first:first + rows]), f"rank {rank}")
            self.assertEqual(r, [0, 3, 6, 9])

    def test_lost_ranks_steps_come_from_the_replicas_and_are_resharded(self):
        out, _ = self.run_world()
        self.check(out, "memory")

    def test_a_corrupted_replica_makes_the_world_load_from_disk(self):
        # Flip one byte of saved rank 3's shard inside its shared memory.
        first, rows = OLD_ROWS[3]
        needle = raw_bytes(GLOBAL[first:first + rows])
        hits = 0
        for path in glob.glob("/dev/shm" + self.stores[3].name + ".s*"):
            with open(path, "r+b") as f:
                data = f.read()
                at = data.find(needle)
                if at >= 0:
                    f.seek(at + 5)
                    f.write(bytes([data[at + 5] ^ 0x01]))
                    hits += 1
        self.assertEqual(hits, 1)
        out, logs = self.run_world()
        # (A plain load needs only each rank's own saved state, which is intact.)
        self.check(out, "disk", plain_source="memory")
        self.assertTrue(any("data checksum mismatch" in log for log in logs), logs)


if __name__ == "__main__":
    unittest.main()
