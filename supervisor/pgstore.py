"""The cluster's PostgreSQL: a pool of connections for queries, one connection that
LISTENs, the schema the daemon creates and migrates itself, and reconnection with
back-off when the server goes away.

Every query error is raised as PoolError(UNAVAILABLE) naming the cause, so a cluster
operation fails clearly while the server is down and the daemon keeps serving direct
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from modelpool.protocol.errors import ErrorCode, PoolError

log = logging.getLogger("modelpool.cluster")

SCHEMA = "modelpool"
MIGRATION_LOCK = 0x6D6F64656C706F6F  # pg_advisory_xact_lock: one migrating daemon at a time
CONNECT_TIMEOUT_S = 3
# A link that goes silent (a cut cable, a peer that vanished) fails the connection in
# about three seconds instead of TCP's minutes, so a query never hangs the node past its
# leases: unacknowledged data, keepalive probes included, time out (libpq >= 12).
CONNECTION_OPTIONS: dict[str, Any] = {
    "autocommit": True, "connect_timeout": CONNECT_TIMEOUT_S, "keepalives": 1,
    "keepalives_idle": 1, "keepalives_interval": 1, "keepalives_count": 2,
    "tcp_user_timeout": 3000, "row_factory": dict_row,
    # The statements every job runs are prepared (psycopg does so from their fifth run);
    # planning them took PostgreSQL three times as long as running them, and a plan of
    # arrays of rows is as good for one row as for many.
    "options": "-c plan_cache_mode=force_generic_plan",
}
CHANNELS = ("modelpool_jobs", "modelpool_done", "modelpool_cancel")

# Each entry moves the schema one version on; never edit one that has shipped.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE modelpool.jobs (
        key text PRIMARY KEY,
        uid integer NOT NULL,
        op text NOT NULL,
        model text NOT NULL,
        priority smallint NOT NULL,
        request bytea NOT NULL,
        single boolean NOT NULL DEFAULT false,
        dedup bytea,
        leader text,
        submitted_at double precision NOT NULL,
        state text NOT NULL DEFAULT 'queued',
        node text NOT NULL DEFAULT '',
        attempt integer NOT NULL DEFAULT 0,
        lease_until timestamptz,
        started_at double precision,
        finished_at double precision,
        result bytea,
        error_code text,
        error_message text,
        expires_at timestamptz
    );
    CREATE INDEX jobs_waiting ON modelpool.jobs (model, priority, submitted_at)
        WHERE state = 'queued';
    CREATE INDEX jobs_leases ON modelpool.jobs (lease_until) WHERE state = 'running';
    CREATE INDEX jobs_expiry ON modelpool.jobs (expires_at) WHERE expires_at IS NOT NULL;
    CREATE INDEX jobs_identical ON modelpool.jobs (dedup)
        WHERE state IN ('queued', 'running') AND leader IS NULL;
    CREATE INDEX jobs_joined ON modelpool.jobs (leader) WHERE leader IS NOT NULL;
    CREATE INDEX jobs_owner ON modelpool.jobs (uid, submitted_at);
    CREATE TABLE modelpool.nodes (
        name text PRIMARY KEY,
        started_at timestamptz NOT NULL DEFAULT now(),
        beat_at timestamptz NOT NULL DEFAULT now(),
        report jsonb NOT NULL DEFAULT '{}'
    );
    """,
    # Jobs end at their deadline while they wait (the server's clock, whichever node
    # submitted them).
    """
    ALTER TABLE modelpool.jobs ADD COLUMN deadline_at timestamptz;
    CREATE INDEX jobs_deadlines ON modelpool.jobs (deadline_at)
        WHERE state IN ('queued', 'joined') AND deadline_at IS NOT NULL;
    """,
    # A job is claimed only by nodes that configure its model as the node that accepted
    # it does (supervisor/cluster_view.py); NULL: by any (a job of an older node).
    "ALTER TABLE modelpool.jobs ADD COLUMN IF NOT EXISTS variant text;",
    # A relayed stream's text goes to this channel as it is made (supervisor/pgstreams.py).
    "ALTER TABLE modelpool.jobs ADD COLUMN IF NOT EXISTS stream_to text;",
    # Waiting jobs are counted by user and by tenant: each one's share of max_queued.
    """
    ALTER TABLE modelpool.jobs ADD COLUMN IF NOT EXISTS tenant text NOT NULL DEFAULT '';
    CREATE INDEX IF NOT EXISTS jobs_waiting_owners ON modelpool.jobs (uid, tenant)
        WHERE state = 'queued';
    """,
    # The Responses API's kept responses, shared by every node's HTTP front door
    # (supervisor/httpapi/response_store_pg.py).
    """
    CREATE TABLE IF NOT EXISTS modelpool.responses (
        id text PRIMARY KEY,
        owner text NOT NULL,
        items jsonb NOT NULL,
        body bytea,
        response jsonb,
        size integer NOT NULL,
        used_at timestamptz NOT NULL DEFAULT clock_timestamp()
    );
    CREATE INDEX IF NOT EXISTS responses_by_use ON modelpool.responses (owner, used_at);
    CREATE INDEX IF NOT EXISTS responses_items ON modelpool.responses
        USING gin (items jsonb_path_ops);
    """,
    # What each owner keeps, kept up to date by a trigger, so that checking the bound
    # and choosing whom to trim read one row per owner, not every response.
    """
    CREATE TABLE IF NOT EXISTS modelpool.responses_owners (
        owner text PRIMARY KEY,
        count integer NOT NULL,
        used bigint NOT NULL
    );
    CREATE INDEX IF NOT EXISTS responses_owners_by_use ON modelpool.responses_owners (used);
    INSERT INTO modelpool.responses_owners
        SELECT owner, count(*), sum(size) FROM modelpool.responses GROUP BY owner
        ON CONFLICT (owner) DO NOTHING;
    CREATE OR REPLACE FUNCTION modelpool.responses_owners_count() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP <> 'INSERT' THEN
            UPDATE modelpool.responses_owners SET count = count - 1, used = used - OLD.size
                WHERE owner = OLD.owner;
            DELETE FROM modelpool.responses_owners WHERE owner = OLD.owner AND count = 0;
        END IF;
        IF TG_OP <> 'DELETE' THEN
            INSERT INTO modelpool.responses_owners VALUES (NEW.owner, 1, NEW.size)
                ON CONFLICT (owner) DO UPDATE SET count = responses_owners.count + 1,
                    used = responses_owners.used + excluded.used;
        END IF;
        RETURN NULL;
    END $$;
    DROP TRIGGER IF EXISTS responses_owners_count ON modelpool.responses;
    CREATE TRIGGER responses_owners_count
        AFTER INSERT OR DELETE OR UPDATE OF owner, size ON modelpool.responses
        FOR EACH ROW EXECUTE FUNCTION modelpool.responses_owners_count();
    """,
)


