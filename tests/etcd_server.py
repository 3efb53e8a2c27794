"""etcd servers (Debian's ``etcd-server`` package) for the tests: one member, or a small
cluster on loopback.

Every member is our own child process on free loopback ports with its own data dir (a
temp dir), short raft timings (heartbeat 50 ms, election 500 ms: a new leader within a
second or two, and the server's minimum lease TTL is then 1 s), and optionally TLS
(server certificate, client certificates required) -- see :func:`make_certs`.
:meth:`EtcdCluster.kill` / :meth:`EtcdCluster.restart` / :meth:`EtcdCluster.leader_index`
drive failover tests; :meth:`EtcdServer.etcdctl` runs ``etcdctl`` against it (to set up
users and roles).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Self

from ._proc import ServerGroup, poll, serve_forever
from .servers import ServerProcess, free_port

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
ETCDCTL = shutil.which("etcdctl") or "/usr/bin/etcdctl"


def etcd_installed() -> bool:
    return os.access(ETCD, os.X_OK) and os.access(ETCDCTL, os.X_OK)


def make_certs(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, made
    with ``openssl``; returns the paths (``ca``, ``server_cert``, ``server_key``,
    ``client_cert``, ``client_key``)."""
    directory.mkdir(parents=True, exist_ok=True)
    p = {k: directory / f"{k}.pem" for k in (
        "ca", "ca_key", "server_cert", "server_key", "client_cert", "client_key")}

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=aiolock-test-ca",
        "-keyout", str(p["ca_key"]), "-out", str(p["ca"]))
    ext = directory / "server.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    cext = directory / "client.ext"
    cext.write_text("extendedKeyUsage=clientAuth\n")
    for who, cn, extfile in (("server", "localhost", ext), ("client", "aiolock-client", cext)):
        csr = directory / f"{who}.csr"
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}",
            "-keyout", str(p[f"{who}_key"]), "-out", str(csr))
        run("x509", "-req", "-in", str(csr), "-CA", str(p["ca"]), "-CAkey", str(p["ca_key"]),
            "-CAcreateserial", "-days", "2", "-extfile", str(extfile), "-out", str(p[f"{who}_cert"]))
    return p


