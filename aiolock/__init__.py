"""aiolock: asyncio-native distributed locks with fencing tokens and a watchdog.

    async with aiolock.connect("redis://localhost:6379/0") as locks:
        async with locks.lock("orders:42", ttl=30) as lease:
            await charge(order, fencing_token=lease.token)

See README.md for the full guide; SPEC.md for the contract.
"""

from ._connect import SCHEMES, connect
from ._election import Campaign, Election, Leader, Leadership
from ._holder import Holder
from ._lease import Lease
from ._lock import Lock
from ._locks import Locks, RWLock, Semaphore
from .abc import Backend, Capability, Kind, LockInfo
from .errors import AccessDenied, BackendUnavailable, LockError, LockLost, LockTimeout
from .fencing import FencedResource, MemoryFencedResource, RedisFencedResource

__version__ = "0.1.0"

__all__ = [
    "SCHEMES",
    "AccessDenied",
    "Backend",
    "BackendUnavailable",
    "Campaign",
    "Capability",
    "Election",
    "FencedResource",
    "Holder",
    "Kind",
    "Leader",
    "Leadership",
    "Lease",
    "Lock",
    "LockError",
    "LockInfo",
    "LockLost",
    "LockTimeout",
    "Locks",
    "MemoryFencedResource",
    "RWLock",
    "RedisFencedResource",
    "Semaphore",
    "__version__",
    "connect",
]
