"""Corrupt or truncated checkpoints give clear Python exceptions, never a crash."""

import os
import unittest

import torch

import ballast
from ballast import _ballast, _tree
from _util import TestCase


class Corrupt(TestCase):
    def setUp(self):
        super().setUp()
        c = self.checkpointer()
        c.save(3, {"w": torch.arange(4096, dtype=torch.float32)}, persist=True)
        c.wait()
        self.dir = c.dir
        self.path = os.path.join(self.dir, "step-3", "rank-0.ballast")

    def load_fresh(self):
        return self.checkpointer().load()

    def test_error_types(self):
        self.assertTrue(issubclass(ballast.CheckpointCorruptError, RuntimeError))

    def test_flipped_data_byte_names_the_file(self):
        with open(self.path, "r+b") as f:
            f.seek(os.path.getsize(self.path) - 100)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x10]))
        with self.assertRaises(ballast.CheckpointCorruptError) as cm:
            self.load_fresh()
        self.assertIn(self.path, str(cm.exception))
        self.assertIn("checksum", str(cm.exception))

    def test_truncated_file(self):
        for size in (os.path.getsize(self.path) - 1, 200, 50, 0):
            os.truncate(self.path, size)
            with self.assertRaisesRegex(ballast.CheckpointCorruptError, "rank-0.ballast"):
                self.load_fresh()

    def test_garbage_header(self):
        with open(self.path, "r+b") as f:
            f.write(b"NOTBALLAST")
        with self.assertRaisesRegex(ballast.CheckpointCorruptError, "magic"):
            self.load_fresh()

    def test_garbage_latest(self):
        with open(os.path.join(self.dir, "latest"), "w") as f:
            f.write("twelve\n")
        with self.assertRaisesRegex(ballast.CheckpointCorruptError, "latest"):
            self.load_fresh()

    def test_missing_shard(self):
        os.remove(self.path)
        with self.assertRaisesRegex(FileNotFoundError, "rank 0"):
            self.load_fresh()

    def test_read_checkpoint_of_an_empty_dir(self):
        with self.assertRaisesRegex(FileNotFoundError, "ballast ckpt ls"):
            ballast.read_checkpoint(os.path.join(self.tmp, "empty"))

    def test_unreadable_state_tree_in_memory_falls_back_to_disk(self):
        c = self.checkpointer(sub="ckpt")
        c._store.save(4, [(_tree.TREE_KEY, "blob", (), b"{not json", 9)])
        with self.assertWarnsRegex(UserWarning, "state tree"):
            step, _ = c.load()
        self.assertEqual((step, c.last_load_source), (3, "disk"))
        c._store.save(5, [(_tree.TREE_KEY, "blob", (), b'{"tree": {"t": "gone"}}', 23)])
        with self.assertWarnsRegex(UserWarning, "gone"):
            self.assertEqual(c.load()[0], 3)

    def test_unreadable_state_tree_on_disk(self):
        c = self.checkpointer(sub="other")
        c._store.save(1, [(_tree.TREE_KEY, "blob", (), b'{"tree": {"t": "gone"}}', 23)])
        p = _ballast.LocalPersister(c._store, c.dir, 0, 1, 3)
        p.request(1)
        p.wait(1, 30)
        p.close()
        with self.assertRaisesRegex(ballast.CheckpointCorruptError, "gone"):
            self.checkpointer(sub="other").load()

    def test_bad_entries_from_python_raise_value_error(self):
        c = self.checkpointer(sub="other")
        with self.assertRaisesRegex(ValueError, "dtype"):
            c._store.save(1, [("k", "float33", (1,), 0, 4)])
        with self.assertRaisesRegex(ValueError, "duplicate"):
            c._store.save(1, [("k", "blob", (), b"", 0), ("k", "blob", (), b"", 0)])
        with self.assertRaises(ValueError):
            c._store.save(1, [("k", "float32", (3,), b"abcd", 4)])

    def test_raw_image_without_tree_loads_flat(self):
        c = self.checkpointer(sub="other")
        data = torch.arange(3, dtype=torch.int32)
        c._store.save(1, [("x", "int32", (3,), data.data_ptr(), 12), ("b", "blob", (), b"hi", 2)])
        step, state = c.load()
        self.assertEqual(step, 1)
        self.assertTrue(torch.equal(state["x"], data))
        self.assertEqual(state["b"], b"hi")


if __name__ == "__main__":
    unittest.main()
