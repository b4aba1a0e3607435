"""Checkpointer.load(into=...): the checkpoint lands in the caller's existing
tensors (no allocation), from memory and from disk, verified on the way."""
import os
import struct
import unittest

import torch

import ballast
from _util import TestCase


def model_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


class LoadInto(TestCase):
    def test_fills_the_model_and_optimizer_in_place_from_memory_and_disk(self):
        model, opt = model_state()
        ckpt = self.checkpointer()
        saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
        ckpt.save(3, {"model": model.state_dict(), "opt": opt.state_dict(), "epoch": 2}, persist=True)
        ckpt.wait()
        for source in ("memory", "disk"):
            with self.subTest(source):
                with torch.no_grad():
                    for p in model.parameters():
                        p.zero_()
                ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
                c = ckpt if source == "memory" else self.checkpointer()  # a new store: disk
                step, state = c.load(into={"model": model.state_dict(), "opt": opt.state_dict()})
                self.assertEqual(step, 3)
                self.assertEqual(c.last_load_source, source)
                self.assertEqual(state["epoch"], 2)
                for k, v in model.state_dict().items():
                    self.assertBitwise(saved["model"][k], v, k)
                    self.assertEqual(state["model"][k].data_ptr(), ptrs[k], f"{k} was not filled in place")
                # The optimizer's moments too, in its own tensors.
                exp_avg = opt.state[next(iter(model.parameters()))]["exp_avg"]
                self.assertEqual(state["opt"]["state"][0]["exp_avg"].data_ptr(), exp_avg.data_ptr())

    def test_mismatched_target_is_a_clear_error_naming_the_key(self):
        ckpt = self.checkpointer()
        ckpt.save(1, {"w": torch.ones(4, 4)})
        with self.assertRaisesRegex(ValueError, r"'w' is torch.float32 \(2, 2\) here but was saved as "
                                                r"torch.float32 \(4, 4\)"):
            ckpt.load(into={"w": torch.zeros(2, 2)})
        with self.assertRaisesRegex(ValueError, r"'w' is torch.float64"):
            ckpt.load(into={"w": torch.zeros(4, 4, dtype=torch.float64)})

    def test_non_contiguous_target_and_keys_it_lacks_still_load(self):
        ckpt = self.checkpointer()
        w = torch.arange(16, dtype=torch.float32).reshape(4, 4)
        ckpt.save(1, {"w": w, "b": torch.ones(3)})
        target = torch.zeros(4, 4).t()  # a transposed view: not contiguous
        step, state = ckpt.load(into={"w": target})
        self.assertIs(state["w"], target)
        self.assertTrue(torch.equal(target, w))
        self.assertTrue(torch.equal(state["b"], torch.ones(3)))  # not in `into`: a fresh tensor

    def test_corrupt_memory_falls_back_to_disk_still_in_place(self):
        ckpt = self.checkpointer()
        ckpt.save(5, {"w": torch.full((1 << 18,), 7.0)}, persist=True)
        ckpt.wait()
        ckpt.save(6, {"w": torch.full((1 << 18,), 9.0)})  # newer, memory only
        # Both memory slots corrupt (6, and 5, which an intact memory would
        # serve in place of the disk's copy of step 5).
        for want, value in ((6, 9.0), (5, 7.0)):
            snap = ckpt._store.restore(step=want, verify=False)
            self.assertEqual(snap.step, want)
            _flip_a_data_byte(snap.source, value)
            del snap
        target = torch.zeros(1 << 18)
        with self.assertWarnsRegex(UserWarning, "corrupt"):
            step, state = ckpt.load(into={"w": target})
        self.assertEqual(step, 5)
        self.assertEqual(ckpt.last_load_source, "disk")
        self.assertIs(state["w"], target)
        self.assertTrue(bool((target == 7.0).all()))


def _flip_a_data_byte(source, value):
    """Flips one byte of the tensor full of `value` in the shared-memory slot `source` ("shm:/name.sN"): bit rot."""
    path = "/dev/shm" + source[len("shm:"):]
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        data = f.read()
        # The entry's bytes hold the float32 value: flip one of them somewhere in the middle.
        pos = data.find(struct.pack("<f", value) * 64, size // 4)
        assert pos > 0, "entry bytes not found"
        f.seek(pos + 1)
        f.write(b"\xff")


if __name__ == "__main__":
    unittest.main()
