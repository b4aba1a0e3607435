"""TLS on the control plane, end to end with real processes and openssl-made
certificates: a CA, the master's certificate (for 127.0.0.1) and an agent's.

  - `ballast master --tls-cert --tls-key --tls-ca` (mutual TLS) with two
    `ballast run --tls-ca --tls-cert --tls-key` agents: real DDP finishes;
    `ballast status` over TLS sees the job;
  - an agent without TLS, one without a client certificate and one trusting
    another CA are refused with an error that names TLS; the token is still
    required over TLS;
  - `ballast launch --tls-cert --tls-key` (a self-signed certificate) runs a
    job end to end, also with `--journal` (its master in a child process);
  - bad flags (a certificate without its key, a missing file) are usage
    errors that say what to pass;
  - a TLS handshake that takes seconds (a loaded machine; here a proxy that
    holds the master's first bytes) is waited for: the agent hears the
    master's answer (its wrong token), not "cannot reach".
"""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import unittest

from _util import free_port, wait_for

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("BALLAST_BIN", os.path.join(ROOT, "build", "bin", "ballast"))
PYTHON = os.environ.get("BALLAST_PYTHON", "/usr/bin/python3")
TRAIN = os.path.join(ROOT, "examples", "train_ddp.py")
TOKEN = "tls-test-token"


def openssl(*args, cwd):
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)}: {r.stderr}")


def make_ca(d, name):
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem",
            "-days", "2", "-subj", f"/CN={name}", cwd=d)


