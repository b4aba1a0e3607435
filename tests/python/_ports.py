"""Free TCP ports for tests (no torch: the Kubernetes tests import it too)."""
import random
import socket


def free_port():
    """A TCP port free now (for MASTER_PORT and the like), below the kernel's
    ephemeral range: a port the kernel hands out for a bind to port 0 comes
    from that range, the one every outgoing connection of the tests running
    beside this one takes its local port from, so one of them could take it
    before the process it is meant for binds it (seen: a precheck's TCPStore
    got EADDRINUSE). Random, so that two tests rarely try the same one."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(1000):
        port = random.randint(10000, max(10001, low - 1))
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in 10000..{low - 1}")
