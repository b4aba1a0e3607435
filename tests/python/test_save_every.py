"""save_every: which Checkpointer.save calls copy (python/ballast/save_policy.py).

Unit tests of the interval (a fake clock) and of the Checkpointer's use of it,
then a 2 nodes x 2 workers DDP job under `ballast launch --save-every auto`
with flash checkpoints, peer replicas and an ElasticSampler, a worker killed:
it resumes from the newest copied step, loses at most the interval, and ends
bitwise equal to the job without the fault.
"""

import math
import os
import re
import subprocess
import threading
import unittest
import unittest.mock

import torch

import ballast
from ballast import _ballast, save_policy
from _health_job import BIN, HealthJob
from _util import TestCase


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def run_steps(policy, clock, steps, step_s, save_s, first=1):
    """Drives `policy` as a training loop whose copied saves take save_s; the copied steps."""
    copied = []
    for s in range(first, first + steps):
        clock.t += step_s
        if policy.due(s):
            clock.t += save_s
            policy.copied(s, save_s)
            copied.append(s)
    return copied


class ParseTest(unittest.TestCase):
    def test_counts_auto_and_a_bound(self):
        self.assertEqual(save_policy.parse(1), (1, None))
        self.assertEqual(save_policy.parse("25"), (25, None))
        self.assertEqual(save_policy.parse("auto"), (None, save_policy.DEFAULT_AUTO_MAX))
        self.assertEqual(save_policy.parse("auto:40"), (None, 40))
        for bad in (0, -2, "0", "auto:", "auto:0", "sometimes", True, "2.5"):
            with self.assertRaisesRegex(ValueError, "save_every"):
                save_policy.parse(bad)