class EtcdServer(ServerProcess):
    """One etcd member, our own child process on free loopback ports."""

    def __init__(
        self, *, name: str = "m0", port: int | None = None, peer_port: int | None = None,
        initial_cluster: str | None = None, certs: dict[str, Path] | None = None,
        data_root: Path | None = None, cluster_token: str | None = None,
    ) -> None:
        if not etcd_installed():
            raise RuntimeError("etcd is not installed (apt-get install etcd-server etcd-client)")
        super().__init__(port=port, prefix="aiolock-etcd-")
        if data_root is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = data_root / name
            self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.peer_port = peer_port or free_port()
        self.initial_cluster = initial_cluster or f"{name}=http://127.0.0.1:{self.peer_port}"
        self.certs = certs
        # the data on tmpfs where there is one: etcd fsyncs every proposal (3.4 has no
        # --unsafe-no-fsync), which on a busy disk can take tens of milliseconds
        shm = Path("/dev/shm")
        self.data_dir = (Path(tempfile.mkdtemp(prefix="aiolock-etcd-data-", dir=shm))
                         if shm.is_dir() and os.access(shm, os.W_OK) else self.dir / "data")
        self.cluster_token = cluster_token or f"aiolock-{os.getpid()}-{self.peer_port}"
        self.started_once = False

    @property
    def scheme(self) -> str:
        return "https" if self.certs else "http"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"etcd://{self.endpoint}"

    def command(self) -> list[str]:
        client = f"{self.scheme}://127.0.0.1:{self.port}"
        cmd = [
            ETCD, "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
            "--initial-cluster", self.initial_cluster,
            "--initial-cluster-state", "existing" if self.started_once else "new",
            "--initial-cluster-token", self.cluster_token,
            "--heartbeat-interval", "50", "--election-timeout", "500",
            "--logger", "zap", "--log-level", "warn", "--log-outputs", "stderr",
            "--enable-pprof=false", "--quota-backend-bytes", str(256 * 1024 * 1024),
        ]
        if self.certs:
            cmd += ["--cert-file", str(self.certs["server_cert"]),
                    "--key-file", str(self.certs["server_key"]),
                    "--trusted-ca-file", str(self.certs["ca"]), "--client-cert-auth"]
        return cmd

    def popen_options(self) -> dict[str, Any]:
        log = open(self.dir / "etcd.log", "ab")  # noqa: SIM115 -- closed by start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        return {"stdout": log, "stderr": subprocess.STDOUT, "env": env}

    def start(self) -> Self:
        super().start()
        self.started_once = True
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until the member serves (alone), or only until its port is open (in a
        cluster, which waits for its quorum)."""
        proc = self.proc
        assert proc is not None

        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {proc.returncode}; see {self.dir / 'etcd.log'}")
            return self.healthy(timeout=1.0)

        poll(up, timeout=timeout, what=f"etcd did not come up on {self.endpoint}", interval=0.05)

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def healthy(self, timeout: float = 1.0) -> bool:
        try:
            out = self.etcdctl("endpoint", "health", timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return False
        return "is healthy" in out

    def etcdctl(self, *args: str, user: str | None = None, timeout: float = 10.0,
                check: bool = True, endpoints: str | None = None) -> str:
        """Run ``etcdctl`` (API v3) against this member; its combined output."""
        cmd = [ETCDCTL, f"--endpoints={endpoints or f'{self.scheme}://{self.endpoint}'}",
               f"--command-timeout={timeout}s", f"--dial-timeout={min(timeout, 2.0)}s"]
        if self.certs:
            cmd += [f"--cacert={self.certs['ca']}", f"--cert={self.certs['client_cert']}",
                    f"--key={self.certs['client_key']}"]
        if user:
            cmd.append(f"--user={user}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        env["ETCDCTL_API"] = "3"
        res = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout + 2, env=env)
        if check and res.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed: {res.stdout}{res.stderr}")
        return res.stdout + res.stderr


class _Member(EtcdServer):
    def wait_ready(self, timeout: float = 30.0) -> None:
        assert self.proc is not None
        time.sleep(0.05)
        if self.proc.poll() is not None:
            raise RuntimeError(f"etcd member {self.name} exited with {self.proc.returncode}; "
                               f"see {self.dir / 'etcd.log'}")


class EtcdCluster(ServerGroup[EtcdServer]):
    """``size`` etcd members on loopback (``EtcdCluster(3).start()`` returns once every
    member is healthy). :meth:`kill` (``kill -9``) and :meth:`restart` (same ports and
    data) drive failover tests."""

    def __init__(self, size: int = 3) -> None:
        self.size = size
        self.dir = Path(tempfile.mkdtemp(prefix="aiolock-etcd-cluster-"))
        ports: set[int] = set()
        while len(ports) < 2 * size:
            ports.add(free_port())
        plist = sorted(ports)
        self.client_ports, self.peer_ports = plist[:size], plist[size:]
        initial = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(self.peer_ports))
        self.members = [
            _Member(name=f"m{i}", port=self.client_ports[i], peer_port=self.peer_ports[i],
                    initial_cluster=initial, data_root=self.dir,
                    cluster_token=f"aiolock-{os.getpid()}-{self.peer_ports[0]}")
            for i in range(size)
        ]

    @property
    def hosts(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    @property
    def url(self) -> str:
        return f"etcd://{self.hosts}"

    def start(self, timeout: float = 30.0) -> Self:
        try:
            for member in self.members:
                member.start()
            self.wait_healthy(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def wait_healthy(self, timeout: float = 30.0) -> None:
        poll(lambda: all(self.members[i].healthy() for i in range(self.size) if self.running(i)),
             timeout=timeout, what=f"etcd cluster not healthy (see {self.dir})")

    def leader_index(self, timeout: float = 10.0) -> int:
        """The index of the member that leads now (``etcdctl endpoint status``)."""
        return poll(self._leader, timeout=timeout, what="no etcd leader")

    def _leader(self) -> int | None:
        for i, member in enumerate(self.members):
            if not self.running(i):
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                out = member.etcdctl("endpoint", "status", "-w", "fields", timeout=1.0, check=False)
                fields = dict(line.rstrip(",").split(" : ", 1) for line in out.splitlines() if " : " in line)
                if fields.get('"MemberID"') and fields.get('"MemberID"') == fields.get('"Leader"'):
                    return i
        return None

    def restart(self, i: int) -> None:
        member = self.members[i]
        if self.running(i):
            member.kill()
        member.start()

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.dir, ignore_errors=True)


if __name__ == "__main__":  # manual use: python -m tests.etcd_server
    serve_forever(EtcdServer())
