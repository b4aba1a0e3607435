"""Reshard on load: a checkpoint saved by 4 ranks loads on 2 and 3 ranks."""

import os
import unittest

import torch

import ballast
from _util import TestCase, random_tensor


def split(n, parts):
    """Uneven contiguous split of range(n) into parts: [(start, size)]."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append((start, size))
        start += size
    return out


# Global tensors and how 4 ranks shard them.
GLOBALS = {
    "rows": random_tensor((10, 7), torch.float32, seed=1),      # dim 0: 3,3,2,2
    "cols": random_tensor((5, 6), torch.bfloat16, seed=2),      # dim 1: 2,2,1,1
    "grid": random_tensor((5, 3, 4), torch.int64, seed=3),      # 2x2 grid over dims 0, 2
    "flat": random_tensor((13,), torch.complex64, seed=4),      # dim 0: 4,3,3,3
    "mask": random_tensor((9, 2), torch.bool, seed=5),
}


def save_shard(name, g, rank, world=4):
    """ballast.Shard of rank's piece of global tensor g."""
    if name == "grid":
        a, b = divmod(rank, 2)
        (o0, n0), (o2, n2) = split(g.shape[0], 2)[a], split(g.shape[2], 2)[b]
        return ballast.Shard(g[o0:o0 + n0, :, o2:o2 + n2].clone(), g.shape, (o0, 0, o2))
    dim = 1 if name == "cols" else 0
    off, size = split(g.shape[dim], world)[rank]
    offsets = [0] * g.dim()
    offsets[dim] = off
    return ballast.Shard(g.narrow(dim, off, size).clone(), g.shape, offsets)