class IntervalTest(unittest.TestCase):
    def policy(self, spec, **kw):
        clock = Clock()
        kw.setdefault("restarts", 0)
        kw.setdefault("job_age_s", 0)
        kw.setdefault("check_every", 0)
        return save_policy.SaveInterval(spec, clock=clock, log=lambda m: None, **kw), clock

    def test_fixed_every_n_copies_the_first_call_then_every_nth(self):
        p, clock = self.policy(5)
        self.assertEqual(run_steps(p, clock, 12, 0.1, 0.01), [1, 6, 11])

    def test_auto_follows_young_daly(self):
        # A save costs 0.1 s, a step 0.2 s, the MTBF prior 800 s (and the
        # ~60 s the job runs): T = sqrt(2 * 0.1 * 860) - 0.1 = 13 s = 65 steps.
        p, clock = self.policy("auto", mtbf_s=800)
        copied = run_steps(p, clock, 300, 0.2, 0.1)
        c, t = p.cost()
        self.assertAlmostEqual(c, 0.1, places=6)
        self.assertAlmostEqual(t, 0.2, places=6)
        m = p.mtbf_s()  # 800 s and the ~60 s the job has run
        self.assertLessEqual(abs(p.interval - (math.sqrt(2 * c * m) - c) / t), 1.5, (p.interval, m))
        self.assertTrue(62 <= p.interval <= 67, p.interval)
        gaps = [b - a for a, b in zip(copied, copied[1:])]
        self.assertTrue(all(g <= 67 for g in gaps), gaps)
        self.assertLessEqual(len(copied), 12, copied)  # 1-3 to measure, then about every 64th step

    def test_auto_saves_more_often_after_failures_and_respects_the_bound(self):
        quiet, c1 = self.policy("auto", mtbf_s=3600)
        run_steps(quiet, c1, 200, 0.2, 0.05)
        flaky, c2 = self.policy("auto", mtbf_s=3600, restarts=30, job_age_s=600)
        run_steps(flaky, c2, 200, 0.2, 0.05)
        self.assertLess(flaky.interval, quiet.interval)
        bounded, c3 = self.policy("auto:10", mtbf_s=3600)
        copied = run_steps(bounded, c3, 100, 0.2, 0.05)
        self.assertEqual(bounded.interval, 10)
        self.assertTrue(all(b - a <= 10 for a, b in zip(copied, copied[1:])), copied)

    def test_the_jobs_own_failures_outweigh_a_long_prior(self):
        # Two faults in the job's first three minutes: a failure a minute or
        # so, whatever the 1 h prior said (it weighs as much time as the job ran).
        flaky, _ = self.policy("auto", mtbf_s=3600, restarts=2, job_age_s=180)
        self.assertAlmostEqual(flaky.mtbf_s(), (180 + 180) / 3)
        # Before any failure, and after a long quiet run, the prior weighs in full.
        self.assertAlmostEqual(self.policy("auto", mtbf_s=3600, restarts=0, job_age_s=180)[0].mtbf_s(), 3780)
        self.assertAlmostEqual(self.policy("auto", mtbf_s=3600, restarts=1, job_age_s=86400)[0].mtbf_s(),
                               (3600 + 86400) / 2)
        # A job age nobody told (no BALLAST_JOB_START): only the prior to go by.
        self.assertAlmostEqual(self.policy("auto", mtbf_s=3600, restarts=1, job_age_s=0)[0].mtbf_s(), 3600 / 2)
        # ... and the interval follows: a save of 0.01 s and a step of 0.3 s
        # copy every few steps, not every ~60 as the prior alone would say.
        steady, c = self.policy("auto", mtbf_s=3600, restarts=2, job_age_s=180)
        run_steps(steady, c, 100, 0.3, 0.01)
        self.assertLessEqual(steady.interval, 8, steady.interval)  # the prior in full: ~17

    def test_ranks_that_measure_differently_copy_the_same_steps(self):
        # Two ranks in lockstep (threads; agree is an all-reduce of the max
        # over a barrier), one whose saves cost 4x the other's: each would
        # choose its own interval; agreeing on the largest, they copy the same steps.
        alone, c0 = self.policy("auto", mtbf_s=400)
        run_steps(alone, c0, 300, 0.2, 0.01)
        proposals, barrier = [0, 0], threading.Barrier(2, timeout=20)

        def agree_for(r):
            def agree(n):
                proposals[r] = n
                barrier.wait()
                m = max(proposals)
                barrier.wait()
                return m
            return agree

        ranks = [self.policy("auto", mtbf_s=400, agree=agree_for(r)) for r in (0, 1)]
        copied = [None, None]

        def run(r, save_s):
            copied[r] = run_steps(*ranks[r], 300, 0.2, save_s)

        threads = [threading.Thread(target=run, args=(0, 0.01)), threading.Thread(target=run, args=(1, 0.04))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertIsNotNone(copied[0])
        self.assertEqual(copied[0], copied[1])  # every copied step the same on both ranks
        self.assertEqual(ranks[0][0].interval, ranks[1][0].interval)
        self.assertGreater(ranks[0][0].interval, alone.interval)  # the cheap rank follows the costly one

    def test_the_save_cost_counts_what_the_next_step_loses(self):
        # The blocking copy is 0.01 s, but the step after a copy runs 0.1 s
        # slower (persist and replica copies compete for the cores): C = 0.11.
        p, clock = self.policy("auto", mtbf_s=1000)
        for s in range(1, 400):
            clock.t += 0.2
            if p._last_call is not None and p._last_call[2]:
                clock.t += 0.1
            if p.due(s):
                clock.t += 0.01
                p.copied(s, 0.01)
        c, t = p.cost()
        self.assertAlmostEqual(c, 0.11, places=6)
        self.assertAlmostEqual(t, 0.2, places=6)

    def test_persist_and_check_steps_always_copy_and_a_repeated_step_gets_the_same_answer(self):
        p, clock = self.policy(50, check_every=20)
        self.assertTrue(p.due(1))
        p.copied(1, 0.01)
        self.assertFalse(p.due(2))
        self.assertFalse(p.due(2))
        self.assertTrue(p.due(3, persist=True))
        p.copied(3, 0.01)
        self.assertTrue(p.due(20))
        self.assertTrue(p.due(20))


def paced(pace, clock, steps, step_s, write_s, persist_every=1):
    """Drives `pace` as a loop that saves every step (persist=True every
    persist_every-th), each write durable by the next call; the steps asked for."""
    asked = []
    durable = 0
    for s in range(steps):
        clock.t += step_s
        pace.note(s, durable, write_s)
        if s % persist_every == 0 and pace.wants(s):
            asked.append(s)
            durable = s
    return asked


class PersistPaceTest(unittest.TestCase):
    def pace(self, share, clock):
        said = []
        return save_policy.PersistPace(share, clock=clock, log=said.append), said

    def test_every_step_is_written_while_the_writes_fit_the_share(self):
        clock = Clock()
        pace, said = self.pace(0.25, clock)
        self.assertEqual(paced(pace, clock, 30, 0.1, 0.02), list(range(30)))
        self.assertEqual((pace.every, said), (1, []))

    def test_costly_writes_go_out_once_per_power_of_two_block(self):
        clock = Clock()
        pace, said = self.pace(0.25, clock)
        # 0.15 s writes against 0.1 s steps: 4 steps would be 37.5% of the time, 8 are 18.75%.
        asked = paced(pace, clock, 64, 0.1, 0.15)
        self.assertEqual(pace.every, 8)
        self.assertEqual([s for s in asked if s >= 8], [8, 16, 24, 32, 40, 48, 56])
        self.assertTrue(any("at most once every 8 step(s)" in m and "--ckpt-copy-share" in m for m in said), said)

    def test_ranks_that_measure_differently_still_write_the_slow_ranks_steps(self):
        fast_clock, slow_clock = Clock(), Clock()
        fast, _ = self.pace(0.25, fast_clock)
        slow, _ = self.pace(0.25, slow_clock)
        a = paced(fast, fast_clock, 100, 0.1, 0.04, persist_every=1)  # k = 2
        b = paced(slow, slow_clock, 100, 0.1, 0.3, persist_every=1)   # k = 16
        self.assertEqual((fast.every, slow.every), (2, 16))
        self.assertTrue(set(b) <= set(a), sorted(set(b) - set(a)))

    def test_steps_asked_less_often_than_the_block_are_all_written(self):
        clock = Clock()
        pace, _ = self.pace(0.25, clock)
        asked = paced(pace, clock, 400, 0.1, 0.3, persist_every=25)  # k = 16 < 25
        self.assertEqual(pace.every, 16)
        self.assertEqual(asked, list(range(0, 400, 25)))

    def test_share_one_writes_every_step_and_bad_shares_get_a_clear_error(self):
        clock = Clock()
        pace, said = self.pace(1, clock)
        self.assertEqual(paced(pace, clock, 20, 0.1, 0.5), list(range(20)))
        self.assertEqual(said, [])
        self.assertTrue(pace.wants(19))  # asked again for the same step: the same answer
        for bad in ("0", "1.5", "-1", "often"):
            with self.assertRaisesRegex(ValueError, r"\(0, 1\]"):
                save_policy.PersistPace(bad)

    def test_the_environment_sets_the_share(self):
        os.environ["BALLAST_CKPT_COPY_SHARE"] = "0.5"
        self.addCleanup(os.environ.pop, "BALLAST_CKPT_COPY_SHARE", None)
        self.assertEqual(save_policy.PersistPace().share, 0.5)


def replicated(paces, clocks, steps, step_s, put_s):
    """Drives ranks in lockstep (paces[i] with clocks[i], put_s[i] its agent's
    copy time) as a loop that saves every step; each rank's asked-for steps.
    Their agreement is the largest wish, as the Checkpointer's all-reduce."""
    wishes = {}

    def agree_for(i):
        def agree(k):
            wishes[i] = k
            return max(p.wish() for p in paces)
        return agree

    for i, p in enumerate(paces):
        p._agree = agree_for(i)
    asked = [[] for _ in paces]
    done = [0] * len(paces)
    for s in range(steps):
        for i, p in enumerate(paces):
            clocks[i].t += step_s
            p.note(s, done[i], put_s[i])
            if p.wants(s):
                asked[i].append(s)
                done[i] = s  # the agent sends it before the next call
    return asked


class ReplicaPaceTest(unittest.TestCase):
    def pace(self, share, clock):
        said = []
        return save_policy.ReplicaPace(share, clock=clock, log=said.append), said

    def test_every_step_goes_while_the_copies_fit_the_share(self):
        clock = Clock()
        pace, said = self.pace(0.25, clock)
        self.assertEqual(replicated([pace], [clock], 80, 0.1, [0.02])[0], list(range(80)))
        self.assertEqual((pace.every, said), (1, []))

    def test_ranks_that_measure_differently_send_the_same_steps_once_per_block(self):
        # 0.15 s copies against 0.1 s steps on one node, 0.02 s on the other:
        # the slower one's k (8: 18.75 % of the time) for both, from the first
        # agreement after the measurements (step 32) on.
        clocks = [Clock(), Clock()]
        (slow, said), (fast, _) = self.pace(0.25, clocks[0]), self.pace(0.25, clocks[1])
        a, b = replicated([slow, fast], clocks, 100, 0.1, [0.15, 0.02])
        self.assertEqual((slow.wish(), fast.wish()), (8, 1))
        self.assertEqual((slow.every, fast.every), (8, 8))
        self.assertEqual(a, b)
        self.assertEqual(a, list(range(32)) + [32, 40, 48, 56, 64, 72, 80, 88, 96])
        self.assertTrue(any("at most once every 8 step(s)" in m and "--ckpt-copy-share" in m for m in said), said)
        # Cheaper copies later: every step again from the next agreement.
        for i in range(20):
            slow.note(99, 1000 + i, 0.01)  # 16 new measurements replace the slow ones
            fast.note(99, 1000 + i, 0.01)
        asked = [[s for s in range(100, 140) if p.wants(s)] for p in (slow, fast)]
        self.assertEqual(asked[0], asked[1])
        self.assertEqual(asked[0], [104, 112, 120] + list(range(128, 140)))
        self.assertIn("every saved step", said[-1])

    def test_a_restart_that_goes_back_agrees_again_and_share_one_sends_every_step(self):
        clock = Clock()
        pace, _ = self.pace(0.25, clock)
        replicated([pace], [clock], 64, 0.1, [0.5])
        self.assertEqual(pace.every, 32)
        agreed = []
        pace._agree = lambda k: agreed.append(k) or k
        self.assertTrue(pace.wants(10))  # back to step 10 (a rollback): agreed again, and sent
        self.assertEqual(agreed, [32])
        self.assertTrue(pace.wants(10))  # the same step asked again: the same answer, no collective
        self.assertEqual(agreed, [32])
        one = save_policy.ReplicaPace(1, clock=clock, log=lambda m: None)
        self.assertEqual(replicated([one], [clock], 70, 0.1, [0.5])[0], list(range(70)))

    def test_every_rank_under_an_agent_agrees_and_only_those_with_peer_holders_ask(self):
        ckpt = ballast.Checkpointer(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"rp-{os.getpid()}"),
                                    rank=0, world_size=1)
        self.addCleanup(ckpt.close)
        self.assertIsNone(ckpt._replica_pace)  # no agent: nothing to send, nothing to agree on
        ckpt.save(1, {"w": torch.zeros(4)})
        self.assertEqual(ckpt._store.requested_replica_step(), 0)
        # Under an agent (its store), whether or not the agent sends replicas
        # (BALLAST_CKPT_REPLICA_PEERS), the rank joins the agreement at steps 0
        # and 32 (ranks whose agents were started with different
        # --ckpt-replicas must not leave the collective half joined); only a
        # rank with peer holders asks for copies.
        for peers, want_requested in (("", 0), ("0", 0), ("1", 39)):
            name = f"/ballast-test-rp-{os.getpid()}-{id(self)}-{peers or 'unset'}"
            agent_store = _ballast.create_store(name)  # plays the agent: owns the memory
            self.addCleanup(agent_store.close)
            env = {k: v for k, v in os.environ.items() if k != save_policy.ENV_REPLICA_PEERS}
            if peers:
                env[save_policy.ENV_REPLICA_PEERS] = peers
            with unittest.mock.patch.dict(os.environ, env, clear=True):
                c = ballast.Checkpointer(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"rp-{os.getpid()}-{peers}"),
                                         shm=name, rank=0, world_size=1)
            self.addCleanup(c.close)
            agreed = []
            c._agree_interval = lambda k: agreed.append(k) or k
            for step in range(40):
                c.save(step, {"w": torch.full((4,), float(step))})
            c.wait_saved()
            self.assertEqual(agreed, [1, 1], peers)
            self.assertEqual(agent_store.requested_replica_step(), want_requested, peers)