def unavailable(exc: BaseException) -> PoolError:
    return PoolError(ErrorCode.UNAVAILABLE, f"the cluster's PostgreSQL is unreachable: "
                     f"{type(exc).__name__}: {str(exc).strip()[:300]}")


class PgStore:
    def __init__(self, dsn: str, on_notify: Callable[[str, str], None],
                 on_reconnect: Callable[[], None], channels: tuple[str, ...] = CHANNELS) -> None:
        self.dsn = dsn
        self.channels = channels
        self.on_notify = on_notify  # (channel, payload), on the event loop
        self.on_reconnect = on_reconnect  # notifications may have been missed meanwhile
        # A server that is down fails each operation within CONNECT_TIMEOUT_S rather than
        # being retried in the background.
        self.pool = AsyncConnectionPool(dsn, min_size=1, max_size=8, open=False,
                                        kwargs=CONNECTION_OPTIONS, reconnect_timeout=0)
        self._listener: asyncio.Task[None] | None = None
        self.listening = asyncio.Event()
        self.migrated = False

    async def start(self) -> None:
        await self.pool.open(wait=False)
        await self.migrate()
        self._listener = asyncio.get_running_loop().create_task(self._listen())

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
        await self.pool.close(timeout=2.0)

    async def migrate(self) -> int:
        """Create or bring the schema up to date; safe when several daemons start at once.
        Returns the version it is at."""
        async with self.transaction() as cur:
            await cur.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            await cur.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
            await cur.execute(f"CREATE TABLE IF NOT EXISTS {SCHEMA}.meta (version integer)")
            await cur.execute(f"SELECT version FROM {SCHEMA}.meta")
            row = await cur.fetchone()
            version = row["version"] if row else 0
            for number, sql in enumerate(MIGRATIONS[version:], start=version + 1):
                await cur.execute(sql)
                log.info("cluster schema migrated to version %d", number)
            await cur.execute(f"DELETE FROM {SCHEMA}.meta")
            # A newer node may have migrated further: its version stays.
            version = max(version, len(MIGRATIONS))
            await cur.execute(f"INSERT INTO {SCHEMA}.meta VALUES (%s)", (version,))
        self.migrated = True
        return version

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[psycopg.AsyncCursor[Any]]:
        try:
            async with self.pool.connection(timeout=CONNECT_TIMEOUT_S) as conn, \
                    conn.transaction(), conn.cursor() as cur:
                yield cur
        except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout, OSError) as exc:
            raise unavailable(exc) from exc

    async def fetch(self, sql: str, params: Any = ()) -> list[dict[str, Any]]:
        """Run one statement (atomic by itself: the connections autocommit) and return
        its rows. A connection that a server restart broke while it sat in the pool
        fails at once; the statement is then tried once more, on a new connection."""
        if not self.migrated:
            raise PoolError(ErrorCode.UNAVAILABLE, "the cluster's PostgreSQL has not been "
                            "reached yet (see the daemon's log)")
        for attempt in (1, 2):
            try:
                async with self.pool.connection(timeout=CONNECT_TIMEOUT_S) as conn:
                    cur = await conn.execute(sql, params)
                    return await cur.fetchall() if cur.description else []
            except psycopg.OperationalError as exc:
                if attempt == 2:
                    raise unavailable(exc) from exc
            except (psycopg.InterfaceError, PoolTimeout, OSError) as exc:
                raise unavailable(exc) from exc
        raise AssertionError("unreachable")

    async def _listen(self) -> None:
        """One connection LISTENing on the cluster's channels, reconnected with back-off;
        after a reconnection everyone re-checks, for what may have been missed."""
        backoff = 0.5
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                        self.dsn, **CONNECTION_OPTIONS) as conn:
                    for channel in self.channels:
                        await conn.execute(f"LISTEN {channel}")
                    self.listening.set()
                    backoff = 0.5
                    self.on_reconnect()
                    async for note in conn.notifies():
                        self.on_notify(note.channel, note.payload)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.listening.is_set():
                    log.warning("lost the cluster's PostgreSQL (%s); reconnecting", exc)
                self.listening.clear()
            await asyncio.sleep(backoff)
            backoff = min(5.0, backoff * 2)
