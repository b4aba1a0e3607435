"""Operator HA: two operator replicas elect a leader on the Lease
ballast-system/ballast-operator. Killing the leader mid-job leaves the running job
undisturbed (its master and worker pods are the job's, not the operator's), another
replica takes the Lease within the lease duration, exactly one replica leads from then
on, and a job created afterwards is reconciled by it (one master).

Which replica takes over is not defined (src/kube/lease.h): the standby that was waiting
and the pod the Deployment creates for the force-deleted leader each count the leader's
silence from when they last saw it renew, and the leader's process runs (and renews) until
its kubelet sees the deletion, by when the new pod may already be looking. Either may lead;
never both.
"""
import tempfile
import time
import unittest

from _jobs import JobHarness, JobTestCase, done_ranks, read_events, train_job, wait_steps


OPERATOR_SELECTOR = "app.kubernetes.io/name=ballast-operator"


class OperatorHATest(JobTestCase):
    def operator_log(self, pod):
        """The operator container's log of `pod` (appended across its restarts), "" before it has one."""
        return self.k.pod_log("ballast-system", pod, "operator")

    def live_operators(self):
        return [p["metadata"]["name"] for p in self.k.pods("ballast-system", OPERATOR_SELECTOR)
                if not p["metadata"].get("deletionTimestamp")]

    def test_leader_killed_mid_job_another_replica_takes_over_and_reconciles_new_jobs(self):
        j = JobHarness(self, self.k, self.ns, "haone")
        j.apply(train_job("haone", self.ns, self.out, nodes="2", steps=150, step_time=0.15))
        self.k.wait(lambda: len(j.running()) == 2, 60, "2 worker pods Running")
        wait_steps(self.k, self.out, range(2), 5, 90)
        pods_before = sorted(p["metadata"]["name"] for p in self.k.pods(self.ns))
        leader = self.k.operator_leader()
        operators = self.live_operators()
        self.assertIn(leader, operators)
        standby = [o for o in operators if o != leader]
        self.assertEqual(len(standby), 1, operators)
        # What each replica logs from now on: the one that takes the Lease says "leading as".
        seen = {p: len(self.operator_log(p)) for p in operators}

        def leading_since_kill():
            return {p for p in self.live_operators()
                    if "operator: leading as" in self.operator_log(p)[seen.get(p, 0):]}

        # The leader's pod force-deleted: its process killed once its kubelet sees that, no
        # Lease release (as when its node dies); the Deployment starts another pod, which
        # competes for the Lease with the standby.
        killed_at = time.time()
        self.k.kubectl("-n", "ballast-system", "delete", "pod", leader, "--grace-period=0", "--force")
        new_leader = self.k.wait(lambda: (lambda h: h if h and h != leader else None)(self.k.operator_leader()),
                                 40, "another operator holding the leader Lease")
        took_s = time.time() - killed_at
        self.assertLess(took_s, 25, "within the lease duration (15 s) and a retry")
        self.assertIn(new_leader, self.live_operators(), "a running replica leads")
        # Exactly one replica leads: the Lease holder, and no other one says it leads.
        self.k.wait(lambda: leading_since_kill() == {new_leader}, 10,
                    f"{new_leader} (the Lease holder) logging that it leads, and no other replica")

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
        # The new job had one master: one operator reconciled it.
        self.assertEqual(two.reasons().count("MasterCreated"), 1, two.debug())
        self.assertEqual(two.status().get("masterGeneration"), 1, two.debug())
        # And the leadership held through both jobs: no second takeover, no other replica leading.
        self.assertEqual(self.k.operator_leader(), new_leader)
        self.assertEqual(leading_since_kill(), {new_leader})
        which = "the standby" if new_leader == standby[0] else "the replica the Deployment started for it"
        print(f"\nmeasure: operator {leader} force-deleted; {new_leader} ({which}) leads {took_s:.1f} s later; a job "
              f"created then had its master pod Running {reconciled_s:.1f} s after `kubectl apply`", flush=True)


if __name__ == "__main__":
    unittest.main()
