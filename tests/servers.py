"""Real servers for the tests, started on free loopback ports in a temp directory.

Nothing here talks to a server someone started by hand: every server is our own child
process, killed at the end of the session.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class ServerProcess:
    """A server run as our own child process on a free loopback port, with a temp dir.

    Subclasses give :meth:`command` (and may change :meth:`popen_options`,
    :meth:`wait_ready`, :meth:`after_stop`); this class starts, stops, kills -9,
    restarts, pauses (SIGSTOP) and resumes it.
    """

    #: the signal that :meth:`restart` and :meth:`close` stop the server with
    restart_signal = signal.SIGKILL
    close_signal = signal.SIGKILL
    #: seconds to wait for the server to exit after a signal before SIGKILL
    stop_wait = 10.0

    def __init__(self, *, port: int | None = None, prefix: str = "aiolock-server-") -> None:
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def popen_options(self) -> dict[str, Any]:
        """Popen keyword arguments; a log file opened here is closed once started."""
        return {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}

    def wait_ready(self) -> None:
        wait_port(self.port)

    def after_stop(self, sig: int) -> None:
        """Clean-up after the process ended (close logs, reap children)."""

    def start(self) -> Self:
        options = self.popen_options()
        try:
            self.proc = subprocess.Popen(self.command(), **options)
        finally:
            for stream in (options.get("stdout"), options.get("stderr")):
                if hasattr(stream, "close"):
                    stream.close()  # a log file we opened: the child has its own copy
        try:
            self.wait_ready()
        except BaseException:
            self.stop(signal.SIGKILL)
            raise
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(self.stop_wait)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self.after_stop(sig)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self, *, down_for: float = 0.0) -> None:
        self.stop(self.restart_signal)
        time.sleep(down_for)
        self.start()

    def pause(self) -> None:
        """SIGSTOP, and wait until every thread of the server is stopped: the signal is
        delivered asynchronously, and on a loaded machine a worker thread answered a
        request sent just after the kill (a memcached test saw its acquire granted)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not _stopped(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.001)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.stop(self.close_signal)
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisServer(ServerProcess):
    """A redis-server child process on a free loopback port."""

    def __init__(
        self, *, appendonly: bool = False, port: int | None = None, args: Sequence[str] = (),
    ) -> None:
        """``args``: more redis-server options (``--requirepass``, ``--aclfile``...)."""
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        super().__init__(port=port, prefix="aiolock-redis-")
        self.exe = exe
        self.appendonly = appendonly
        self.args = list(args)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return [
            self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
            "--save", "", "--appendonly", "yes" if self.appendonly else "no",
            "--logfile", str(self.dir / "redis.log"), "--daemonize", "no", *self.args,
        ]


def make_tls_files(directory: Path) -> dict[str, str]:
    """A private CA, a server certificate for 127.0.0.1 / localhost and a client
    certificate, made with the ``openssl`` CLI; a second, unrelated CA (``other_ca``).
    Returns the paths by name: ca, ca_key, server_cert, server_key, client_cert,
    client_key, client_key_encrypted (password ``key-pw``), other_ca."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl CLI is not installed")
    d = directory

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True)

    files = {name: str(d / name) for name in (
        "ca.pem", "ca.key", "server.pem", "server.key", "client.pem", "client.key",
        "other_ca.pem", "other_ca.key", "san.cnf")}
    for ca in ("ca", "other_ca"):
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", f"/CN=aiolock test {ca}", "-keyout", files[f"{ca}.key"],
            "-out", files[f"{ca}.pem"])
    Path(files["san.cnf"]).write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who, cn in (("server", "localhost"), ("client", "aiolock client")):
        csr = str(d / f"{who}.csr")
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}",
            "-keyout", files[f"{who}.key"], "-out", csr)
        run("x509", "-req", "-in", csr, "-CA", files["ca.pem"], "-CAkey", files["ca.key"],
            "-CAcreateserial", "-days", "2", "-out", files[f"{who}.pem"],
            *(("-extfile", files["san.cnf"]) if who == "server" else ()))
    enc = str(d / "client_enc.key")  # the client key encrypted, password "key-pw"
    run("pkey", "-in", files["client.key"], "-aes256", "-passout", "pass:key-pw", "-out", enc)
    return {"ca": files["ca.pem"], "ca_key": files["ca.key"], "server_cert": files["server.pem"],
            "client_key_encrypted": enc,
            "server_key": files["server.key"], "client_cert": files["client.pem"],
            "client_key": files["client.key"], "other_ca": files["other_ca.pem"]}


class TlsRedisServer(RedisServer):
    """redis-server speaking only TLS (``--port 0 --tls-port``), requiring client
    certificates signed by a private CA it makes (:attr:`tls`: the file paths)."""

    def __init__(self, *, args: Sequence[str] = (), tls: dict[str, str] | None = None) -> None:
        """``tls``: the files of another TlsRedisServer, to share its CA and certificates."""
        super().__init__(args=args)
        self.tls = tls or make_tls_files(self.dir)

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[cmd.index("--port") + 1] = "0"
        return [*cmd, "--tls-port", str(self.port), "--tls-cert-file", self.tls["server_cert"],
                "--tls-key-file", self.tls["server_key"], "--tls-ca-cert-file", self.tls["ca"],
                "--tls-auth-clients", "yes"]


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` is in the stopped state (Linux /proc; True elsewhere)."""
    tasks = f"/proc/{pid}/task"
    if not os.path.isdir(tasks):
        return True
    try:
        for tid in os.listdir(tasks):
            with open(f"{tasks}/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
            if state not in ("T", "t"):
                return False
    except (OSError, IndexError):
        return True  # gone meanwhile
    return True

