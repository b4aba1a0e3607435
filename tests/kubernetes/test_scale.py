"""Mass relaunch: 100 worker pods deleted at once are replaced, all Running,
in well under a minute (DLRover's users report ~10 minutes for 30 pods), and
the job never holds more live pods than MAX plus spares while it happens.
The workers only sleep: this measures the control plane, not torch."""
import time
import unittest

from _cluster import Suite
from _jobs import JobHarness, sleep_job

PODS = 100


class MassRelaunchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.k = Suite.get()
        cls.k.install()

    def test_hundred_deleted_pods_are_replaced_and_running_within_a_minute(self):
        ns = self.k.namespace(self)
        j = JobHarness(self, self.k, ns, "mass")
        j.apply(sleep_job("mass", ns, nodes=f"1:{PODS}", maxReplacements=2 * PODS))
        t_start = time.time()
        self.k.wait(lambda: len(j.running()) == PODS, 120, f"{PODS} worker pods Running", interval=0.5)
        print(f"\n{PODS} pods Running {time.time() - t_start:.1f} s after kubectl apply", flush=True)
        self.k.wait(lambda: j.status().get("nodes") == PODS, 120, f"a round with {PODS} nodes", interval=0.5)
        t0 = time.time()
        self.k.kubectl("-n", ns, "delete", "pods", "-l", "ballast.dev/job=mass,ballast.dev/role=worker",
                       "--wait=false")
        most_live = 0

        def replaced():
            nonlocal most_live
            pods = j.pods()
            live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
            most_live = max(most_live, len(live))
            running = [p for p in live if p["status"].get("phase") == "Running"
                       and p["metadata"]["labels"]["ballast.dev/incarnation"] == "2"]
            return len(running) == PODS

        self.k.wait(replaced, 120, f"{PODS} replacement pods Running", interval=0.5)
        elapsed = time.time() - t0
        print(f"{PODS} pods deleted at once: all {PODS} replacements Running after {elapsed:.1f} s; "
              f"at most {most_live} live worker pods meanwhile", flush=True)
        self.assertLess(elapsed, 60, j.debug())
        self.assertLessEqual(most_live, PODS, "never more live pods than MAX + spares")
        # The status follows within moments.
        self.k.wait(lambda: j.status().get("replacements") == PODS, 30, f"status.replacements = {PODS}")


if __name__ == "__main__":
    unittest.main()
