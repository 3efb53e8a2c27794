"""Options of the ZooKeeper backend: the URL, digest credentials and the ACL of the nodes
aiolock creates (what they mean for users: docs/backends/zookeeper.md)."""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from aiozk import protocol as zkproto
from aiozk.protocol.acl import ACL as _ZKACL

from ..._validate import query_pairs

#: ``acl=`` choices: ``creator`` (only our digest identity may change or delete the nodes
#: we create, anyone may read them; the default with credentials) or ``open``
#: (``world:anyone:cdrwa``; the default without credentials).
ACL_CHOICES = ("creator", "open")
URL_FORM = "zookeeper://[user:password@]host:port,host:port/chroot[?acl=creator|open]"


@dataclass(slots=True, frozen=True)
class Digest:
    """Digest credentials; the password never shows in a repr, a message or a log line."""

    user: str
    password: str = field(repr=False)

    @property
    def ident(self) -> str:
        """This identity in an ACL: ``user:base64(sha1(user:password))``."""
        raw = hashlib.sha1(f"{self.user}:{self.password}".encode()).digest()
        return f"{self.user}:{base64.b64encode(raw).decode()}"

    def request(self) -> Any:
        """The ``addAuth`` packet for a connection."""
        return _AuthRequest(type=0, scheme="digest", auth=f"{self.user}:{self.password}".encode())


class _AuthRequest(zkproto.AuthRequest):  # type: ignore[misc]
    """``addAuth``, shown without its secret (aiozk logs every packet at debug level)."""

    def __str__(self) -> str:
        return f"AuthRequest(scheme={self.scheme}, auth=<hidden>)"

    __repr__ = __str__


def credentials(username: object, password: object) -> Digest | None:
    """Both or neither; a digest user name cannot contain ':'."""
    if username is None and password is None:
        return None
    if not isinstance(username, str) or not isinstance(password, str) or not username or not password:
        raise ValueError("ZooKeeper digest auth needs both a user and a password (non-empty strings): "
                         "zookeeper://user:password@host:port/chroot, or username= and password=")
    if ":" in username:
        raise ValueError("a ZooKeeper digest user name cannot contain ':'")
    return Digest(username, password)


def node_acl(acl: object, digest: Digest | None) -> list[Any]:
    """The ACL of every node we create, from the ``acl=`` choice (see :data:`ACL_CHOICES`)."""
    if acl is None:
        acl = "creator" if digest is not None else "open"
    if acl not in ACL_CHOICES:
        raise ValueError(f"acl must be one of {', '.join(map(repr, ACL_CHOICES))}, got {acl!r}")
    if acl == "open":
        return [zkproto.UNRESTRICTED_ACCESS]
    if digest is None:
        raise ValueError("acl='creator' needs credentials: zookeeper://user:password@host:port/chroot")
    owner = _ZKACL.make("digest", digest.ident, read=True, write=True, create=True, delete=True,
                        admin=True)
    return [owner, zkproto.WORLD_READABLE]



def redacted(url: str) -> str:
    """``url`` fit for a message: user kept, password and query left out."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    netloc = f"{userinfo.partition(':')[0]}@{hosts}" if at else hosts
    return f"{parts.scheme}://{netloc}{parts.path}"



def check_chroot(chroot: str) -> str:
    if not isinstance(chroot, str) or not chroot.startswith("/"):
        raise ValueError(f"the chroot must be an absolute path such as '/aiolock', got {chroot!r}")
    parts = chroot.split("/")[1:]
    if chroot != "/" and (not all(parts) or any(p in (".", "..") for p in parts)):
        raise ValueError(f"bad chroot {chroot!r}: no empty, '.' or '..' components")
    if chroot != "/" and parts[0] == "zookeeper":
        raise ValueError(f"bad chroot {chroot!r}: /zookeeper is reserved by the server")
    for ch in chroot:
        if ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F or 0xD800 <= ord(ch) <= 0xF8FF or ord(ch) >= 0xFFF0:
            raise ValueError(f"bad chroot {chroot!r}: character {ch!r} is not allowed in ZooKeeper")
    return chroot.rstrip("/") or "/"


def check_hosts(hosts: str) -> None:
    for item in hosts.split(","):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad ZooKeeper host {item!r} in {hosts!r}: expected host:port")


@dataclass(slots=True, frozen=True)
class UrlParts:
    """What a ``zookeeper://`` URL says (with the keywords that may stand in for it)."""

    hosts: str
    chroot: str
    username: str | None
    password: str | None = field(repr=False)
    acl: str | None


def parse_url(
    url: str, schemes: tuple[str, ...], *, username: str | None, password: str | None,
    acl: str | None,
) -> UrlParts:
    """``zookeeper://[user:password@]host:port[,host:port...][/chroot][?acl=...]``; the
    chroot defaults to ``/aiolock``, the port to 2181. Refused with ValueError, never
    showing the password."""
    shown = redacted(url)
    parts = urlsplit(url)
    if parts.scheme.lower() not in schemes:
        raise ValueError(f"expected {URL_FORM}, got {shown!r}")
    if parts.fragment:
        raise ValueError(f"zookeeper URLs take no fragment: expected {URL_FORM}, got {shown!r}")
    for key, value in query_pairs(parts.query, shown).items():  # given twice: ValueError
        if key != "acl" or acl is not None:
            raise ValueError(f"zookeeper URLs take one query option, acl=creator|open; "
                             f"got {key!r} in {shown!r}" + (" (and acl= as a keyword)"
                                                            if key == "acl" else ""))
        acl = value
    userinfo, at, netloc = parts.netloc.rpartition("@")
    if at:
        if username is not None or password is not None:
            raise ValueError(f"credentials given twice: in the URL {shown!r} and as keywords")
        user, colon, secret = userinfo.partition(":")
        username, password = unquote(user), (unquote(secret) if colon else None)
    if not netloc:
        raise ValueError(f"expected {URL_FORM}, got {shown!r}")
    hosts = ",".join(h if ":" in h.rpartition("]")[2] else f"{h}:2181" for h in netloc.split(","))
    chroot = parts.path if parts.path not in ("", "/") else "/aiolock"
    return UrlParts(hosts, chroot, username, password, acl)
