"""The event log of examples/train_ddp.py: one JSON object per line in
<out>/rank<R>.jsonl ("start", "step", "hang", "done" events, each with its
time "t"). train_ddp.py writes it; the demo, the recovery benchmark and the
tests read it. No torch import, so readers stay light.
"""
import json
import os
import time


def events_path(out, rank):
    return os.path.join(out, f"rank{rank}.jsonl")


def append_event(out, rank, **event):
    event["t"] = time.time()
    with open(events_path(out, rank), "a") as f:
        f.write(json.dumps(event) + "\n")


def read_events(out, rank):
    """Every event rank `rank` logged so far ([] before its first one)."""
    path = events_path(out, rank)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