def make_cert(d, name, ca, san):
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}", cwd=d)
    with open(os.path.join(d, f"{name}.ext"), "w") as f:
        f.write(f"subjectAltName={san}\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


class SlowProxy:
    """A TCP proxy to 127.0.0.1:port that holds what the server sends on a
    connection until `delay` s after the connection was accepted (the client's
    bytes pass at once): every TLS handshake through it takes `delay` s."""

    def __init__(self, port, delay):
        self.port, self.delay = port, delay
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            upstream = socket.create_connection(("127.0.0.1", self.port))
            start = time.monotonic()
            threading.Thread(target=self.pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self.pipe, args=(upstream, client, start + self.delay), daemon=True).start()

    @staticmethod
    def pipe(src, dst, hold_until):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if hold_until is not None:
                    time.sleep(max(0.0, hold_until - time.monotonic()))
                    hold_until = None
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.sock.close()


class TlsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.certs = tempfile.mkdtemp(prefix="ballast-tls-certs-")
        make_ca(cls.certs, "ca")
        make_ca(cls.certs, "other-ca")
        make_cert(cls.certs, "master", "ca", "IP:127.0.0.1,DNS:localhost")
        make_cert(cls.certs, "agent", "ca", "DNS:agent")
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "self.key", "-out", "self.pem",
                "-days", "2", "-subj", "/CN=self", "-addext", "subjectAltName=IP:127.0.0.1", cwd=cls.certs)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.certs, ignore_errors=True)

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ballast-tls-")
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def c(self, name):
        return os.path.join(self.certs, name)

    def env(self, **extra):
        env = {k: v for k, v in os.environ.items() if not k.startswith("BALLAST_TLS_")}
        return {**env, "BALLAST_TOKEN": TOKEN, "BALLAST_CONNECT_TIMEOUT_S": "4", **extra}

    def spawn(self, argv, log, env=None):
        f = open(os.path.join(self.tmp, log), "w")
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.tmp,
                             env=env or self.env())
        f.close()
        self.procs.append(p)
        return p

    def log(self, name):
        with open(os.path.join(self.tmp, name), errors="replace") as f:
            return f.read()

    def agent(self, port, rank, tls, log, nnodes=2, env=None):
        return self.spawn([BIN, "run", "--rdzv-endpoint", f"127.0.0.1:{port}", "--nnodes", str(nnodes),
                           "--nproc-per-node", "1", "--node-rank", str(rank), "--local-addr", "127.0.0.1",
                           "--python", PYTHON, *tls, TRAIN, "--steps", "5", "--step-time", "0.05",
                           "--out", os.path.join(self.tmp, "out")], log, env)

    def test_mutual_tls_job_status_and_refusals(self):
        port = free_port()
        master = self.spawn([BIN, "master", "--nnodes", "2", "--host", "127.0.0.1", "--advertise-host", "127.0.0.1",
                             "--port", str(port), "--http-port", "-1", "--tls-cert", self.c("master.pem"),
                             "--tls-key", self.c("master.key"), "--tls-ca", self.c("ca.pem")], "master.log")
        client = ["--tls-ca", self.c("ca.pem"), "--tls-cert", self.c("agent.pem"), "--tls-key", self.c("agent.key")]

        # Refused: no TLS; TLS without a client certificate (mutual TLS); a
        # master certificate from a CA it does not trust; the wrong token.
        for name, tls, env in (("plain", [], None), ("no-client-cert", ["--tls-ca", self.c("ca.pem")], None),
                               ("other-ca", ["--tls-ca", self.c("other-ca.pem"), "--tls-cert", self.c("agent.pem"),
                                             "--tls-key", self.c("agent.key")], None),
                               ("bad-token", client, self.env(BALLAST_TOKEN="wrong"))):
            p = self.agent(port, 0, tls, f"{name}.log", env=env)
            self.assertEqual(p.wait(timeout=60), 1, self.log(f"{name}.log"))
            out = self.log(f"{name}.log")
            # What to pass, for each side that lacks something.
            self.assertIn({"plain": "a master that serves TLS does that to an agent without TLS; pass --tls-ca",
                           "no-client-cert": "a master with mutual TLS does that to an agent without a client "
                                             "certificate (the TLS handshake itself went through); pass --tls-cert",
                           "other-ca": "a TLS handshake failed",
                           "bad-token": "refused this agent's token"}[name], out)

        agents = [self.agent(port, r, client, f"agent{r}.log") for r in (0, 1)]
        status = subprocess.run([BIN, "status", "--master", f"127.0.0.1:{port}", "--json", *client],
                                capture_output=True, text=True, env=self.env(), timeout=30)
        self.assertEqual(status.returncode, 0, status.stderr)
        self.assertIn('"job_id"', status.stdout)
        for r, a in enumerate(agents):
            self.assertEqual(a.wait(timeout=120), 0, self.log(f"agent{r}.log")[-3000:])
        self.assertEqual(master.wait(timeout=30), 0, self.log("master.log")[-3000:])
        self.assertIn("succeeded", self.log("master.log"))
        # The refused ones never joined.
        self.assertNotIn("join refused", self.log("master.log"))

    def test_a_slow_handshake_still_hears_the_masters_answer(self):
        # 3 s per handshake: more than gRPC's reconnect backoff (<= 2.4 s with
        # jitter), which the connection attempts' own deadline once followed,
        # so every attempt was cut off before the master's answer.
        port = free_port()
        self.spawn([BIN, "master", "--nnodes", "2", "--host", "127.0.0.1", "--advertise-host", "127.0.0.1",
                    "--port", str(port), "--http-port", "-1", "--tls-cert", self.c("master.pem"),
                    "--tls-key", self.c("master.key"), "--tls-ca", self.c("ca.pem")], "master.log")
        def listening():
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0
        wait_for("the master to listen", listening, 30)
        proxy = SlowProxy(port, delay=3.0)
        self.addCleanup(proxy.close)
        client = ["--tls-ca", self.c("ca.pem"), "--tls-cert", self.c("agent.pem"), "--tls-key", self.c("agent.key")]
        p = self.spawn([BIN, "run", "--rdzv-endpoint", proxy.address, "--nnodes", "2", "--nproc-per-node", "1",
                        "--local-addr", "127.0.0.1", "--python", PYTHON, *client, TRAIN], "slow.log",
                       self.env(BALLAST_TOKEN="wrong", BALLAST_CONNECT_TIMEOUT_S="8"))
        self.assertEqual(p.wait(timeout=60), 1, self.log("slow.log"))
        out = self.log("slow.log")
        self.assertIn("refused this agent's token", out)
        self.assertNotIn("not reachable yet", out)  # the first handshake was waited for
        self.assertEqual(proxy.accepted, 1)

    def test_launch_with_a_self_signed_certificate(self):
        job = self.spawn([BIN, "launch", "--nodes", "2", "--nproc-per-node", "1", "--python", PYTHON,
                          "--http-port", "-1", "--tls-cert", self.c("self.pem"), "--tls-key", self.c("self.key"),
                          TRAIN, "--steps", "5", "--step-time", "0.05", "--out", os.path.join(self.tmp, "out")],
                         "launch.log")
        self.assertEqual(job.wait(timeout=120), 0, self.log("launch.log")[-3000:])
        # With --journal the master is a child process the launcher reads
        # over TLS too.
        job = self.spawn([BIN, "launch", "--nodes", "2", "--nproc-per-node", "1", "--python", PYTHON,
                          "--http-port", "-1", "--tls-cert", self.c("self.pem"), "--tls-key", self.c("self.key"),
                          "--journal", os.path.join(self.tmp, "journal"),
                          TRAIN, "--steps", "5", "--step-time", "0.05", "--out", os.path.join(self.tmp, "out2")],
                         "launch-journal.log")
        self.assertEqual(job.wait(timeout=120), 0, self.log("launch-journal.log")[-3000:])
        self.assertIn("master process pid", self.log("launch-journal.log"))

    def test_bad_tls_flags_say_what_to_pass(self):
        cases = (([BIN, "master", "--nnodes", "1", "--tls-cert", self.c("master.pem")], "--tls-cert needs --tls-key"),
                 ([BIN, "master", "--nnodes", "1", "--tls-ca", self.c("ca.pem")], "needs its own --tls-cert"),
                 ([BIN, "master", "--nnodes", "1", "--tls-cert", "/nonexistent.pem", "--tls-key", self.c("master.key")],
                  "/nonexistent.pem: cannot read"),
                 ([BIN, "status", "--master", "127.0.0.1:1", "--tls-cert", self.c("agent.pem"), "--tls-key",
                   self.c("agent.key")], "needs --tls-ca"),
                 ([BIN, "run", "--rdzv-endpoint", "127.0.0.1:1", "--nnodes", "1", "--tls-key", self.c("agent.key"),
                   TRAIN], "--tls-key needs --tls-cert"))
        for argv, want in cases:
            r = subprocess.run(argv, capture_output=True, text=True, env=self.env(), timeout=30)
            self.assertEqual(r.returncode, 2, (argv, r.stdout, r.stderr))
            self.assertIn(want, r.stderr, argv)


if __name__ == "__main__":
    unittest.main()
