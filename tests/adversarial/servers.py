"""Special servers for the adversarial tests: Redis with ``requirepass``, with ACL users,
with TLS (a private CA made here, client certificates required), and helpers.

Every server is our own child process on a free loopback port (see ``tests/servers.py``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from ..servers import RedisServer, free_port, wait_port


class PasswordRedis(RedisServer):
    """redis-server with ``requirepass``, ACL users given as ACL rule lines, extra args."""

    def __init__(self, *, password: str | None = None, users: list[str] | None = None,
                 extra: list[str] | None = None) -> None:
        super().__init__()
        self.password = password
        self.users = users or []
        self.extra = extra or []

    def command(self) -> list[str]:
        cmd = super().command()
        if self.password is not None:
            cmd += ["--requirepass", self.password]
        if self.users:
            acl = self.dir / "users.acl"
            acl.write_text("".join(f"user {u}\n" for u in self.users))
            cmd += ["--aclfile", str(acl)]
        return cmd + self.extra


def make_ca(directory: Path) -> dict[str, Path]:
    """A private CA, a server cert for 127.0.0.1/localhost and a client cert (openssl)."""
    d = directory
    files = {k: d / f"{k}.pem" for k in ("ca", "ca_key", "server", "server_key", "client",
                                          "client_key")}

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-keyout", str(files["ca_key"]), "-out", str(files["ca"]), "-subj", "/CN=aiolock-test-ca")
    ext = d / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who in ("server", "client"):
        csr = d / f"{who}.csr"
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(files[f"{who}_key"]),
            "-out", str(csr), "-subj", f"/CN={who}")
        run("x509", "-req", "-in", str(csr), "-CA", str(files["ca"]), "-CAkey",
            str(files["ca_key"]), "-CAcreateserial", "-days", "2", "-out", str(files[who]),
            "-extfile", str(ext))
    return files


class TLSRedis(RedisServer):
    """redis-server speaking only TLS, with ``tls-auth-clients yes`` (client certs)."""

    def __init__(self) -> None:
        super().__init__()
        self.tls_port = free_port()
        self.files = make_ca(self.dir)

    def command(self) -> list[str]:
        cmd = super().command()
        i = cmd.index("--port")
        cmd[i + 1] = "0"
        return [
            *cmd, "--tls-port", str(self.tls_port),
            "--tls-cert-file", str(self.files["server"]),
            "--tls-key-file", str(self.files["server_key"]),
            "--tls-ca-cert-file", str(self.files["ca"]),
            "--tls-auth-clients", "yes",
        ]

    def wait_ready(self) -> None:
        wait_port(self.tls_port)

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}/0"
