"""Tests of the Slurm test harness itself (slurm_cluster.py): a real slurmctld and
five slurmd in network namespaces; root only. Run from this directory:

    /usr/bin/python3 -m unittest -v test_cluster
"""
import os
import re
import signal
import socket
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import slurm_cluster  # noqa: E402
from slurm_cluster import SlurmCluster  # noqa: E402

PY = "/usr/bin/python3"
HERE = os.path.dirname(os.path.abspath(__file__))
cluster = None


def setUpModule():
    global cluster
    if os.geteuid() != 0:
        # A missing prerequisite is a failure, never a skip.
        raise RuntimeError("the Slurm tests need root (network namespaces, slurmd): run them as root, as CI does")
    cluster = SlurmCluster(nodes=5, cpus_per_node=4).start()


def tearDownModule():
    if cluster is not None:
        cluster.stop()
        left = leftovers(cluster.tag, cluster.workdir)
        if left and os.environ.get("BALLAST_KEEP_SLURM") != "1":
            raise AssertionError(f"the suite's cluster left {left}")


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError as e:
        return f"({e})"


def write_script(path, body):
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body)
    os.chmod(path, 0o755)
    return path


def wait_for(cond, timeout, what):
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def leftovers(tag, workdir):
    """What a stopped cluster left behind: namespaces, processes, mounts, files."""
    left = []
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left += [f"netns {l.split()[0]}" for l in ns.splitlines() if tag in l]
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
            if st[st.rindex(")") + 2] == "Z":
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if workdir in cmd or workdir in env:
            left.append(f"process {d}: {cmd.strip()}")
    with open("/proc/self/mountinfo") as f:
        left += [f"mount {l.split()[4]}" for l in f if workdir in l or tag in l]
    if os.path.exists(workdir):
        left.append(f"dir {workdir}")
    return left


class ClusterTest(unittest.TestCase):
    def setUp(self):
        self.c = cluster
        self.dir = os.path.join(cluster.workdir, self.id().rsplit(".", 1)[-1])
        os.makedirs(self.dir, exist_ok=True)

    def test_a_nodes_idle(self):
        c = self.c
        self.assertEqual(c.node_names, ["n1", "n2", "n3", "n4", "n5"])
        self.assertEqual(c.node_states(), {n: "idle" for n in c.node_names})
        self.assertEqual(len({c.addr(n) for n in c.node_names} | {c.controller_addr}), 6)
        out = c.run(["scontrol", "show", "node", "-o", "n1"]).stdout
        self.assertIn("CPUTot=4", out)
        self.assertIn(f"NodeAddr={c.addr('n1')}", out)
        # every node has a slurmd in its own network namespace
        for n in c.node_names:
            self.assertTrue(any("slurmd" in cmd for _, cmd in c.processes(n)), c.processes(n))

    def test_b_steps_hostnames_and_tcp(self):
        c, d = self.c, self.dir
        port = 23456
        listener = (
            "import socket,sys,os\n"
            f"s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1); s.bind(('0.0.0.0',{port})); s.listen(1)\n"
            f"open('{d}/listening','w').close()\n"
            "s.settimeout(30); a,peer=s.accept(); m=a.recv(100).decode()\n"
            "a.sendall(('hello from '+os.uname().nodename).encode()); a.close()\n"
            f"open('{d}/server.txt','w').write(peer[0]+' '+m)\n")
        client = (
            "import socket,os,time\n"
            f"while not os.path.exists('{d}/listening'): time.sleep(0.05)\n"
            f"s=socket.create_connection(('n1',{port}),timeout=10); s.sendall(os.uname().nodename.encode())\n"
            f"open('{d}/client.txt','w').write(s.recv(100).decode())\n")
        with open(f"{d}/listener.py", "w") as f:
            f.write(listener)
        with open(f"{d}/client.py", "w") as f:
            f.write(client)
        script = write_script(f"{d}/job.sh", f"""set -e
for n in {' '.join(c.node_names)}; do
  srun --overlap -N1 -n1 -w $n hostname > {d}/host-$n.txt
done
srun --overlap -N1 -n1 -w n1 {PY} {d}/listener.py &
srun --overlap -N1 -n1 -w n2 {PY} {d}/client.py
wait
echo "SLURM_CONF=$SLURM_CONF" > {d}/env.txt
""")
        job = c.sbatch(script, ["-N", "5", "--no-kill"])
        self.assertEqual(c.wait_job(job, 60), "COMPLETED",
                         read(f"{c.workdir}/slurm-{job}.out"))
        self.assertEqual(c.job_exit_code(job), "0:0")
        for n in c.node_names:
            with open(f"{d}/host-{n}.txt") as f:
                self.assertEqual(f.read().strip(), n)
        with open(f"{d}/server.txt") as f:
            self.assertEqual(f.read().split(), [c.addr("n2"), "n2"])
        with open(f"{d}/client.txt") as f:
            self.assertEqual(f.read(), "hello from n1")
        with open(f"{d}/env.txt") as f:
            self.assertEqual(f.read().strip(), f"SLURM_CONF={c.env['SLURM_CONF']}")

    def test_c_kill_node_under_a_job(self):
        c, d = self.c, self.dir
        script = write_script(f"{d}/job.sh", f"""
srun --overlap -N1 -n1 -w n3 sleep 1000 &
while [ ! -e {d}/go ]; do sleep 0.1; done
srun --overlap -N1 -n1 -w n4 hostname > {d}/after.txt
""")
        job = c.sbatch(script, ["-N", "5", "--no-kill"])
        wait_for(lambda: any(s[2] == "n3" and s[1] == "sleep" for s in c.steps(job))
                 and any("sleep 1000" in cmd for _, cmd in c.processes("n3")), 30, "the step on n3")
        self.assertEqual(c.job_state(job), "RUNNING")
        t0 = time.time()
        c.kill_node("n3")
        self.assertEqual(c.processes("n3"), [])
        state = c.wait_node_state("n3", lambda s: s.endswith("*") or s.startswith("down"), 15)
        print(f"\n  n3 {state} {time.time() - t0:.1f} s after kill_node", file=sys.stderr)
        open(f"{d}/go", "w").close()
        self.assertEqual(c.wait_job(job, 30), "COMPLETED", read(f"{c.workdir}/slurm-{job}.out"))
        with open(f"{d}/after.txt") as f:
            self.assertEqual(f.read().strip(), "n4")
        # Bring n3 back for whatever runs next.
        c.wait_node_state("n3", lambda s: s.startswith("down") or s == "idle*", 20)
        c.start_node("n3")
        c.wait_node_state("n3", lambda s: s == "idle", 10)


