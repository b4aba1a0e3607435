"""In-memory replicas on peer nodes under `ballast launch`: 3 nodes x 2
workers of real DDP (gloo), a flash checkpoint every step, and node rank 1
lost mid-training (its agent SIGKILLed, its shared memory removed: a lost
host). Launch starts a replacement agent; before its workers start it copies
ranks 2 and 3's newest step from the replica node rank 2 holds, so the
replacement's workers load from memory ("replica") and every other rank from
its own memory: no rank reads the disk, and the final weights are bit for bit
those of an uninterrupted run (train_ckpt.py reduces gradients parameter by
parameter, so a restarted world computes what an uninterrupted one does).

The same with --ckpt-replicas 0: the replacement has nothing in memory, so
every rank loads from disk (the choice is one for the whole world), with the
same final weights.
"""

import glob
import json
import os
import subprocess
import unittest

from _util import TestCase, assert_resumed_from, events, final_hashes, launch_train_ckpt, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.environ.get("BALLAST_BIN", os.path.join(HERE, "../../build/bin/ballast"))
if not os.access(BIN, os.X_OK):  # a missing build is a failure, not a skip
    raise RuntimeError(f"no ballast binary at {BIN}: run `make` (or set BALLAST_BIN)")
PYTHON = os.environ.get("BALLAST_PYTHON", "/usr/bin/python3")
SCRIPT = os.path.join(HERE, "../integration/scripts/train_ckpt.py")
WORLD, STEPS, KILL_STEP = 6, 10, 4


def descendants(root):
    """The pids of root's process tree below it (from /proc)."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def threads(pid):
    """{tid: (name, nice)} of a process's threads (gone ones left out)."""
    got = {}
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        got[int(tid)] = (name, int(stat.rsplit(")", 1)[1].split()[16]))  # field 19: nice
    return got


