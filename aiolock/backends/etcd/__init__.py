"""``etcd://host:port,host:port``: locks on etcd v3 (one member or a cluster).

Client: ``etcd3aio`` (``pip install 'aiolock[etcd]'``) for its generated etcd v3
protobuf messages and gRPC stubs, over our own ``grpc.aio`` channel. Chosen on merit:
it is maintained, built on ``grpc.aio``, typed, and works with current grpcio/protobuf.
``aetcd`` opens plaintext channels to one host only (no TLS, no endpoint list) and one
keep-alive stream per lease; ``etcd3aio``'s own ``Lock`` and ``LeaseKeepalive`` run a
task and a stream per lease and a stream per watch, and retry non-idempotent calls.
So the recipe, the one keep-alive stream and the one watch stream per connection are
ours; only the wire format is borrowed.

Modules: ``_backend`` (the adapter: the core's single-attempt primitives), ``_recipe``
(pure: who holds, what a waiter watches), ``_leases`` (the shared leases, their orphans,
the keep-alive stream), ``_watches`` (the watch stream and the waiters it wakes),
``_connection`` (options, channel, authentication, the one exception map), ``_claim``
(the typed per-claim and per-lease state), ``_wire`` (messages, stubs, a queue-fed
stream).

Layout: every claim is one key ``<prefix>/<family>/<escaped name>/<kind>-<owner>``
(family ``lock``, ``rw`` or ``sem``; kind ``lock``, ``read``, ``write``, ``permit``;
``owner`` the claim's per-acquisition id) attached to the connection's shared etcd lease
of its lease length, with the claim's ttl and limit as its value. The name is
percent-encoded into one path component.

Recipe (etcd's own ``concurrency.Mutex``, generalised like our ZooKeeper recipes): one
transaction puts our key if it does not exist yet and lists the family's keys sorted by
``create_revision``. Granted: a mutex or writer whose key is first; a reader with no
writer key before it (a waiting writer blocks later readers: writers are not starved);
a permit among the first ``limit`` keys. Otherwise the waiter watches the deletion of
the key(s) just before its own (for a reader the last writer before it, for a permit
the ``limit`` keys before it), from the listing's revision on: no herd, nothing missed,
and first come, first served by construction (every claim is fair). The fencing token
is the holder key's ``create_revision``, which only grows in the cluster's history. The
same transaction rewrites a lease-less key ``<prefix>/token/<family>/<escaped name>``:
its ``mod_revision`` is the newest claim key's ``create_revision``, so ``last_token`` is
still known once every claim key is gone (one small key per name ever locked stays).

Holders, listing, revocation, elections: a key's value is ``ttl:limit:stamp:record``
(the holder record of :mod:`aiolock._holder`, and the wall-clock time the key was first
written: etcd keeps no times, so a holder's ``since`` is on the writer's clock; a claim
granted after a wait writes how long it queued into its record, which ``since`` leaves
out: see :mod:`aiolock._holder`). ``scan`` reads each family's
keys under the escaped prefix (keys only, in pages) and inspects each name.
``force_release`` deletes the holders' keys; a renewal batch checks in one read-only
transaction that each key still exists, so a key gone under a live lease (revoked by an
operator, or deleted by hand) is reported revoked within ``ttl/3``. An election is an
exclusive family ``elect``; ``proclaim`` rewrites the leader's value (same key, lease
and token); observers and candidates watch every change of the family.

Leases (what ``ttl`` means): every claim of one connection with the same lease length,
``max(ceil(ttl), the server's minimum)`` seconds (etcd leases are whole seconds; the
server's minimum is 1.5 election timeouts, rounded up), is on ONE etcd lease (etcd's own
``concurrency.Session``), granted when the first claim needs it. The watchdog's renewals
go, in batches, over ONE ``LeaseKeepAlive`` stream per connection: one keep-alive per
lease, however many claims are on it (a keep-alive cost ~0.1 ms of client CPU: with a
lease per claim, thousands of held claims lapsed on a busy machine); a waiting claim's
re-checks keep its lease alive too. The client believes a lease for ``min(ttl, granted
ttl)`` from when the grant or the keep-alive was *sent*; the server keeps it at least
that long, so a holder never believes a lease the server dropped. A lease answered gone
or not confirmed in time is lost with every claim on it (each reports its own loss),
revoked in case the server still has it, and later claims get a new one; a key deleted
under a live lease (``force_release``) loses that claim alone. A holder that dies frees
the lock when its lease expires: within the lease length plus the server's expiry sweep
(0.5 s). When the last claim leaves a lease, it is kept for reuse while over half its
ttl is left (no keep-alive goes for an idle lease), then revoked; closing the
connection revokes every lease of it. A claim extended beyond its etcd lease
(``Lease.extend``) is moved to the shared lease of its new length (the key keeps its
``create_revision``, so its token).

A shared lease must not keep alive a key nobody holds: a key whose delete failed (a
release or an abandon that did not get through: an *orphan*) and a claim the core no
longer counts on (past its own expiry, unrenewed) are deleted before the lease is kept
alive again (or go with its revocation once no claim is left on it). An acquire
cancelled mid-request may have its put applied after the abandon, and the shared lease
cannot be revoked to make it fail: the abandon puts a tombstone ``<prefix>/gone/<owner>``
on that lease and deletes the key in one transaction, and every acquire's transaction
requires its owner's tombstone to be absent. Tombstones go with their lease; a lease
given ``TOMBSTONES`` (1,000) of them is retired (later claims get a new one).

etcd answers one stream's keep-alives in order, and one for a lease that expired but is
not yet revoked waits for the revocation (at most 1,000 a second): a keep-alive is
therefore sent only for a lease believed alive with 0.1 s to spare, a waiting claim
whose lease is not surely alive loses it (revoked) and queues again, and a batch waits
for replies no longer than its leases are believed (then the stream starts afresh).
Otherwise one late renewal under load held up every renewal behind it, and thousands of
leases lapsed.

Requests: an acquire puts its key on the current lease of its length (granted first if
there is none, or the idle one kept is no longer fresh); a release deletes the key. So
an uncontended acquire + release is two requests, the put-and-list transaction and the
delete, like a bare put-if-absent. An abandon deletes the key (with a tombstone where a
put may be in flight).

Pauses: Jepsen's analysis of etcd 3.4.3 (2020) showed that etcd locks, like every lease
lock, cannot by themselves guarantee mutual exclusion: a holder paused or cut off past
its lease keeps running while the server expires the lease and grants the lock to the
next client. Here the holder knows no later than its last confirmed expiry (a woken
process sees ``lease.lost`` at once; tested with SIGSTOP and a blackholed connection),
but a write already under way cannot be recalled: protected resources must check the
fencing token (the key's ``create_revision``) and refuse lower ones.

Errors: an unreachable cluster raises :class:`aiolock.BackendUnavailable` within
``connect_timeout`` (requests within ``request_timeout``; a cluster without quorum does
not answer writes: renewals fail and leases are lost at their last confirmed expiry);
refused credentials or permissions raise :class:`aiolock.AccessDenied`. The least
permissions: a role with ``readwrite`` on the key prefix (``etcdctl role
grant-permission aiolock-role --prefix=true readwrite aiolock/``).
"""

from ._backend import EtcdBackend

__all__ = ["EtcdBackend"]