class TeardownTest(unittest.TestCase):
    """Clusters of their own: stop() leaves nothing, whichever way the owner ends."""

    def test_d_stop_leaves_nothing(self):
        c = SlurmCluster(nodes=2)
        tag, workdir = c.tag, c.workdir
        with self.assertRaises(ZeroDivisionError):
            with c:
                # a job with a task on n2, still running when the "test" fails
                script = write_script(f"{workdir}/job.sh", "srun --overlap -N1 -n1 -w n2 sleep 1000\n")
                job = c.sbatch(script, ["-N", "2"])
                wait_for(lambda: any("sleep 1000" in cmd for _, cmd in c.processes("n2")), 30, "the task")
                self.assertTrue(leftovers(tag, workdir))
                1 / 0
        self.assertEqual(leftovers(tag, workdir), [])
        self.assertLess(c.stop_seconds, 5)
        c.stop()  # idempotent

    def _cli(self):
        p = subprocess.Popen([PY, os.path.join(HERE, "slurm_cluster.py"), "up", "--nodes", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        workdir = None
        for line in p.stdout:
            m = re.match(r"# Slurm cluster up, workdir (\S+)", line)
            if m:
                workdir = m.group(1)
            if "Ctrl-C" in line:
                break
        self.addCleanup(p.stdout.close)
        self.addCleanup(lambda: p.poll() is None and p.kill())
        self.assertIsNotNone(workdir, "the CLI did not come up")
        tag = workdir.rsplit("-", 1)[1]
        self.assertTrue(leftovers(tag, workdir))
        return p, tag, workdir

    def test_e_cli_sigterm(self):
        p, tag, workdir = self._cli()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        self.assertEqual(leftovers(tag, workdir), [])

    def test_f_cli_sigint(self):
        p, tag, workdir = self._cli()
        p.send_signal(signal.SIGINT)
        self.assertEqual(p.wait(timeout=30), 0)
        self.assertEqual(leftovers(tag, workdir), [])

    def test_g_sigkilled_owner_then_cleanup_stale(self):
        p, tag, workdir = self._cli()
        p.kill()
        p.wait(timeout=30)
        # the daemons die with their owner (PR_SET_PDEATHSIG); the rest is cleaned up
        # by the next start() or explicitly:
        self.assertIn(workdir, slurm_cluster.cleanup_stale())
        self.assertEqual(leftovers(tag, workdir), [])


if __name__ == "__main__":
    unittest.main()