class PeerReplicas(TestCase):
    def launch(self, out, *extra, kill=True, nodes="3", kill_rank=2, script_args=()):
        return launch_train_ckpt(self, out, *extra, steps=STEPS, step_time=0.05, nodes=nodes,
                                 kill_step=KILL_STEP if kill else None, kill_rank=kill_rank, script_args=script_args)

    def test_the_copy_threads_yield_the_cores_to_training(self):
        # 2 nodes x 1 worker, every step saved, persisted and replicated: the
        # agents' persist and replica threads run at --ckpt-copy-nice, the
        # workers and the agents' other threads at the launcher's nice value.
        out = os.path.join(self.tmp, "nice")
        os.makedirs(out)
        script = os.path.join(HERE, "../integration/scripts/health_train.py")
        base = os.nice(0)
        p = subprocess.Popen([BIN, "launch", "--python", PYTHON, "--nodes", "2", "--nproc-per-node", "1",
                              "--ckpt-copy-nice", "12", script, "--out", out, "--steps", "150", "--step-time", "0.04",
                              "--persist-every", "1"],
                             env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        last = {}  # (pid, tid) -> its (name, nice) when last seen
        try:
            def sampled():
                # The threads of the agents' whole lives (a put's thread on the
                # receiving side lasts a millisecond: replica_test checks it),
                # once the workers train. A copy thread names itself, then
                # lowers itself: its last look counts.
                training = os.path.exists(os.path.join(out, "events.jsonl"))
                for pid in descendants(p.pid):
                    for tid, got in threads(pid).items():
                        last[(pid, tid)] = got
                return training and {"ckpt-persist", "replica-out"} <= {name for name, _ in last.values()}
            wait_for("the copy threads of both agents", sampled, 60, interval=0.05)
        finally:
            log = p.communicate(timeout=180)[0]
        self.assertEqual(p.returncode, 0, log[-6000:])
        seen = {}  # thread name -> the nice values of the threads of that name
        for name, nice in last.values():
            seen.setdefault(name, set()).add(nice)
        for name in ("ckpt-persist", "replica-out"):
            self.assertEqual(seen[name], {max(base, 12)}, (name, seen))
        # The launcher's, the master's and the agents' other threads, the workers'.
        others = {name: nice for name, nice in seen.items() if name not in ("ckpt-persist", "replica-out",
                                                                            "replica-in")}
        self.assertEqual(set().union(*others.values()), {base}, seen)
        with open(os.path.join(out, "events.jsonl")) as f:
            done = [json.loads(line) for line in f if line.strip()][-1]
        self.assertEqual((done["ev"], done["step"]), ("done", 150), done)
        with open(os.path.join(out, "ckpt", "latest")) as f:  # every step asked was persisted by the end
            self.assertEqual(f.read().strip(), "150")

    def test_replacement_node_loads_from_the_peer_replica_and_matches_an_uninterrupted_run(self):
        ref = os.path.join(self.tmp, "ref")
        self.launch(ref, kill=False)
        want = final_hashes(ref, WORLD)
        self.assertEqual(len(want), WORLD)

        out = os.path.join(self.tmp, "run")
        log = self.launch(out)
        self.assertEqual(len(events(out, 2, "kill-node")), 1, log[-4000:])
        self.assertIn("replicas of this node's steps go to the next 1 node(s)", log)
        for rank in (2, 3):
            self.assertRegex(log, rf"rank {rank} step {KILL_STEP} copied from the replica on node node-2")
        assert_resumed_from(self, out, log, KILL_STEP, (2, 3), WORLD)
        self.assertEqual(final_hashes(out, WORLD), want)
        # The replacement (node-1-2) is a new agent: its stores are new names.
        starts = events(out, 2, "start")
        self.assertEqual(len(starts), 2)
        self.assertNotEqual(starts[0]["shm"], starts[1]["shm"])
        # Every agent unlinked its stores and its replica stores.
        self.assertEqual(glob.glob("/dev/shm" + starts[1]["shm"].rsplit("-", 1)[0] + "-*"), [])

    def test_a_shrunken_world_reshards_the_lost_ranks_state_from_the_replicas(self):
        # Node rank 2 (ranks 4, 5) is lost and not replaced: the world goes on
        # as 4 ranks. The momentum is saved sharded (each rank a slice of one
        # flat vector), so the new ranks 2 and 3 need the slices of the lost
        # ranks 4 and 5, which only node rank 0's replicas hold.
        def run(name, *extra):
            out = os.path.join(self.tmp, name)
            log = self.launch(out, "--max-replacements", "0", *extra, nodes="2:3", kill_rank=4,
                              script_args=["--shard-momentum"])
            self.assertEqual(len(events(out, 4, "kill-node")), 1, log[-4000:])
            for rank in range(4):
                self.assertEqual(events(out, rank, "start")[-1]["world"], 4, log[-4000:])
            loads = {r: events(out, r, "load")[-1] for r in range(4)}
            restored = {r: events(out, r, "restored")[-1] for r in range(4)}
            self.assertEqual({r: e["step"] for r, e in loads.items()}, dict.fromkeys(range(4), KILL_STEP),
                             log[-4000:])
            return out, log, {r: e["source"] for r, e in loads.items()}, restored

        out, log, sources, restored = run("shrink")
        self.assertEqual(sources, {0: "memory", 1: "memory", 2: "replica", 3: "replica"}, log[-4000:])
        ref_out, ref_log, ref_sources, ref_restored = run("shrink-disk", "--ckpt-replicas", "0")
        self.assertEqual(ref_sources, dict.fromkeys(range(4), "disk"), ref_log[-4000:])
        # The same state as from disk, and the same training after it.
        self.assertEqual({r: e["momentum"] for r, e in restored.items()},
                         {r: e["momentum"] for r, e in ref_restored.items()})
        self.assertEqual(final_hashes(out, WORLD), final_hashes(ref_out, WORLD))
        self.assertEqual(len(final_hashes(out, WORLD)), 4)

    def test_no_checkpoint_for_the_lost_node_fails_the_job_instead_of_starting_over(self):
        # Nothing on disk, no replicas: the replacement's ranks have no step
        # while the survivors hold the kill step in memory. Every rank's
        # load() raises CheckpointLostError naming them, and the job fails
        # at once (not retried) with that message.
        out = os.path.join(self.tmp, "lost")
        os.makedirs(out)
        argv = [BIN, "launch", "--python", PYTHON, "--nodes", "3", "--nproc-per-node", "2", "--max-restarts", "2",
                "--ckpt-replicas", "0", SCRIPT, "--out", out, "--ckpt", os.path.join(out, "ckpt"),
                "--steps", str(STEPS), "--step-time", "0.05", "--no-persist",
                "--kill-node-step", str(KILL_STEP), "--kill-rank", "2"]
        p = subprocess.run(argv, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=240)
        log = p.stdout
        self.assertEqual(p.returncode, 1, log[-6000:])
        want = (f"ranks 0-1, 4-5 hold step {KILL_STEP} in memory, but no checkpoint in memory, in a peer's "
                f"replica or on disk covers step {KILL_STEP} for ranks 2-3")
        self.assertIn(want, log)
        self.assertIn("checkpoint-lost failures are retried at most 0 time(s)", log)
        for rank in range(WORLD):  # nobody trained on from step 0
            self.assertEqual([e["step"] for e in events(out, rank, "load")], [None], f"rank {rank}")

        # Allowed: every rank starts over and the job finishes.
        out = os.path.join(self.tmp, "fresh")
        os.makedirs(out)
        argv[argv.index("--out") + 1] = out
        argv[argv.index("--ckpt") + 1] = os.path.join(out, "ckpt")
        p = subprocess.run(argv, env=dict(os.environ, OMP_NUM_THREADS="1", BALLAST_ALLOW_FRESH_START="1"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
        self.assertEqual(p.returncode, 0, p.stdout[-6000:])
        self.assertIn("every rank starts over from step 0 (allowed by", p.stdout)
        for rank in range(WORLD):
            self.assertEqual(events(out, rank, "load")[-1]["step"], None, f"rank {rank}")
            self.assertEqual(len(events(out, rank, "done")), 1, f"rank {rank}")

    def test_without_replicas_survivors_read_memory_and_the_replacement_disk(self):
        out = os.path.join(self.tmp, "norep")
        log = self.launch(out, "--ckpt-replicas", "0")
        self.assertNotIn("copied from the replica", log)
        # Node rank 1 (ranks 2, 3) was lost: its replacement reads the newest
        # step on disk; the survivors hold that step in memory and read it there.
        for rank in range(WORLD):
            loads = events(out, rank, "load")
            self.assertEqual(loads[-1]["source"], "disk" if rank in (2, 3) else "memory", f"rank {rank}: {loads}")
            self.assertEqual(loads[-1]["step"], KILL_STEP, f"rank {rank}: {loads}")
        self.assertEqual(len(final_hashes(out, WORLD)), WORLD)


if __name__ == "__main__":
    unittest.main()