class CheckpointerTest(TestCase):
    def test_save_copies_only_the_steps_save_every_picks(self):
        ckpt = ballast.Checkpointer(os.path.join(self.tmp, "c"), rank=0, world_size=1, save_every=3)
        self.addCleanup(ckpt.close)
        self.assertEqual(ckpt.save_interval, 3)
        copied = [s for s in range(1, 8) if ckpt.save(s, {"w": torch.full((4,), float(s))})]
        self.assertEqual(copied, [1, 4, 7])
        self.assertEqual(ckpt.memory_step(), 7)
        self.assertTrue(ckpt.save(8, {"w": torch.zeros(4)}, persist=True))  # a persist request always copies
        ckpt.wait()
        self.assertEqual(ckpt.latest_step(), 8)
        with self.assertRaisesRegex(ValueError, "save_every"):
            ballast.Checkpointer(os.path.join(self.tmp, "d"), rank=0, world_size=1, save_every="often")

    def test_the_environment_sets_it_for_scripts_that_do_not(self):
        os.environ["BALLAST_SAVE_EVERY"] = "auto:7"
        self.addCleanup(os.environ.pop, "BALLAST_SAVE_EVERY", None)
        ckpt = ballast.Checkpointer(os.path.join(self.tmp, "e"), rank=0, world_size=1)
        self.addCleanup(ckpt.close)
        self.assertEqual(ckpt._interval.bound, 7)
        self.assertTrue(ckpt._interval.auto)


