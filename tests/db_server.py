"""What the private database servers of the tests share (``pg_server.py``,
``mysql_server.py``): a data directory in the server's temp dir, and, when we are root,
the server's own system account owning it (the servers refuse to run as root)."""

from __future__ import annotations

import os
import pwd
from typing import ClassVar

from .servers import ServerProcess

__all__ = ["DatabaseServer"]


class DatabaseServer(ServerProcess):
    """A database server child process on a free loopback port, with a ``database``."""

    stop_wait = 20.0
    #: the system account the server runs as when the tests run as root
    account: ClassVar[str]

    def __init__(self, *, port: int | None, database: str, prefix: str) -> None:
        super().__init__(port=port, prefix=prefix)
        self.database = database
        self.data = self.dir / "data"
        self._as_root = os.geteuid() == 0
        #: the account the server runs as
        self.os_user = self.account if self._as_root else pwd.getpwuid(os.geteuid()).pw_name
        if self._as_root:
            pw = pwd.getpwnam(self.account)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
