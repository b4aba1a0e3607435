"""The Ray bridge's process plumbing that needs no Ray cluster (test_ray runs the rest on a real one).

    cd tests/python && /usr/bin/python3 -m unittest -v test_ray_bridge

An agent's actor process ends the moment the raylet that started it exits
(_die_with_raylet): its agent child then dies with it and the master sees the
node's stream close at once, instead of after Ray's own worker notices. Here a
process that names itself "raylet" stands in for Ray's raylet (a Ray worker's
parent is its node's raylet: test_ray's clusters show it), and a child of it
runs the bridge's watch, as the actor's __init__ does.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

from _ray_cluster import alive

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BRIDGE = os.path.join(ROOT, "python", "ballast", "_ray_bridge.py")

# The actor: loads the bridge from its file (stdlib imports only), starts the watch, says so, waits.
ACTOR = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("bridge", sys.argv[1])
bridge = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bridge)
bridge._die_with_raylet()
open(sys.argv[2], "w").close()
time.sleep(120)
"""
# The stand-in parent: takes the name given (its /proc comm), starts the actor, prints its pid, waits.
PARENT = """
import ctypes, subprocess, sys, time
ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)  # PR_SET_NAME
actor = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[3], sys.argv[4]])
print(actor.pid, flush=True)
time.sleep(120)
"""


class DieWithRaylet(unittest.TestCase):
    def start(self, parent_name):
        """(parent process, actor pid) once the actor's watch runs."""
        d = tempfile.mkdtemp(prefix="ballast-bridge-")
        ready = os.path.join(d, "watching")
        parent = subprocess.Popen([sys.executable, "-c", PARENT, parent_name, ACTOR, BRIDGE, ready],
                                  stdout=subprocess.PIPE, text=True)
        self.addCleanup(lambda: (parent.kill(), parent.wait(), parent.stdout.close()))
        actor = int(parent.stdout.readline())
        self.addCleanup(lambda: alive(actor) and os.kill(actor, signal.SIGKILL))
        deadline = time.monotonic() + 30
        while not os.path.exists(ready) and alive(actor) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertTrue(os.path.exists(ready), "the actor never started its watch")
        return parent, actor

    def test_the_actor_ends_when_its_raylet_exits(self):
        parent, actor = self.start("raylet")
        self.assertTrue(alive(actor))
        t0 = time.monotonic()
        parent.kill()
        parent.wait()
        while alive(actor) and time.monotonic() - t0 < 30:
            time.sleep(0.005)
        gone = time.monotonic() - t0
        self.assertFalse(alive(actor), "the actor outlived its raylet by 30 s")
        # Milliseconds by construction (a pidfd, no polling); the bound only separates it from never.
        self.assertLess(gone, 5.0)

    def test_a_parent_that_is_not_a_raylet_is_left_alone(self):
        parent, actor = self.start("python-driver")
        parent.kill()
        parent.wait()
        time.sleep(1.0)
        self.assertTrue(alive(actor), "the actor ended with a parent that is not a raylet")


if __name__ == "__main__":
    unittest.main()
