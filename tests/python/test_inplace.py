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
        ckpt = _step5_on_disk_and_both_memory_steps_corrupt(self.checkpointer())
        target = torch.zeros(1 << 18)
        with self.assertWarnsRegex(UserWarning, "corrupt"):
            step, state = ckpt.load(into={"w": target})
        self.assertEqual(step, 5)
        self.assertEqual(ckpt.last_load_source, "disk")
        self.assertIs(state["w"], target)
        self.assertTrue(bool((target == 7.0).all()))


class ZeroCopyLoad(TestCase):
    """The default load from this rank's memory: tensors that view the slot
    through a private copy-on-write mapping (no allocation, no copy)."""

    def test_views_are_private_and_pin_their_step(self):
        model, opt = model_state()
        ckpt = self.checkpointer()
        want = {k: v.clone() for k, v in model.state_dict().items()}
        ckpt.save(5, {"model": model.state_dict(), "opt": opt.state_dict()})
        step, state = ckpt.load()
        self.assertEqual((step, ckpt.last_load_source), (5, "memory"))
        w = state["model"]["0.weight"]
        self.assertTrue(any(r() is w for r in ckpt._views), "a view of the slot's mapping, not a copy")
        self.assertEqual(sorted(state["model"]), sorted(want))
        for k, v in want.items():
            self.assertBitwise(state["model"][k], v, k)
        # Writing to a loaded tensor (an optimizer updating its state in
        # place) copies the page: the checkpoint keeps the saved values.
        with torch.no_grad():
            w.fill_(7.0)
            state["opt"]["state"][0]["exp_avg"].add_(1.0)
        _, again = ckpt.load()
        for k, v in want.items():
            self.assertBitwise(again["model"][k], v, k)
        self.assertFalse(torch.equal(again["model"]["0.weight"], w))
        del again
        # Later saves never rewrite the pinned slot under the views: they
        # keep the values of step 5 (and the writes made to them).
        for s in range(6, 10):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            ckpt.save(s, {"model": model.state_dict(), "opt": opt.state_dict()})
        self.assertTrue(torch.equal(w, torch.full_like(w, 7.0)))
        for k, v in want.items():
            if k != "0.weight":
                self.assertBitwise(state["model"][k], v, k)
        step, latest = ckpt.load()
        self.assertEqual(step, 9)
        for k, v in model.state_dict().items():
            self.assertBitwise(latest["model"][k], v, k)
        # Consumed the usual way, the optimizer keeps the views as its state
        # and steps on them.
        saved_avg = latest["opt"]["state"][0]["exp_avg"].clone()
        model.load_state_dict(latest["model"])
        opt.load_state_dict(latest["opt"])
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        self.assertFalse(torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved_avg))
        _, after = ckpt.load(step=9)  # the step's memory is as saved
        self.assertTrue(torch.equal(after["opt"]["state"][0]["exp_avg"], saved_avg))

    def test_an_overlapped_save_gives_the_views_their_own_memory(self):
        ckpt = self.checkpointer()
        ckpt.save(1, {"w": torch.full((1 << 16,), 3.0)})
        _, state = ckpt.load()
        w = state["w"]
        ptr = w.data_ptr()
        # An overlapped save keeps the two newest steps: it needs every slot,
        # so the view is copied out and its slot unpinned first.
        for step in (2, 3, 4):
            ckpt.save(step, {"w": torch.full((1 << 16,), float(step))}, blocking=False)
            ckpt.wait_saved()
        self.assertNotEqual(w.data_ptr(), ptr)
        self.assertTrue(bool((w == 3.0).all()))
        self.assertEqual(ckpt._views, [])
        self.assertEqual(ckpt.load()[0], 4)

    def test_corrupt_slot_is_caught_before_views_are_handed_out(self):
        ckpt = _step5_on_disk_and_both_memory_steps_corrupt(self.checkpointer())
        with self.assertWarnsRegex(UserWarning, "corrupt"):
            step, state = ckpt.load()
        self.assertEqual((step, ckpt.last_load_source), (5, "disk"))
        self.assertTrue(bool((state["w"] == 7.0).all()))


def _step5_on_disk_and_both_memory_steps_corrupt(ckpt):
    """Step 5 (a tensor of 7.0) saved and persisted, step 6 (9.0) in memory
    only, then both memory slots corrupted (6, and 5, which an intact memory
    would serve in place of the disk's copy of step 5)."""
    ckpt.save(5, {"w": torch.full((1 << 18,), 7.0)}, persist=True)
    ckpt.wait()
    ckpt.save(6, {"w": torch.full((1 << 18,), 9.0)})
    for want, value in ((6, 9.0), (5, 7.0)):
        snap = ckpt._store.restore(step=want, verify=False)
        assert snap.step == want, (snap.step, want)
        _flip_a_data_byte(snap.source, value)
        del snap
    return ckpt


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