class Reshard(TestCase):
    def setUp(self):
        super().setUp()
        self.dir = os.path.join(self.tmp, "ckpt")
        for rank in range(4):
            c = ballast.Checkpointer(self.dir, rank=rank, world_size=4)
            state = {"model": {k: save_shard(k, g, rank) for k, g in GLOBALS.items()},
                     "replicated": torch.arange(3) * 7, "epoch": 2}
            c.save(11, state, persist=True)
            c.wait()
            c.close()
        self.assertEqual(ballast.Checkpointer(self.dir).latest_step(), 11)

    def reassemble(self, world, dim_of):
        """Each of `world` ranks asks for its slice along dim_of[key]; returns the
        tensors concatenated back."""
        pieces = {k: [] for k in GLOBALS}
        for rank in range(world):
            shards = {}
            for k, g in GLOBALS.items():
                dim = dim_of[k]
                off, size = split(g.shape[dim], world)[rank]
                offsets = [0] * g.dim()
                offsets[dim] = off
                shape = list(g.shape)
                shape[dim] = size
                shards[f"model/{k}"] = (tuple(g.shape), offsets, shape)
            c = self.checkpointer(sub="ckpt", rank=rank, world_size=world)
            step, state = c.load(shards=shards)
            self.assertEqual((step, c.last_load_source), (11, "disk"))
            self.assertEqual(state["epoch"], 2)
            self.assertTrue(torch.equal(state["replicated"], torch.arange(3) * 7))
            for k in GLOBALS:
                t = state["model"][k]
                self.assertIsInstance(t, torch.Tensor)
                self.assertEqual(tuple(t.shape), tuple(shards[f"model/{k}"][2]))
                pieces[k].append(t)
        for k, g in GLOBALS.items():
            whole = torch.cat(pieces[k], dim=dim_of[k])
            self.assertEqual(whole.dtype, g.dtype)
            self.assertTrue(torch.equal(whole, g), k)

    def test_four_to_two_along_the_saved_dims(self):
        self.reassemble(2, {"rows": 0, "cols": 1, "grid": 0, "flat": 0, "mask": 0})

    def test_four_to_three_along_other_dims(self):
        self.reassemble(3, {"rows": 1, "cols": 0, "grid": 2, "flat": 0, "mask": 1})

    def test_four_to_one_full_tensors(self):
        self.reassemble(1, {"rows": 0, "cols": 0, "grid": 1, "flat": 0, "mask": 0})

    def test_without_shards_a_rank_gets_its_own_shard_objects(self):
        c = self.checkpointer(sub="ckpt", rank=2, world_size=4)
        step, state = c.load()
        s = state["model"]["rows"]
        self.assertIsInstance(s, ballast.Shard)
        self.assertEqual((s.global_shape, s.offsets), ((10, 7), (6, 0)))
        self.assertTrue(torch.equal(s.tensor, GLOBALS["rows"][6:8]))

    def test_growing_beyond_the_saved_world_needs_shards(self):
        c = self.checkpointer(sub="ckpt", rank=5, world_size=6)
        with self.assertRaisesRegex(FileNotFoundError, "shards="):
            c.load()

    def test_memory_serves_a_matching_shard_request(self):
        c = self.checkpointer(sub="ckpt", rank=1, world_size=4)
        c.save(12, {"model": {"rows": save_shard("rows", GLOBALS["rows"], 1)}})
        step, state = c.load(shards={"model/rows": ((10, 7), (3, 0), (3, 7))})
        self.assertEqual((step, c.last_load_source), (12, "memory"))
        self.assertTrue(torch.equal(state["model"]["rows"], GLOBALS["rows"][3:6]))
        # A different slice than this rank holds must come from disk (all ranks).
        step, state = c.load(shards={"model/rows": ((10, 7), (0, 0), (10, 7))})
        self.assertEqual((step, c.last_load_source), (11, "disk"))
        self.assertTrue(torch.equal(state["model"]["rows"], GLOBALS["rows"]))

    def test_bad_requests_raise_value_error(self):
        c = self.checkpointer(sub="ckpt", rank=0, world_size=2)
        with self.assertRaisesRegex(ValueError, "not a tensor"):
            c.load(shards={"model/nope": ((1,), (0,), (1,))})
        with self.assertRaisesRegex(ValueError, "global shape"):
            c.load(shards={"model/rows": ((10, 8), (0, 0), (1, 1))})
        with self.assertRaisesRegex(ValueError, "outside"):
            c.load(shards={"model/rows": ((10, 7), (9, 0), (2, 7))})

    def test_missing_rank_file_leaves_a_hole(self):
        os.remove(os.path.join(self.dir, "step-11", "rank-3.ballast"))
        c = self.checkpointer(sub="ckpt", rank=0, world_size=1)
        with self.assertRaisesRegex(ValueError, "uncovered"):
            c.load(shards={"model/rows": ((10, 7), (0, 0), (10, 7))})

    def test_coverage_counts_disjoint_and_overlapping_pieces(self):
        from ballast.checkpoint import _uncovered
        self.assertEqual(_uncovered((0, 0), (4, 4), [((0, 0), (2, 4)), ((2, 0), (4, 4))]), 0)
        self.assertEqual(_uncovered((0, 0), (4, 4), [((0, 0), (2, 4))]), 8)
        # Overlapping pieces (replicated rows) are not counted twice.
        self.assertEqual(_uncovered((0, 0), (4, 4), [((0, 0), (3, 4)), ((1, 0), (3, 4))]), 4)
        self.assertEqual(_uncovered((2, 0), (2, 4), [((2, 0), (3, 4)), ((3, 0), (4, 4))]), 0)
        self.assertEqual(_uncovered((), (), [((), ())]), 0)
        self.assertEqual(_uncovered((), (), []), 1)

    def test_read_checkpoint_full_assembles_everything(self):
        step, state = ballast.read_checkpoint(self.dir, full=True)
        self.assertEqual(step, 11)
        for k, g in GLOBALS.items():
            self.assertTrue(torch.equal(state["model"][k], g), k)


if __name__ == "__main__":
    unittest.main()
