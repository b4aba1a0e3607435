"""FSDP2 / DTensor (and FSDP1's ShardedTensor) state in flash checkpoints,
resharded on load, on the pinned torch 2.x (CPU, gloo).

Each rank saves only its local pieces; a world of another size (uneven
splits: 7 and 3 rows over 2, 3 and 4 ranks) loads them into its freshly
sharded model and an AdamW that has no state yet, and every full tensor of
the model and the optimizer must equal the saved one bitwise
(tests/python/fsdp_worker.py does the work; torchrun runs the worlds):

- FSDP2 4 -> 2 and 2 -> 3 ranks, from disk;
- HSDP (a 2 x 2 mesh: replicate x shard) 4 -> 2 (a 1-D mesh) and 4 -> 4;
- ShardedTensors (FSDP1's sharded state dict) 4 -> 3;
- DCP both ways: `ballast ckpt export --format dcp` read by
  torch.distributed.checkpoint.load on 3 ranks, and a job on 2 ranks
  starting from a DCP checkpoint (ckpt.load(from_dcp=...));
- under `ballast launch`, 2 nodes x 2 workers, a flash checkpoint every
  step: a node is lost and the job goes on with the 2 ranks left, which
  load from the world's memory (the survivor's own stores and the replica
  it holds of the lost node's ranks).
"""

import json
import os
import subprocess
import unittest

from _util import TestCase, ballast_bin, torch2_python

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = ballast_bin()
WORKER = os.path.join(HERE, "fsdp_worker.py")



def read_events(out):
    got = []
    for name in sorted(os.listdir(out)):
        if name.startswith("events-"):
            with open(os.path.join(out, name)) as f:
                got.extend(json.loads(line) for line in f)
    return got


class Fsdp2Reshard(TestCase):
    def torchrun(self, nproc, *argv):
        # torchrun is `python -m torch.distributed.run`: the venv the tests run in has
        # Ballast's wheel installed and torch through a .pth, not torch's scripts.
        cmd = [torch2_python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), WORKER,
               "--out", self.out, "--ckpt", os.path.join(self.out, "ckpt"), *argv]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=150,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        self.assertEqual(p.returncode, 0, f"{' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")

    def reshard(self, saved, loaded, *flags, plain=True):
        self.out = os.path.join(self.tmp, f"{saved}-{loaded}")
        os.makedirs(self.out, exist_ok=True)
        self.torchrun(saved, "--mode", "save", *flags)
        self.torchrun(loaded, "--mode", "load", *flags)
        loads = [e for e in read_events(self.out) if e["kind"] == "loaded"]
        self.assertEqual(sorted(e["rank"] for e in loads), list(range(loaded)))
        for e in loads:
            self.assertTrue(e["ok"], e)  # rank 0 compared every full tensor; every rank its targets
            self.assertEqual(e["source"], "disk")
            if plain:
                # load() without into: DTensors on this world's mesh, and
                # load(full=True): the whole tensors.
                self.assertEqual((e["plain_type"], e["optim_type"]), ("DTensor", "DTensor"), e)
                self.assertTrue(e["plain_local_equal"], e)
                self.assertTrue(e["full_equal"], e)
        return loads

    def test_fsdp2_4_to_2(self):
        self.reshard(4, 2)

    def test_fsdp2_2_to_3(self):
        self.reshard(2, 3)

    def test_hsdp_4_to_2_and_to_4(self):
        self.reshard(4, 4, "--hsdp")
        # The same checkpoint on a 1-D mesh of 2 ranks.
        self.torchrun(2, "--mode", "load")
        loads = [e for e in read_events(self.out) if e["kind"] == "loaded" and e["world"] == 2]
        self.assertEqual(len(loads), 2)
        self.assertTrue(all(e["ok"] for e in loads), loads)

    def test_sharded_tensor_4_to_3(self):
        self.reshard(4, 3, "--sharded-tensor", plain=False)


    def test_dcp_export_and_start_from_dcp(self):
        self.out = os.path.join(self.tmp, "dcp")
        os.makedirs(self.out)
        native = os.path.join(self.out, "native-dcp")
        self.torchrun(4, "--mode", "save", "--dcp", native)
        # Ballast -> DCP: the CLI's export, read by torch.distributed.checkpoint.load on 3 ranks.
        exported = os.path.join(self.out, "exported-dcp")
        p = subprocess.run([BIN, "ckpt", "export", os.path.join(self.out, "ckpt"), "--format", "dcp",
                            "--to", exported, "--python", torch2_python()], capture_output=True, text=True,
                           timeout=120)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("to the DCP checkpoint", p.stdout)
        self.assertTrue(os.path.isfile(os.path.join(exported, ".metadata")))
        self.torchrun(3, "--mode", "dcp-load", "--dcp", exported)
        # DCP -> Ballast: a job starts from a DCP checkpoint DCP itself wrote (on 2 ranks).
        self.torchrun(2, "--mode", "dcp-start", "--dcp", native, "--ckpt", os.path.join(self.out, "empty"))
        loads = [e for e in read_events(self.out) if e["kind"] == "loaded"]
        self.assertEqual(sorted((e["world"], e["rank"]) for e in loads), [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)])
        for e in loads:
            self.assertEqual((e["step"], e["source"], e["ok"]), (3, "dcp", True), e)


