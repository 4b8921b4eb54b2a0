"""This daemon as a node of a cluster: it registers itself, beats once a second with what
it has loaded and how busy it is, and keeps the other live nodes' beats, from which it
decides (cluster_view.py) whether to take jobs of a model it has not loaded (not when
another node has that model loaded with room to spare: a job never waits behind a load
here that it need not) and whether a direct request is better sent through the shared
queue; and it ends the waiting jobs of a model that no live node has been able to run
for stranded_timeout_s, so that every accepted job gets an ending.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import msgspec

from modelpool.protocol.errors import PoolError
from modelpool.protocol.jobs import PoolStats
from modelpool.protocol.messages import ModelInfo
from modelpool.protocol.status import ClusterStatus, ModelLoad, NodeStatus
from modelpool.registry.content import content_digests
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor.admission import RemoteModel
from modelpool.supervisor.clock import Scheduler
from modelpool.supervisor.cluster_view import (
    Peer,
    Waiting,
    alike,
    differing,
    jobs_of,
    may_load_here,
    model_elsewhere,
    model_identity,
    models_elsewhere,
    peer_from_row,
    runs,
    serves_with_room,
    stranded_since,
    variant_of,
)
from modelpool.supervisor.config import ClusterConfig, Config
from modelpool.supervisor.jobservice import JobService
from modelpool.supervisor.mailbox import MemoryMailbox
from modelpool.supervisor.models import LOADING
from modelpool.supervisor.pool import Pool
from modelpool.supervisor.tasks import MemoryTaskQueue
from modelpool.supervisor.workers import WorkerState

if TYPE_CHECKING:  # psycopg is ~0.2 s of the daemon's start: only with [cluster]
    from modelpool.supervisor.pgjobs import PgJobs
    from modelpool.supervisor.pgstore import PgStore

log = logging.getLogger("modelpool.cluster")

NODE_LIVE_S = 3.0  # a node whose last beat is older is presumed gone
BEAT_S = 1.0
# Lapsed leases are looked for twice a beat, so that a lost node's jobs are claimed again
# within half a second of their lease's end, not up to a whole beat after it.
RESCUE_S = 0.5


class ClusterNode:
    def __init__(self, name: str, pool: Pool, jobs: PgJobs, store: PgStore,
                 local_stats: Callable[[], PoolStats]) -> None:
        self.name = name
        self.pool = pool
        self.jobs = jobs
        self.store = store
        self.local_stats = local_stats
        self.peers: list[Peer] = []  # the other live nodes, as of the last beat
        # The models this node could run, as of the last beat: looking at each model's
        # files for every claim round (every job's end) or direct request would cost
        # too much.
        self.runnable_here: frozenset[str] = frozenset()
        self.reachable = False
        self.queued: dict[Waiting, int] = {}
        # Models (and variants) whose waiting jobs no live node can run, since when
        # (scheduler time).
        self.stranded: dict[Waiting, float] = {}
        self._identify({})
        # Models some live peers configure otherwise than this node, and who they are.
        self.differs: dict[str, list[str]] = {}

    def _identify(self, contents: Mapping[str, str]) -> None:
        """What the beat says of this node's config (made when the node joins and after
        a reload), with its models' files by their content where known."""
        specs = self._specs()
        self.contents = dict(contents)
        self.identities = {spec.key: model_identity(spec, contents.get(spec.key))
                           for spec in specs}
        # The variant of each model as configured here: its jobs carry it, and only
        # nodes configured alike claim them.
        self.variants = {key: variant_of(identity) for key, identity in self.identities.items()}
        self.catalog = {"capabilities": {spec.key: spec.capability for spec in specs},
                        "names": {name.lower(): spec.key for spec in specs
                                  for name in (spec.key, *spec.aliases)},
                        "identities": self.identities}
        self.runnable_here &= frozenset(self.identities)  # (a reload removed some)

    def follow_config(self, config: ClusterConfig) -> None:
        """A reload's [cluster]: its lease, for this node's claims and renewals from now
        on (within a second: the next beat renews what runs here). Its routing and its
        bound on stranded jobs are read where they are used."""
        self.jobs.lease_s = config.lease_s

    def _specs(self) -> list[ModelSpec]:
        return [model.spec for model in self.pool.models.values() if not model.retiring]

    async def identify(self) -> None:
        """Before the node joins (until then it takes no jobs)."""
        self._identify(await self.digests(self._specs()))

    def reidentify(self, specs: list[ModelSpec], contents: Mapping[str, str]) -> None:
        """After a reload: these models by their new files, the others as they were."""
        keys = {spec.key for spec in specs}
        self._identify({**{key: digest for key, digest in self.contents.items()
                           if key not in keys}, **contents})

    async def digests(self, specs: list[ModelSpec]) -> dict[str, str]:
        """The content of these models' local files, read in a thread: the first time,
        gigabytes may be hashed."""
        started = time.monotonic()
        stop = threading.Event()
        try:
            contents = await asyncio.to_thread(content_digests, specs, stop)
        except asyncio.CancelledError:  # the daemon stops: so does the hashing, soon
            stop.set()
            raise
        log.info("cluster node %s: the files of %d local model(s) identified in %.1fs",
                 self.name, len(contents), time.monotonic() - started)
        return contents

    def variant(self, key: str) -> str | None:
        return self.variants.get(key)

    def may_load(self, key: str) -> bool:
        model = self.pool.models[key]
        models = list(self.pool.models.values())
        loading = sum(w.state in LOADING for m in models for w in m.processes())
        device = model.device or "cpu"
        return may_load_here(model, self.alike(key), loading,
                             self.pool.config.pool.max_concurrent_loads,
                             self.pool.capacity.used_mb(models, device),
                             self.pool.capacity.budget_for(device),
                             key in self.runnable_here)

    def should_route(self, key: str) -> bool:
        """A direct request for this model: through the shared queue to a peer that has it
        loaded with room, rather than loading it here, or to one that can run it when
        this node cannot?"""
        model = self.pool.models.get(key)
        if model is None or model.live_workers() or not self.reachable:
            return False
        return (any(serves_with_room(peer, key) for peer in self.alike(key))
                or (key not in self.runnable_here and self.runs_elsewhere(key)))

    def alike(self, key: str) -> list[Peer]:
        """The live peers that configure this node's model alike: the only ones that run
        its jobs."""
        return alike(self.peers, key, self.variants.get(key))

    def runs_elsewhere(self, key: str) -> bool:
        """A live peer configured alike serves the model or could start it now."""
        return self.reachable and any(runs(peer, key) for peer in self.alike(key))

    def models_elsewhere(self) -> list[ModelInfo]:
        return models_elsewhere(self.peers, self.pool.models) if self.reachable else []

    def elsewhere(self, name: str) -> RemoteModel | None:
        """A model this node's config does not name that a live peer can run."""
        return model_elsewhere(name, self.peers) if self.reachable else None

    def runnable(self) -> list[str]:
        """The models this node could run now, for its peers."""
        return [key for key, model in self.pool.models.items()
                if not model.retiring and self.pool.intake.local_refusal(model) is None]

    def report(self) -> dict[str, ModelLoad]:
        out = {}
        for model in self.pool.models.values():
            live = model.live_workers()
            if live or len(model.queue):
                out[model.key] = ModelLoad(
                    live=len(live), ready=sum(w.ready for w in live),
                    idle=sum(w.state is WorkerState.IDLE for w in live),
                    queued=len(model.queue))
        return out

    async def beat(self) -> None:
        """Say what this node serves; learn what the others do."""
        runnable = self.runnable()
        self.runnable_here = frozenset(runnable)
        report = {"models": msgspec.to_builtins(self.report()), "runnable": runnable,
                  **self.catalog,
                  "running_jobs": sum(m.running() for m in self.pool.models.values()),
                  "stats": msgspec.to_builtins(self.local_stats())}
        try:
            rows = await self.store.fetch("""
                WITH me AS (
                    INSERT INTO modelpool.nodes (name, report) VALUES (%s, %s::jsonb)
                    ON CONFLICT (name) DO UPDATE SET beat_at = now(), report = excluded.report)
                SELECT name, extract(epoch FROM now() - beat_at) AS ago, report
                FROM modelpool.nodes
                WHERE name <> %s AND beat_at > now() - make_interval(secs => %s)""",
                (self.name, json.dumps(report), self.name, NODE_LIVE_S))
            self.queued = await self.jobs.waiting()
        except PoolError as exc:
            if self.reachable:
                log.warning("cluster beat failed: %s", exc.message)
            self.reachable, self.peers = False, []
            return
        self.reachable = True
        self.peers = [peer_from_row(row) for row in rows]
        self.stranded = stranded_since(
            self.queued, {key: self.variants[key] for key in self.runnable_here}, self.peers,
            self.stranded, self.pool.scheduler.now())
        self._note_differences(differing(self.identities, self.peers))

    def _note_differences(self, differs: dict[str, list[str]]) -> None:
        """Said once in the log when it starts: from then on the two configurations do
        not share work of that key (each runs only its own jobs of it)."""
        for key, names in differs.items():
            new = sorted(set(names) - set(self.differs.get(key, [])))
            if new:
                log.warning("model %s is configured otherwise on %s than here (its files, "
                            "source, loader or options): each runs only its own jobs of it", key,
                            ", ".join(new))
        self.differs = differs

    async def end_stranded(self) -> None:
        """End the waiting jobs of models that no live node has been able to run for
        stranded_timeout_s: every accepted job gets an ending."""
        limit = self.pool.config.cluster.stranded_timeout_s
        now = self.pool.scheduler.now()
        for (key, variant), since in list(self.stranded.items()):
            if limit and now - since >= limit:
                ended = await self.jobs.end_stranded(
                    key, variant, f": no live node could run model {key!r} for {limit:g}s "
                    "(stranded_timeout_s)")
                log.warning("%d waiting jobs of %s ended: no live node could run it for "
                            "%gs", ended, jobs_of(key, variant, self.variants), limit)
                del self.stranded[key, variant]

    def stranded_ends_in(self) -> dict[str, float | None]:
        limit = self.pool.config.cluster.stranded_timeout_s
        now = self.pool.scheduler.now()
        return {jobs_of(key, variant, self.variants): round(max(0.0, since + limit - now), 1)
                if limit else None for (key, variant), since in self.stranded.items()}

    def queued_jobs(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for (key, _), n in self.queued.items():
            counts[key] = counts.get(key, 0) + n
        return counts

    def peer_stats(self) -> list[PoolStats]:
        return [peer.stats for peer in self.peers if peer.stats is not None]

    def status(self) -> ClusterStatus:
        me = NodeStatus(name=self.name, beat_s_ago=0.0, models=self.report(),
                        running_jobs=sum(m.running() for m in self.pool.models.values()),
                        runnable=sorted(self.runnable_here))
        others = [NodeStatus(name=p.name, beat_s_ago=round(p.beat_s_ago, 2),
                             models=dict(p.models), running_jobs=p.running_jobs,
                             runnable=None if p.runnable is None else sorted(p.runnable))
                  for p in self.peers]
        return ClusterStatus(node=self.name, reachable=self.reachable, nodes=[me, *others],
                             queued_jobs=self.queued_jobs(), stranded=self.stranded_ends_in(),
                             differs=self.differs)


def job_service(config: Config, pool: Pool, scheduler: Scheduler,
                node: str) -> tuple[JobService, ClusterNode | None]:
    """The job API on the embedded in-memory queue and mailbox, or, with [cluster]
    postgres set, on the PostgreSQL shared by the cluster's daemons."""
    jobs = config.jobs
    if not config.cluster.dsn:
        mailbox = MemoryMailbox(scheduler, jobs.result_retention_s, jobs.max_mailbox_bytes)
        return JobService(pool, MemoryTaskQueue(jobs.max_queued), mailbox, jobs, node), None
    from modelpool.supervisor.pgjobs import PgJobs

    backend = PgJobs(node, config.cluster.lease_s, jobs.result_retention_s,
                     jobs.max_mailbox_bytes, jobs.max_queued)
    store = backend.connect(config.cluster.dsn)
    service = JobService(pool, backend, backend, jobs, node, shared=True)
    cluster = ClusterNode(node, pool, backend, store, service.local_stats)
    service.may_load, service.peer_stats = cluster.may_load, cluster.peer_stats
    service.runs_elsewhere, service.elsewhere = cluster.runs_elsewhere, cluster.elsewhere
    service.variant = backend.variant = cluster.variant
    service.streams = backend.streams
    return service, cluster


async def keep_in_touch(cluster: ClusterNode, jobs: JobService) -> None:
    """Connect (and migrate the schema), then beat and tick once a second; a PostgreSQL
    that is down only delays this, with back-off, while the daemon serves on."""
    await cluster.identify()
    backoff = 0.5
    while True:
        try:
            await cluster.store.start()
            break
        except PoolError as exc:
            log.warning("cluster: %s; retrying in %.1fs", exc.message, backoff)
            await asyncio.sleep(backoff)
            backoff = min(5.0, backoff * 2)
    log.info("cluster node %s: connected", cluster.name)
    loop = asyncio.get_running_loop()
    next_beat = loop.time()
    while True:
        beat, next_beat, wake_at = next_round(loop.time(), next_beat)
        if beat:
            await cluster.beat()
            if cluster.reachable:
                with contextlib.suppress(PoolError):  # the next beat logs it
                    await cluster.end_stranded()
        if cluster.reachable:
            with contextlib.suppress(PoolError):  # the beat logs it once
                # Between beats only the sweep: what it puts back is announced to every
                # node, this one's claimer too.
                await (jobs.tick() if beat else jobs.queue.sweep())
        await asyncio.sleep(max(0.0, wake_at - loop.time()))


def next_round(now: float, next_beat: float) -> tuple[bool, float, float]:
    """(beat in this round?, when the next beat is due, when the next round starts): a
    beat every BEAT_S at a steady rate however long one takes (and no burst of them after
    an outage), and a sweep of lapsed leases every RESCUE_S between them."""
    beat = now >= next_beat
    if beat:
        next_beat = max(next_beat + BEAT_S, now + RESCUE_S)
    return beat, next_beat, min(next_beat, now + RESCUE_S)
