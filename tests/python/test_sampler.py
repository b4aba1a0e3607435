"""ballast.ElasticSampler without processes: DistributedSampler's order when
nothing was resumed, exact coverage of an epoch across resumes at every
position and world-size changes, the tail (padding / drop_last), state round
trips (also through a Checkpointer), set_epoch, and a prefetching DataLoader."""

import collections
import os
import unittest
from unittest import mock

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ballast
from _util import TestCase


class Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def world(n, w, **kw):
    return [ballast.ElasticSampler(Sized(n), num_replicas=w, rank=r, **kw) for r in range(w)]


def run_steps(samplers, batch, steps=None):
    """Lock-step training of `steps` steps (None: to the end of the epoch) on a
    world of samplers; returns [(rank, index)] trained, and advances them."""
    streams = [list(iter(s)) for s in samplers]
    lens = {len(x) for x in streams}
    assert len(lens) == 1, f"ranks got different counts {lens}"
    per_rank = lens.pop()
    assert per_rank == len(samplers[0])
    trained = []
    done, step = 0, 0
    while done < per_rank and (steps is None or step < steps):
        n = min(batch, per_rank - done)
        for r, s in enumerate(samplers):
            trained += [(r, i) for i in streams[r][done:done + n]]
            s.advance(n)
        done += n
        step += 1
    positions = {s.position for s in samplers}
    assert len(positions) == 1, positions
    return trained


class MatchesDistributedSampler(TestCase):
    def test_same_order_per_rank_when_nothing_was_resumed(self):
        for n in (1, 7, 10, 23, 240, 241):
            for w in (1, 2, 3, 4):
                for shuffle in (True, False):
                    for drop_last in (False, True):
                        if drop_last and n < w:
                            continue  # DistributedSampler yields nothing; so do we (below)
                        for epoch in (0, 1, 5):
                            for r in range(w):
                                kw = dict(num_replicas=w, rank=r, shuffle=shuffle, seed=3,
                                          drop_last=drop_last)
                                ds = DistributedSampler(Sized(n), **kw)
                                es = ballast.ElasticSampler(Sized(n), **kw)
                                ds.set_epoch(epoch)
                                es.set_epoch(epoch)
                                what = (n, w, r, shuffle, drop_last, epoch)
                                self.assertEqual(list(es), list(ds), what)
                                self.assertEqual(len(es), len(ds), what)

    def test_fewer_samples_than_ranks_with_drop_last_yields_nothing(self):
        for s in world(2, 3, drop_last=True):
            self.assertEqual((list(s), len(s), s.epoch_done), ([], 0, True))

    def test_defaults_come_from_the_environment(self):
        with mock.patch.dict(os.environ, {"WORLD_SIZE": "3", "RANK": "2"}):
            s = ballast.ElasticSampler(Sized(9))
        self.assertEqual((s.num_replicas, s.rank), (3, 2))
        with mock.patch.dict(os.environ, {}, clear=True):
            s = ballast.ElasticSampler(Sized(9))
        self.assertEqual((s.num_replicas, s.rank), (1, 0))
        with self.assertRaises(ValueError):
            ballast.ElasticSampler(Sized(9), num_replicas=2, rank=2)
        with self.assertRaises(ValueError):
            ballast.ElasticSampler(Sized(9), num_replicas=0, rank=0)