class Fsdp2Example(TestCase):
    def test_example_runs_as_written_and_resumes_on_another_world(self):
        example = os.path.join(HERE, "../../examples/fsdp2_train.py")
        ckpt = os.path.join(self.tmp, "ckpt")
        outs = []
        for nproc, steps in ((2, 12), (3, 16)):
            p = subprocess.run([BIN, "launch", "--python", torch2_python(), "--nodes", "1", "--nproc-per-node",
                                str(nproc), example, "--ckpt", ckpt, "--steps", str(steps)],
                               capture_output=True, text=True, timeout=200, env=dict(os.environ, OMP_NUM_THREADS="1"))
            self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-6000:])
            outs.append(p.stdout + p.stderr)
        self.assertIn("done: 12 steps on 2 ranks", outs[0])
        # The second job (3 ranks) starts from the first one's last step on disk, resharded.
        for r in range(3):
            self.assertIn(f"rank {r}/3: resumed from step 12 (disk)", outs[1])
        self.assertIn("done: 16 steps on 3 ranks", outs[1])


class Fsdp2NodeLoss(TestCase):
    def test_node_lost_world_shrinks_and_loads_from_memory(self):
        out = os.path.join(self.tmp, "launch")
        os.makedirs(out)
        argv = [BIN, "launch", "--python", torch2_python(), "--nodes", "1:2", "--nproc-per-node", "2",
                "--max-replacements", "0", WORKER, "--mode", "train", "--out", out,
                "--ckpt", os.path.join(out, "ckpt"), "--steps", "20", "--kill-step", "8", "--kill-rank", "2",
                "--step-time", "0.05"]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=200,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        log = p.stdout[-4000:] + p.stderr[-8000:]
        self.assertEqual(p.returncode, 0, log)
        evs = read_events(out)
        self.assertEqual([e["step"] for e in evs if e["kind"] == "kill-node"], [8], log)
        after = [e for e in evs if e["kind"] == "load" and e["world"] == 2]
        self.assertEqual(sorted(e["rank"] for e in after), [0, 1], log)
        for e in after:
            # Nothing persisted: the kill step, from memory (the lost ranks'
            # pieces from the replica the survivor holds).
            self.assertEqual(e["step"], 8, e)
            self.assertIn(e["source"], ("memory", "replica"), e)
        self.assertIn("replica", {e["source"] for e in after}, log)
        self.assertTrue(next(e for e in after if e["rank"] == 0)["ok"], log)  # bitwise the saved state
        self.assertIn("checkpoint step 8 of 4 ranks loaded from the world's memory in a world of 2", log)
        done = [e for e in evs if e["kind"] == "done"]
        self.assertEqual(sorted((e["rank"], e["world"]) for e in done), [(0, 2), (1, 2)], log)


if __name__ == "__main__":
    unittest.main()
