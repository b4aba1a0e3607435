"""`ballast simulate`: the CLI end to end (JSON document, CSV, PNG chart,
errors). The simulator's logic is tested in src/sim/simulator_test.cc."""
import csv
import json
import os
import subprocess
import tempfile
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("BALLAST_BIN", os.path.join(ROOT, "build", "bin", "ballast"))


class SimulateCli(unittest.TestCase):
    def test_json_csv_and_chart_for_a_day_at_1000_gpus(self):
        with tempfile.TemporaryDirectory() as d:
            csv_path, png_path = os.path.join(d, "s.csv"), os.path.join(d, "s.png")
            r = subprocess.run([BIN, "simulate", "--gpus", "1000", "--days", "1", "--json", "--csv", csv_path,
                                "--png", png_path], capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            doc = json.loads(r.stdout)
            self.assertAlmostEqual(doc["p_failure_per_day"], 0.933, delta=0.001)  # 1 - exp(-1000 x 0.27%)
            self.assertEqual(sorted(doc["policies"]), ["ballast", "dlrover", "manual"])
            for name, p in doc["policies"].items():
                self.assertGreater(p["goodput"], 0, name)
                self.assertLessEqual(p["goodput"], 1, name)
                self.assertAlmostEqual(p["productive_s"] + sum(p["lost_s"].values()), p["wall_s"], delta=1e-3 * p["wall_s"])
            self.assertGreaterEqual(doc["policies"]["ballast"]["goodput"], doc["policies"]["dlrover"]["goodput"])
            with open(csv_path) as f:
                rows = list(csv.DictReader(f))
            self.assertEqual(list(rows[0]), ["hours", "manual", "dlrover", "ballast"])
            self.assertGreater(len(rows), 10)
            with open(png_path, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    def test_bad_input_says_what_to_fix(self):
        for args, want in ((["--gpus", "12"], "multiple of --gpus-per-node"),
                           (["--faults", "3:disk"], "SECONDS:process"),
                           (["--policies", "slurm"], "unknown policy"),
                           (["--restart-fixable", "2"], "between 0 and 1")):
            r = subprocess.run([BIN, "simulate", *args], capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 2, (args, r.stderr))
            self.assertIn(want, r.stderr, args)


if __name__ == "__main__":
    unittest.main()
