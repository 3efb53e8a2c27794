"""The ZooKeeper backend's watches: who is woken by what.

* A waiting claim watches only the nodes whose deletion can grant it (the recipe's
  ``watch`` list), with a *child* watch on each (``getChildren`` of the lock node): an
  ephemeral node has no children, so the watch fires only when the node is deleted --
  never on the ``setData`` of a renewal -- and exactly one watch fires per release.
* An election's observer watches the whole name: a child watch on the name's container
  (a candidate joins, a leader leaves) and an ``exists`` watch on it (its data is
  rewritten by every ``proclaim``; it is created and deleted with its first and last
  node). The watches are set again before the observer is woken, so no change between
  two reads is missed.

A watch that fires while its node still exists (the server may do that when watches are
set again after a reconnect) just makes the waiter look again; after every reconnect
every waiter looks again anyway.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from aiozk import exc as zkexc
from aiozk import protocol as zkproto

from ...abc import Claim, Kind, Waiter
from ._claim import ClaimState, known, state_of
from ._io import _Io
from ._reaper import Reaper

log = logging.getLogger("aiolock.backends.zookeeper")

_EVENT = zkproto.WatchEvent
#: the events of an observer's watches on a name's container
_FAMILY_EVENTS = (_EVENT.CHILDREN_CHANGED, _EVENT.DATA_CHANGED, _EVENT.CREATED, _EVENT.DELETED)


class _Watches(_Io):
    """Watches on top of the session; see the module doc."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: znode path -> the claims (owner -> state) woken by its deletion
        self._watching: dict[str, dict[str, ClaimState]] = {}
        self._observers: dict[str, set[Waiter]] = {}  # container path -> its observers
        self._reaper = Reaper()
        if self._repair is not None:
            self._repair.direct = self._on_event

    def _on_event(self, event_type: int, path: str) -> bool:
        """A watch event, from the connection's reader: handled at once (True) if it is a
        deletion (or change) of a node only our waiters watch, else left to ``aiozk``'s
        dispatch (a turn of the event loop later)."""
        if event_type == _EVENT.DELETED:
            ours: Any = self._on_deleted
        elif event_type == _EVENT.CHILDREN_CHANGED:
            ours = self._on_changed
        else:
            return False
        if path not in self._watching:
            return False
        callbacks = self._client.session.watch_callbacks.get((event_type, path))
        if not callbacks or len(callbacks) != 1 or ours not in callbacks:
            return False
        try:
            ours(path)
        except Exception:  # (aiozk's reader must go on)
            log.exception("handling the ZooKeeper watch event on %s failed", path)
        return True

    def _watch(self, claim: Claim, paths: set[str]) -> None:
        """Make ``paths`` the set whose deletion wakes ``claim``'s waiter."""
        state = state_of(claim)
        # (a watch that fired -- also spuriously, as after a reconnect -- is gone here)
        old = {p for p in state.watch if claim.owner in self._watching.get(p, ())}
        for path in old - paths:
            self._unwatch_path(path, claim.owner)
        for path in paths - old:
            owners = self._watching.get(path)
            if owners is None:
                owners = self._watching[path] = {}
                session = self._client.session
                session.add_watch_callback(_EVENT.DELETED, path, self._on_deleted)
                # aiozk re-registers CHILDREN_CHANGED callbacks as child watches after a
                # reconnect (the server answers "deleted" at once for a node gone meanwhile)
                session.add_watch_callback(_EVENT.CHILDREN_CHANGED, path, self._on_changed)
            owners[claim.owner] = state
        state.watch = set(paths)

    def _unwatch(self, claim: Claim) -> None:
        state = known(claim)
        if state is None or not state.watch:
            return
        for path in state.watch:
            self._unwatch_path(path, claim.owner)
        state.watch = set()

    def _unwatch_path(self, path: str, owner: str) -> None:
        owners = self._watching.get(path)
        if owners is None:
            return
        owners.pop(owner, None)
        if not owners:
            self._drop_watch(path)

    def _drop_watch(self, path: str) -> dict[str, ClaimState]:
        owners = self._watching.pop(path, {})
        session = self._client.session
        for event, callback in ((_EVENT.DELETED, self._on_deleted),
                                (_EVENT.CHILDREN_CHANGED, self._on_changed)):
            with contextlib.suppress(KeyError):
                session.remove_watch_callback(event, path, callback)
        return owners

    def _prune_callbacks(self) -> None:
        """Drop the empty entries aiozk's dispatcher leaves behind (it indexes a
        defaultdict with every event, also for a watch whose callback we removed, and
        would re-register those as watches after every reconnect)."""
        callbacks = self._client.session.watch_callbacks
        for key in [k for k, v in callbacks.items() if not v]:
            del callbacks[key]

    def _on_deleted(self, path: str) -> None:
        self._reaper.forget(path)
        self._fired(path, deleted=True)

    def _on_changed(self, path: str) -> None:
        # An ephemeral node has no children, but the server sends CHILDREN_CHANGED for a
        # child watch set again after a reconnect if the node changed meanwhile: not a
        # deletion, the waiters just look again.
        self._fired(path, deleted=False)

    def _fired(self, path: str, deleted: bool) -> None:
        """The watch on ``path`` fired: wake its waiters, telling them of a deletion."""
        for owner, state in self._drop_watch(path).items():
            if deleted:
                state.gone.add(path)
            waiter = self._waiters.get(owner)
            if waiter is not None:
                if deleted:
                    self._woken(waiter.claim, state)
                waiter.wake()

    def _woken(self, claim: Claim, state: ClaimState) -> None:
        """A deletion woke ``claim``'s waiter (before it runs): see ``_Acquire``."""

    # -- observers of an election ---------------------------------------------------------

    async def listen(self, name: str, kind: Kind, waiter: Waiter) -> None:
        self._waiters[waiter.claim.owner] = waiter
        # an election's observer: a claim with no lease, never tried (a candidate waits on
        # its predecessor like any claim)
        if kind is Kind.LEADER and waiter.claim.ttl_ms <= 0:
            parent = self._parent(name)
            observers = self._observers.get(parent)
            if observers is None:
                observers = self._observers[parent] = set()
                for event in _FAMILY_EVENTS:
                    self._client.session.add_watch_callback(event, parent, self._on_family)
            observers.add(waiter)
            async with self._bounded("an observe"):
                await self._arm_family(parent)

    def _unlisten_observer(self, waiter: Waiter) -> None:
        parent = self._parent(waiter.claim.name)
        observers = self._observers.get(parent)
        if observers is None or waiter not in observers:
            return
        observers.discard(waiter)
        if not observers:
            del self._observers[parent]
            for event in _FAMILY_EVENTS:
                with contextlib.suppress(KeyError):
                    self._client.session.remove_watch_callback(event, parent, self._on_family)

    async def _arm_family(self, parent: str) -> None:
        """Set the child and ``exists`` watches on a name's container."""
        await self._send_quietly(zkproto.GetChildrenRequest(path=parent, watch=True))
        await self._send_quietly(zkproto.ExistsRequest(path=parent, watch=True))

    async def _send_quietly(self, request: Any) -> None:
        with contextlib.suppress(zkexc.NoNode):  # (an exists watch is set all the same)
            await self._send(request)

    def _on_family(self, parent: str) -> None:
        if parent in self._observers:
            self._spawn(self._rearm_and_wake(parent))

    async def _rearm_and_wake(self, parent: str) -> None:
        try:
            async with self._bounded("an observe"):
                await self._arm_family(parent)
        except Exception as exc:  # the observer reads again on its timer anyway
            log.debug("setting the election watches on %s again failed: %s", parent, exc)
        for waiter in list(self._observers.get(parent, ())):
            waiter.wake()

    def _after_reconnect(self, expired: bool) -> None:
        if expired:
            self._reaper.clear()
        self._prune_callbacks()
        for waiter in list(self._waiters.values()):  # never trust a watch across this
            waiter.wake()