class SaveEveryAutoJob(HealthJob):
    def killed_at_24(self, name, flags, shape):
        """(log, events, output dir) of the 40-step job with `flags` and rank 1 killed at
        step 24, after checking it ends with the weights of the job without
        the fault (run first)."""
        clean = self.reference("", script_args=shape)
        rc, log, events, out = self.launch(name.replace(" ", "-"), *flags, "--chaos", "kill-worker:rank=1,at_step=24",
                                         script_args=shape)
        self.assertEqual(rc, 0, log[-8000:])
        done = events[-1]
        self.assertEqual((done["ev"], done["step"]), ("done", 40), done)
        self.assertEqual(done["sha256"], clean["sha256"], f"{name} must not change what the job trained")
        return log, events, out

    def test_a_killed_worker_loses_at_most_the_interval_and_the_job_ends_as_without_the_fault(self):
        # 16 MiB more state per rank: a copy of at least ~3 ms, steps of 0.05-0.15 s, an MTBF
        # of 60 s: sqrt(2 C M) >= 0.6 s, an interval of 4 steps or more.
        shape = ["--steps", "40", "--step-time", "0.05", "--persist-every", "0", "--pad-mb", "16"]
        log, events, _ = self.killed_at_24("save_every auto", ["--save-every", "auto", "--mtbf", "60s"], shape)
        chosen = [int(n) for n in re.findall(r"save_every auto: copying every (\d+) step", log)]
        self.assertTrue(chosen and max(chosen) >= 3, log[-6000:])
        starts = [e for e in events if e["ev"] == "start"]
        self.assertEqual([s["source"] for s in starts], [None, "memory"], starts)
        resumed = starts[1]["step"]
        print(f"intervals chosen {chosen}, killed at 24, resumed at {resumed}")
        # The newest copied step before the kill: at most the interval in use then behind it.
        self.assertLessEqual(resumed, 24)
        self.assertGreaterEqual(resumed, 24 - max(chosen), (resumed, chosen))

    def test_costly_persists_are_paced_and_wait_still_writes_the_last_step(self):
        # Every step asked to persist, writes allowed 0.1% of the time: a write of
        # 30 us or more against steps of 20-30 ms goes out once per 2 steps or
        # more (a few ms: once per 64 or more). The kill restarts the workers
        # from memory; wait() at the end writes the last step.
        log, _, out = self.killed_at_24("paced persists", ["--ckpt-copy-share", "0.001"],
                                        ["--steps", "40", "--persist-every", "1"])
        every = [int(k) for k in re.findall(r"persisting at most once every (\d+) step", log)]
        self.assertTrue(every and max(every) >= 2, log[-6000:])
        committed = sorted({int(s) for s in re.findall(r"checkpoint step (\d+) durable on all 4 ranks", log)})
        print(f"persist every step, --ckpt-copy-share 0.001: blocks of {every} steps, steps on disk {committed}")
        # Each process's first call, the first of each block, the failure's
        # breakpoint save and the last: well under half of the 40 steps asked for.
        self.assertLess(len(committed), 20, committed)
        # (wait() returns once this rank's shard is durable; the step is complete once all four are.)
        latest = ballast._ballast.read_latest_step(os.path.join(out, "ckpt"))
        self.assertEqual((latest, committed[-1]), (40, 40), "wait() writes the newest step left out")

    def test_bad_values_get_a_clear_error(self):
        for flags, want in ((["--save-every", "0"], "--save-every 0: give a step count >= 1"),
                            (["--mtbf", "soon"], "--mtbf soon: give a duration > 0"),
                            (["--ckpt-copy-share", "0"], "--ckpt-copy-share must be a share of the time in (0, 1]")):
            p = subprocess.run([BIN, "launch", "--nodes", "1", *flags, "train.py"], capture_output=True, text=True,
                               timeout=30)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn(want, p.stderr)


if __name__ == "__main__":
    unittest.main()
