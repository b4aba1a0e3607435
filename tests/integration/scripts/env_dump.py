"""Writes the worker's environment as JSON to $OUT_DIR/env-rank<RANK>.json (no torch)."""
import json
import os

out = os.environ["OUT_DIR"]
with open(os.path.join(out, f"env-rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(dict(os.environ), f)