class ResumeCoverage(TestCase):
    """Train part of an epoch on W1 ranks, save, resume the rest on W2 ranks."""

    def check_epoch(self, n, seen, order, last_start, last_world, drop_last):
        """`seen`: every index trained in the epoch. Exactly once each, except
        the tail of the segment that finished the epoch (resumed at last_start
        on last_world ranks): padded with the first (-R) % W samples of the
        epoch, or the last R % W samples of the permutation dropped."""
        counts = collections.Counter(seen)
        rest = n - last_start
        if drop_last:
            dropped = set(order[n - rest % last_world:]) if rest % last_world else set()
            self.assertEqual(set(counts), set(range(n)) - dropped)
            self.assertEqual(max(counts.values(), default=1), 1)
        else:
            pad = (-rest) % last_world
            padded = collections.Counter((order * last_world)[:pad])
            want = collections.Counter(range(n)) + padded
            self.assertEqual(counts, want)
            self.assertLessEqual(pad, last_world - 1)

    def test_a_resumed_epoch_trains_exactly_what_an_uninterrupted_one_does(self):
        # 512 samples on 3 ranks pad one slot at the epoch's end: with the
        # epoch's first sample, whether or not the epoch was resumed (a job
        # resumed in the same world ends with the same weights).
        for n, w, batch in ((512, 3, 4), (25, 2, 3), (23, 4, 2)):
            clean = run_steps(world(n, w, seed=7), batch)
            for k in (1, 5):
                a = world(n, w, seed=7)
                first = run_steps(a, batch, k)
                b = world(n, w, seed=7)
                for s in b:
                    s.load_state_dict(a[0].state_dict())
                    s.set_epoch(0)
                self.assertEqual(first + run_steps(b, batch), clean, (n, w, batch, k))

    def test_every_resume_position_covers_the_epoch_exactly_once(self):
        cases = [(2, 2), (2, 1), (1, 2), (3, 2), (2, 3), (4, 3)]
        for n in (24, 25, 23, 240):
            for w1, w2 in cases:
                for batch in (1, 4):
                    for drop_last in (False, True):
                        full_steps = len(world(n, w1, drop_last=drop_last)[0])
                        full_steps = -(-full_steps // batch)
                        for k in range(full_steps + 1):  # resume after k steps: every position
                            what = (n, w1, w2, batch, drop_last, k)
                            a = world(n, w1, seed=7, drop_last=drop_last)
                            for s in a:
                                s.set_epoch(2)
                            first = run_steps(a, batch, k)
                            saved = a[0].state_dict()
                            for s in a[1:]:
                                self.assertEqual(s.state_dict(), saved, "state is global")
                            b = world(n, w2, seed=0, drop_last=drop_last)  # seed comes from the state
                            for s in b:
                                s.load_state_dict(saved)
                                s.set_epoch(2)  # the resumed loop does this: keeps the position
                            self.assertEqual(b[0].position, saved["position"], what)
                            start = saved["position"]
                            left = len(b[0])
                            second = run_steps(b, batch)
                            self.assertTrue(all(s.epoch_done for s in b), what)
                            if left:  # (drop_last with fewer samples left than ranks: none to train)
                                self.assertEqual(b[0].position, n, what)
                            seen = [i for _, i in first + second]
                            order = a[0].permutation()
                            if start == n:  # the first world finished the epoch
                                self.check_epoch(n, seen, order, 0, w1, drop_last)
                            else:
                                with self.subTest(what=what):
                                    self.check_epoch(n, seen, order, start, w2, drop_last)

    def test_chain_of_world_sizes(self):
        """3 -> 2 -> 1 -> 4 -> 2 within one epoch of 241 samples: each once but the tail."""
        n, batch = 241, 3
        s = world(n, 3, seed=11)
        seen = run_steps(s, batch, 5)
        state = s[0].state_dict()
        for w, steps in ((2, 7), (1, 9), (4, 4), (2, None)):
            s = world(n, w)
            for x in s:
                x.load_state_dict(state)
            start = state["position"]
            seen += run_steps(s, batch, steps)
            state = s[0].state_dict()
        self.assertEqual(state["position"], n)
        self.check_epoch(n, [i for _, i in seen], s[0].permutation(), start, 2, False)

    def test_a_world_that_finished_the_epoch_does_not_revisit_its_tail(self):
        # 25 samples on 2 ranks: 13 each, one padded; on 3 ranks with drop_last: 8 each, 1 dropped.
        for drop_last in (False, True):
            a = world(25, 2 if not drop_last else 3, drop_last=drop_last)
            run_steps(a, 4)
            state = a[0].state_dict()
            self.assertEqual(state["position"], 25)
            b = world(25, 1, drop_last=drop_last)
            b[0].load_state_dict(state)
            self.assertEqual((len(b[0]), list(b[0])), (0, []))


class State(TestCase):
    def test_state_dict_is_plain_and_round_trips(self):
        a = ballast.ElasticSampler(Sized(100), num_replicas=2, rank=1, seed=5, shuffle=True)
        a.set_epoch(3)
        a.advance(4)
        a.advance(4)
        st = a.state_dict()
        self.assertEqual(st, {"version": 1, "epoch": 3, "position": 16, "seed": 5, "shuffle": True,
                              "dataset_size": 100})
        self.assertTrue(all(type(v) in (int, bool) for v in st.values()))
        b = ballast.ElasticSampler(Sized(100), num_replicas=2, rank=1, seed=0, shuffle=False)
        b.load_state_dict(st)
        self.assertEqual(b.state_dict(), st)
        self.assertEqual(list(b), list(a))
        self.assertEqual(list(b), a.permutation()[16:][1::2])

    def test_through_a_checkpointer(self):
        ckpt = self.checkpointer()
        a = ballast.ElasticSampler(Sized(50), num_replicas=1, rank=0, seed=9)
        a.set_epoch(1)
        a.advance(10)
        ckpt.save(1, {"model": {"w": torch.ones(2)}, "sampler": a.state_dict()}, persist=True)
        ckpt.wait()
        _, state = ckpt.load()
        self.assertEqual(state["sampler"], a.state_dict())
        _, disk = ballast.read_checkpoint(ckpt.dir, 1)
        self.assertEqual(disk["sampler"], a.state_dict())
        b = ballast.ElasticSampler(Sized(50), num_replicas=2, rank=0)
        b.load_state_dict(disk["sampler"])
        self.assertEqual(list(b), a.permutation()[10::2])

    def test_bad_states_are_refused(self):
        s = ballast.ElasticSampler(Sized(10), num_replicas=1, rank=0)
        good = s.state_dict()
        for bad in ({}, None, dict(good, dataset_size=11), dict(good, position=11),
                    dict(good, position=-1), dict(good, version=99)):
            with self.assertRaises(ValueError, msg=repr(bad)):
                s.load_state_dict(bad)
        self.assertEqual(s.state_dict(), good)
        with self.assertRaises(ValueError):
            s.advance(-1)

    def test_set_epoch_reshuffles_and_resets_only_a_new_epoch(self):
        s = ballast.ElasticSampler(Sized(64), num_replicas=2, rank=0, seed=1)
        e0 = list(s)
        s.advance(8)
        s.set_epoch(0)  # the current epoch: keeps the position
        self.assertEqual(s.position, 16)
        self.assertEqual(list(s), e0[8:])
        s.set_epoch(1)
        self.assertEqual(s.position, 0)
        e1 = list(s)
        self.assertNotEqual(e1, e0)
        other = ballast.ElasticSampler(Sized(64), num_replicas=2, rank=1, seed=1)
        other.set_epoch(1)
        self.assertEqual(sorted(e1 + list(other)), list(range(64)))
        s.set_epoch(0)
        self.assertEqual(list(s), e0)  # same seed + epoch -> same permutation
        unshuffled = ballast.ElasticSampler(Sized(8), num_replicas=2, rank=1, shuffle=False)
        unshuffled.set_epoch(4)
        self.assertEqual(list(unshuffled), [1, 3, 5, 7])

    def test_end_of_epoch_state_resumes_as_an_empty_epoch(self):
        s = ballast.ElasticSampler(Sized(10), num_replicas=2, rank=0)
        s.advance(100)  # anything from the share on completes the epoch
        self.assertEqual((s.position, len(s), list(s), s.epoch_done), (10, 0, [], True))
        s.set_epoch(1)
        self.assertEqual((s.position, len(s)), (0, 5))


class PrefetchingLoader(TestCase):
    def test_advance_is_exact_while_the_loader_prefetches(self):
        n, batch = 60, 4
        ds = TensorDataset(torch.arange(n))
        s = ballast.ElasticSampler(ds, num_replicas=2, rank=0, seed=2)
        loader = DataLoader(ds, batch_size=batch, sampler=s, num_workers=2, prefetch_factor=4)
        it = iter(loader)
        trained = []
        for _ in range(3):
            (x,) = next(it)
            trained += x.tolist()
            s.advance(len(x))
        state = s.state_dict()  # the workers have drawn far more indices by now
        del it
        self.assertEqual(state["position"], 3 * batch * 2)
        r = ballast.ElasticSampler(ds, num_replicas=2, rank=0)
        r.load_state_dict(state)
        rest = [i for (x,) in DataLoader(ds, batch_size=batch, sampler=r) for i in x.tolist()]
        self.assertEqual(trained + rest, s.permutation()[0::2])
        self.assertEqual(len(DataLoader(ds, batch_size=batch, sampler=r)), -(-((n - 24) // 2) // batch))


class SkipAfterRollback(TestCase):
    """BALLAST_SKIP_DATA (set by the agent after a rollback): the bad steps'
    sample positions are never handed out again, on any world size."""

    def test_skipped_positions_are_left_out_and_the_rest_covered_once(self):
        n, batch = 96, 2
        with mock.patch.dict(os.environ, {"BALLAST_SKIP_DATA": "0:16:24,1:0:8,0:40:44"}):
            for w in (1, 2, 4):
                samplers = world(n, w, seed=3)
                order = samplers[0].permutation(0)
                trained = run_steps(samplers, batch)
                want = sorted(order[i] for i in range(n) if not (16 <= i < 24 or 40 <= i < 44))
                self.assertEqual(sorted(i for _, i in trained), want, f"world {w}")
                self.assertTrue(samplers[0].epoch_done)
                for s in samplers:
                    s.set_epoch(1)
                trained = run_steps(samplers, batch)
                order = samplers[0].permutation(1)
                self.assertEqual(sorted(i for _, i in trained), sorted(order[8:]), f"world {w}, epoch 1")

    def test_a_resume_right_before_the_bad_batch_jumps_over_it(self):
        with mock.patch.dict(os.environ, {"BALLAST_SKIP_DATA": "0:8:12"}):
            samplers = world(32, 2, seed=5)
        for s in samplers:
            s.load_state_dict({"epoch": 0, "position": 8, "seed": 5, "shuffle": True, "dataset_size": 32})
        order = samplers[0].permutation()
        self.assertEqual(list(samplers[0])[:2], [order[12], order[14]])
        for s in samplers:
            s.advance(2)
        self.assertEqual(samplers[0].position, 16)

    def test_the_bad_batch_is_what_the_step_being_reported_trained(self):
        s = ballast.ElasticSampler(Sized(64), num_replicas=2, rank=0)
        for _ in range(3):
            s.advance(4)
            ballast.step(1)
        s.advance(4)  # step 4 trained positions 24..32, then reports
        self.assertEqual(s._bad_range(), (0, 24, 32))
        ballast.step(4)
        # Reported before its advance(): the batch about to be recorded.
        self.assertEqual(s._bad_range(), (0, 32, 40))

    def test_a_malformed_variable_is_refused(self):
        with mock.patch.dict(os.environ, {"BALLAST_SKIP_DATA": "0:9:3"}):
            with self.assertRaisesRegex(ValueError, "BALLAST_SKIP_DATA"):
                ballast.ElasticSampler(Sized(10), num_replicas=1, rank=0)


if __name__ == "__main__":
    unittest.main()
