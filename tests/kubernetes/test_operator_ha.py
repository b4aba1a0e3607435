"""Operator HA: two operator replicas elect a leader on the Lease
ballast-system/ballast-operator. Killing the leader mid-job leaves the running job
undisturbed (its master and worker pods are the job's, not the operator's), the
standby takes the Lease within the lease duration, and a job created afterwards is
reconciled by it.
"""
import tempfile
import time
import unittest

from _jobs import JobHarness, JobTestCase, done_ranks, read_events, train_job, wait_steps


class OperatorHATest(JobTestCase):
    def test_leader_killed_mid_job_the_standby_takes_over_and_reconciles_new_jobs(self):
        j = JobHarness(self, self.k, self.ns, "haone")
        j.apply(train_job("haone", self.ns, self.out, nodes="2", steps=150, step_time=0.15))
        self.k.wait(lambda: len(j.running()) == 2, 60, "2 worker pods Running")
        wait_steps(self.k, self.out, range(2), 5, 90)
        pods_before = sorted(p["metadata"]["name"] for p in self.k.pods(self.ns))
        leader = self.k.operator_leader()
        operators = [p["metadata"]["name"] for p in
                     self.k.pods("ballast-system", "app.kubernetes.io/name=ballast-operator")]
        self.assertIn(leader, operators)
        standby = [o for o in operators if o != leader]
        self.assertEqual(len(standby), 1, operators)

        # The leader's pod force-deleted: its process killed at once, no Lease release
        # (as when its node dies); the Deployment starts another pod, a new standby.
        killed_at = time.time()
        self.k.kubectl("-n", "ballast-system", "delete", "pod", leader, "--grace-period=0", "--force")
        new_leader = self.k.wait(lambda: (lambda h: h if h and h != leader else None)(self.k.operator_leader()),
                                 40, "another operator holding the leader Lease")
        took_s = time.time() - killed_at
        self.assertEqual(new_leader, standby[0])
        self.assertLess(took_s, 25, "within the lease duration (15 s) and a retry")

        # A job created now is reconciled by the new leader.
        created_at = time.time()
        two = JobHarness(self, self.k, self.ns, "hatwo")
        two.apply(train_job("hatwo", self.ns, tempfile.mkdtemp(prefix="ballast-k8s-out-"), nodes="1", steps=10,
                            step_time=0.05))
        self.k.wait(lambda: two.running("master"), 60, "the new job's master pod Running")
        reconciled_s = time.time() - created_at
        two.wait_phase("Succeeded", 180)

        # The job that ran through it: undisturbed.
        st = j.wait_phase("Succeeded", 240)
        self.assertEqual(st["restarts"], 0, j.debug())
        self.assertEqual(st.get("masterRestarts", 0), 0, j.debug())
        self.assertEqual(done_ranks(self.out, 2), [0, 1], j.debug())
        for rank in range(2):
            starts = [e for e in read_events(self.out, rank) if e["event"] == "start"]
            self.assertEqual(len(starts), 1, f"rank {rank} started once")
        self.assertEqual(sorted([p["metadata"]["name"] for p in j.pods()] + ["haone-master-1"]),
                         sorted(n for n in pods_before if n.startswith("haone")), "the same pods")
        print(f"\nmeasure: operator {leader} force-deleted; {new_leader} leads {took_s:.1f} s later; a job created "
              f"then had its master pod Running {reconciled_s:.1f} s after `kubectl apply`", flush=True)


if __name__ == "__main__":
    unittest.main()
