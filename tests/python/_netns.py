"""Hosts in network namespaces, for tests of what crosses a network.

`Lan(n)` creates n "hosts" on one private LAN, all inside namespaces this test
creates (nothing in the machine's own network namespace changes): a switch
namespace holding a bridge, and per host a namespace with a veth link to it,
its own IP (10.66.0.<i+1>/24) and, for the processes it runs, its own host
name (a UTS namespace per process: `unshare --uts`). There is no DNS: host
names resolve nowhere but (maybe) on their own host, as on a cluster without
a name service. Needs root (CI runs as root).

    with Lan(3) as lan:
        p = lan.popen(1, ["ballast", "run", ...])
        lan.addr(0)   # "10.66.0.1"

Every process started with popen() is killed (its whole process group) and
the namespaces deleted on exit.
"""
import os
import secrets
import signal
import subprocess
import time


def _ip(*args):
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {p.stderr.strip()} "
                           "(network namespace tests need root and iproute2)")


class Lan:
    def __init__(self, hosts, hostname_prefix="host"):
        self.n = hosts
        self.tag = secrets.token_hex(3)
        self.switch = f"bsw-{self.tag}"
        self.ns = [f"bh{i}-{self.tag}" for i in range(hosts)]
        self.hostnames = [f"{hostname_prefix}{i}" for i in range(hosts)]
        self.procs = []

    def addr(self, i):
        return f"10.66.0.{i + 1}"

    def __enter__(self):
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, ns in enumerate(self.ns):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                # veth pair: eth0 in the host, p<i> on the switch's bridge.
                _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", self.switch)
                _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
                _ip("-n", self.switch, "link", "set", f"p{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def command(self, i, argv):
        """argv run on host i: its network namespace and its own host name."""
        return ["ip", "netns", "exec", self.ns[i], "unshare", "--uts", "sh", "-c",
                f'hostname {self.hostnames[i]} && exec "$@"', "sh", *argv]

    def popen(self, i, argv, **kw):
        p = subprocess.Popen(self.command(i, argv), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def link(self, i, up):
        """Takes host i's link down (a partition) or up again."""
        _ip("-n", self.ns[i], "link", "set", "eth0", "up" if up else "down")

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        # Anything else still inside a namespace (a grandchild that left the
        # group): `ip netns pids` lists it.
        for ns in self.ns:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        deadline = time.time() + 10
        for ns in self.ns + [self.switch]:
            while True:
                p = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
                if p.returncode == 0 or "No such file" in p.stderr or time.time() > deadline:
                    break
                time.sleep(0.1)
        return False
