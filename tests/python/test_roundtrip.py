"""Round trips through shared memory and disk: every dtype, odd shapes,
non-contiguous views, nested plain values, optimizer state, empty state."""

import collections
import math
import os
import unittest

import torch

import ballast
from _util import DTYPES, TestCase, random_tensor

SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (3, 5, 2), (2, 1, 3, 1)]


class RoundTrip(TestCase):
    def roundtrip(self, state, source="memory"):
        """Saves state, loads it from memory and (after persisting) from disk."""
        c = self.checkpointer()
        c.save(5, state, persist=True)
        step, got = c.load()
        self.assertEqual(step, 5)
        self.assertEqual(c.last_load_source, "memory")
        self.assertStateEqual(state, got)
        c.wait()
        fresh = self.checkpointer()  # own empty store: must read the disk
        step, from_disk = fresh.load()
        self.assertEqual((step, fresh.last_load_source), (5, "disk"))
        self.assertStateEqual(state, from_disk)
        return got

    def test_every_dtype_and_shape_is_bitwise_identical(self):
        state = {}
        for i, dtype in enumerate(DTYPES):
            for j, shape in enumerate(SHAPES):
                state[f"{dtype}/{shape}"] = random_tensor(shape, dtype, seed=i * 100 + j)
        self.roundtrip(state)

    def test_nan_payloads_and_signed_zero_survive(self):
        t = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45])
        bits = torch.tensor([0x7FC00001, 0xFFC12345, 0x80000000], dtype=torch.int64).to(torch.int32)
        self.roundtrip({"a": t, "b": bits.view(torch.float32),
                        "c": torch.tensor([0x7E01, 0xFE02], dtype=torch.int64).to(torch.int16).view(torch.bfloat16)})

    def test_non_contiguous_views(self):
        base = torch.arange(60, dtype=torch.float64).reshape(3, 4, 5)
        state = {
            "transposed": base.transpose(0, 2),
            "stepped": base[:, ::2, 1::3],
            "expanded": torch.arange(3.0).reshape(3, 1).expand(3, 4),
            "offset": base.view(-1)[7:19],
            "conj": torch.randn(4, dtype=torch.complex64).conj(),
            "bool_t": (base > 20).permute(2, 0, 1),
        }
        got = self.roundtrip(state)
        for k, v in state.items():
            self.assertTrue(got[k].is_contiguous(), k)
            self.assertTrue(torch.equal(got[k], v.resolve_conj()), k)

    def test_nested_containers_and_plain_values(self):
        state = {
            "none": None, "t": True, "f": False, "int": -(2 ** 70), "float": 0.1, "neg0": -0.0,
            "inf": float("inf"), "nan": float("nan"), "str": "héllo\u2603", "bytes": b"\x00\xffab",
            "big_bytes": bytes(range(256)) * 40,
            "tuple": (1, [2, (3,)], ()), "list": [[], {}, (None,)],
            3: "int key", -1: {0: torch.ones(2), 1: [torch.zeros(1)]},
            (1, "a"): "tuple key", 2.5: "float key", None: "none key", True: "bool key",
            "size": torch.Size([2, 3]), "dtype": torch.bfloat16, "device": torch.device("cpu"),
            "od": collections.OrderedDict([("b", 1), ("a", 2)]),
            "same/key": torch.ones(1), "same": {"key": torch.zeros(1)},  # colliding paths
        }
        got = self.roundtrip(state)
        self.assertTrue(math.isnan(got["nan"]))
        self.assertEqual(math.copysign(1, got["neg0"]), -1)

    def test_model_state_dict_keeps_order_and_metadata(self):
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        sd = model.state_dict()
        got = self.roundtrip({"model": sd})
        self.assertIsInstance(got["model"], collections.OrderedDict)
        self.assertEqual(got["model"]._metadata, sd._metadata)
        fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        fresh.load_state_dict(got["model"])

    def test_adam_state_dict_round_trips_and_training_continues_identically(self):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
        x = torch.randn(8, 4)
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": 3}
        got = self.roundtrip(state)
        self.assertEqual(set(got["opt"]["state"]), {0, 1})  # int keys stay int
        self.assertIsInstance(got["opt"]["param_groups"][0]["betas"], tuple)
        model2 = torch.nn.Linear(4, 3)
        opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
        model2.load_state_dict(got["model"])
        opt2.load_state_dict(got["opt"])
        for m, o in ((model, opt), (model2, opt2)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
        for p, q in zip(model.parameters(), model2.parameters()):
            self.assertTrue(torch.equal(p, q))

    def test_a_load_from_disk_sizes_the_memory_for_the_next_save(self):
        import time
        state = {"w": torch.randn(4 << 20), "step": 3}  # 16 MiB
        first = ballast.Checkpointer(os.path.join(self.tmp, "disk"), rank=0, world_size=1)
        first.save(3, state, persist=True)
        first.wait()
        first.close()
        # A new process on another machine: a fresh store, the step on disk.
        c = ballast.Checkpointer(os.path.join(self.tmp, "disk"), rank=0, world_size=1)
        self.addCleanup(c.close)
        self.assertEqual(max(c._store.capacities()), 0)
        step, got = c.load()
        self.assertEqual((step, c.last_load_source), (3, "disk"))
        self.assertStateEqual(state, got)
        deadline = time.monotonic() + 30
        while c._store.growing() and time.monotonic() < deadline:
            time.sleep(0.01)
        # One slot sized for the shard before any save, so the first save only copies.
        self.assertGreaterEqual(max(c._store.capacities()), os.path.getsize(os.path.join(self.tmp, "disk",
                                                                                          "step-3", "rank-0.ballast")))
        c.save(4, state)
        self.assertEqual(c.load()[0], 4)

    def test_a_fresh_start_with_into_sizes_the_memory_for_the_first_save(self):
        import time
        state = {"model": {"w": torch.randn(4 << 20)}, "step": 0}  # 16 MiB
        # Nothing to load and no `into`: nothing to size by.
        bare = self.checkpointer()
        self.assertEqual(bare.load(), (None, None))
        self.assertEqual(max(bare._store.capacities()), 0)
        c = self.checkpointer()
        self.assertEqual(c.load(into=state), (None, None))
        deadline = time.monotonic() + 30
        while c._store.growing() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertFalse(c._store.growing())
        # One slot sized for a save of that state before any save: the first save only copies.
        sized = max(c._store.capacities())
        self.assertGreaterEqual(sized, 16 << 20)
        c.save(1, state)
        self.assertLessEqual(c._largest_image, sized)  # it fit in the slot sized before it
        step, got = c.load()
        self.assertEqual(step, 1)
        self.assertStateEqual(state, got)

    def test_reserve_sizes_the_memory_the_first_save_needs_without_reading_data(self):
        import time
        torch.manual_seed(0)
        model = torch.nn.Linear(512, 1024)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 512)).sum().backward()
        opt.step()
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": 1}
        c = self.checkpointer()
        planned = c.reserve(state)
        deadline = time.monotonic() + 30
        while c._store.growing() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertFalse(c._store.growing())
        c.save(123456789, state)  # a longer step number than the reserve's
        self.assertLessEqual(c._largest_image, planned + (64 << 10))
        self.assertGreaterEqual(c._largest_image, planned - 256)
        step, got = c.load()
        self.assertEqual(step, 123456789)
        self.assertStateEqual(state, got)
        # Shapes and dtypes only: tensors without data will do.
        meta = {"w": torch.empty(1 << 20, device="meta"), "b": torch.empty(3, dtype=torch.float16, device="meta")}
        self.assertGreaterEqual(self.checkpointer().reserve(meta), 4 << 20)
        with self.assertRaisesRegex(TypeError, "cannot checkpoint"):
            c.reserve({"x": object()})
        with self.assertRaisesRegex(TypeError, "only dense tensors"):  # as save refuses it
            c.reserve({"s": torch.eye(2).to_sparse()})

    def test_parameters_keep_requires_grad(self):
        p = torch.nn.Parameter(torch.randn(3))
        got = self.roundtrip({"p": p, "plain": torch.ones(2)})
        self.assertTrue(got["p"].requires_grad)
        self.assertFalse(got["plain"].requires_grad)

    def test_empty_states(self):
        self.roundtrip({})
        self.roundtrip([])
        self.roundtrip(None)

    def test_loaded_tensors_do_not_alias_the_checkpoint(self):
        c = self.checkpointer()
        c.save(1, {"w": torch.zeros(1000)})
        _, a = c.load()
        a["w"].add_(1)
        _, b = c.load()
        self.assertEqual(float(b["w"].sum()), 0.0)

    def test_newest_memory_step_wins_and_step_selects(self):
        c = self.checkpointer()
        c.save(1, {"v": torch.tensor(1)})
        c.save(2, {"v": torch.tensor(2)})
        self.assertEqual(c.memory_step(), 2)
        step, s = c.load()
        self.assertEqual((step, int(s["v"])), (2, 2))
        step, s = c.load(step=1)
        self.assertEqual((step, int(s["v"]), c.last_load_source), (1, 1, "memory"))

    def test_nothing_saved_loads_none(self):
        c = self.checkpointer()
        self.assertEqual(c.load(), (None, None))
        self.assertIsNone(c.last_load_source)
        self.assertIsNone(c.latest_step())
        self.assertIsNone(c.memory_step())

    def test_unsupported_values_raise_type_error_naming_the_path(self):
        c = self.checkpointer()
        with self.assertRaisesRegex(TypeError, "opt/fn"):
            c.save(1, {"opt": {"fn": lambda: 0}})
        with self.assertRaisesRegex(TypeError, "sparse"):
            c.save(1, {"s": torch.eye(2).to_sparse()})
        self.assertIsNone(c.memory_step())

    def test_device_argument_moves_tensors(self):
        c = self.checkpointer()
        c.save(1, {"w": torch.ones(2)})
        _, s = c.load(device="cpu")
        self.assertEqual(s["w"].device.type, "cpu")

    @unittest.skipUnless(torch.cuda.is_available(), "no CUDA")
    def test_cuda_tensors_come_through_the_host(self):
        t = torch.randn(5, 3, device="cuda")
        c = self.checkpointer()
        c.save(1, {"w": t.t()})
        _, s = c.load(device="cuda")
        self.assertTrue(torch.equal(s["w"], t.t()))


if __name__ == "__main__":
    unittest.main()
