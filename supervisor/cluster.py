"""This daemon as a node of a cluster: it registers itself, beats once a second with what
it has loaded and how busy it is, and keeps the other live nodes' beats, from which it
decides whether to take jobs of a model it has not loaded (not when another node has
that model loaded with room to spare: a job never waits behind a load here that it
need not) and whether a direct request is better sent through the shared queue; and it
ends the waiting jobs of a model that no live node has been able to run for
stranded_timeout_s, so that every accepted job gets an ending.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from modelpool.protocol.errors import PoolError
from modelpool.protocol.jobs import PoolStats
from modelpool.protocol.messages import ClusterStatus, ModelInfo, ModelLoad, NodeStatus
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor import memory
from modelpool.supervisor.admission import RemoteModel
from modelpool.supervisor.clock import Scheduler
from modelpool.supervisor.config import Config
from modelpool.supervisor.jobservice import JobService
from modelpool.supervisor.mailbox import MemoryMailbox
from modelpool.supervisor.models import LOADING, ModelState
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


@dataclass(frozen=True)
class Peer:
    name: str
    beat_s_ago: float
    models: Mapping[str, ModelLoad]
    running_jobs: int
    stats: PoolStats | None = None
    # The models it could run now (their device, files and memory are there); None from
    # a node of a version that does not say.
    runnable: frozenset[str] | None = None
    # Each model of its config: its capability, and the names (key and aliases, lower
    # case) it goes by: nodes whose config does not name one accept requests for it
    # while this node runs it or could.
    capabilities: Mapping[str, str] = field(default_factory=dict)
    names: Mapping[str, str] = field(default_factory=dict)
    # Each model of its config: what decides its outputs (model_identity).
    identities: Mapping[str, str] = field(default_factory=dict)


def _peer(row: dict[str, Any]) -> Peer:
    report = row["report"]
    stats = report.get("stats")
    return Peer(row["name"], float(row["ago"]),
                msgspec.convert(report.get("models", {}), dict[str, ModelLoad]),
                int(report.get("running_jobs", 0)),
                msgspec.convert(stats, PoolStats) if stats else None,
                _keys(report.get("runnable")),
                msgspec.convert(report.get("capabilities", {}), dict[str, str]),
                msgspec.convert(report.get("names", {}), dict[str, str]),
                msgspec.convert(report.get("identities", {}), dict[str, str]))


def _keys(value: Any) -> frozenset[str] | None:
    return None if value is None else frozenset(msgspec.convert(value, list[str]))


def serves_with_room(peer: Peer, key: str) -> bool:
    """The peer has the model loaded and could take more of its work now."""
    load = peer.models.get(key)
    return load is not None and load.ready > 0 and (load.idle > 0 or load.queued < load.ready)


def runs(peer: Peer, key: str) -> bool:
    """The peer serves the model or could start it now."""
    load = peer.models.get(key)
    return key in (peer.runnable or ()) or (load is not None and load.ready > 0)


def may_load_here(model: ModelState, peers: list[Peer], loading: int, max_loads: int,
                  used_mb: float, budget_mb: float, runnable_here: bool) -> bool:
    """Should this node take jobs of a model it has no worker for (and so start one)?
    Not when it cannot run the model at all (its device, its files, a failed load: the
    job would fail here when another node may run it), nor when a live peer serves it
    with room, nor without a load slot or memory, nor while its workers wait for the
    ONNX export they must run (the jobs stay in the shared queue for a node that can
    start now)."""
    if not runnable_here or any(serves_with_room(peer, model.key) for peer in peers):
        return False
    if loading >= max_loads or model.awaits_export_mb is not None:
        return False
    return memory.room_for(model.charge(), used_mb, budget_mb) > 0


def model_identity(spec: ModelSpec) -> str:
    """What decides a model's outputs: two nodes whose configs give one key different
    identities serve different models under one name."""
    return json.dumps([spec.capability, spec.source, spec.subdir, spec.loader, spec.options],
                      sort_keys=True, default=str)


def differing(identities: Mapping[str, str], peers: list[Peer]) -> dict[str, list[str]]:
    """The models this node and live peers both name but configure differently (source,
    loader, options): by key, those peers' names."""
    found: dict[str, list[str]] = {}
    for peer in peers:
        for key, theirs in peer.identities.items():
            if key in identities and theirs != identities[key]:
                found.setdefault(key, []).append(peer.name)
    return found


def model_elsewhere(name: str, peers: list[Peer]) -> RemoteModel | None:
    """The model a live peer that can run it knows by this name (its key or an alias)."""
    for peer in peers:
        key = peer.names.get(name.lower())
        if key is not None and runs(peer, key) and key in peer.capabilities:
            return RemoteModel(key, peer.capabilities[key])
    return None


def models_elsewhere(peers: list[Peer], here: Collection[str]) -> list[ModelInfo]:
    """The models live peers run or could, that this node's config does not name (here):
    listed beside its own, since requests for them are served through it."""
    found: dict[str, ModelInfo] = {}
    for peer in peers:
        for key, capability in peer.capabilities.items():
            if key in here or key in found or not runs(peer, key):
                continue
            aliases = sorted(name for name, named in peer.names.items()
                             if named == key and name != key.lower())
            found[key] = ModelInfo(key=key, capability=capability,  # type: ignore[arg-type]
                                   aliases=aliases, source=f"node {peer.name}",
                                   default=False, state="elsewhere")
    return list(found.values())


def stranded_since(waiting: Mapping[str, int], runnable_here: frozenset[str],
                   peers: list[Peer], since: Mapping[str, float],
                   now: float) -> dict[str, float]:
    """Since when each model with jobs waiting has had no live node, this one included,
    that could run it; a node too old to say what it can run might run anything."""
    return {key: since.get(key, now) for key, n in waiting.items()
            if n and key not in runnable_here
            and not any(peer.runnable is None or runs(peer, key) for peer in peers)}


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
        self.queued: dict[str, int] = {}
        # Models whose waiting jobs no live node can run, since when (scheduler time).
        self.stranded: dict[str, float] = {}
        specs = [model.spec for model in pool.models.values()]
        # What the beat says of this node's config, which does not change: made once.
        self.identities = {spec.key: model_identity(spec) for spec in specs}
        self.catalog = {"capabilities": {spec.key: spec.capability for spec in specs},
                        "names": {name.lower(): spec.key for spec in specs
                                  for name in (spec.key, *spec.aliases)},
                        "identities": self.identities}
        # Models some live peers configure otherwise than this node, and who they are.
        self.differs: dict[str, list[str]] = {}

    def may_load(self, key: str) -> bool:
        model = self.pool.models[key]
        models = list(self.pool.models.values())
        loading = sum(w.state in LOADING for m in models for w in m.processes())
        device = model.device or "cpu"
        return may_load_here(model, self.peers, loading, self.pool.config.pool.max_concurrent_loads,
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
        return (any(serves_with_room(peer, key) for peer in self.peers)
                or (key not in self.runnable_here and self.runs_elsewhere(key)))

    def runs_elsewhere(self, key: str) -> bool:
        """A live peer serves the model or could start it now."""
        return self.reachable and any(runs(peer, key) for peer in self.peers)

    def models_elsewhere(self) -> list[ModelInfo]:
        return models_elsewhere(self.peers, self.pool.models) if self.reachable else []

    def elsewhere(self, name: str) -> RemoteModel | None:
        """A model this node's config does not name that a live peer can run."""
        return model_elsewhere(name, self.peers) if self.reachable else None

    def runnable(self) -> list[str]:
        """The models this node could run now, for its peers."""
        return [key for key, model in self.pool.models.items()
                if self.pool.intake.local_refusal(model) is None]

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
        self.peers = [_peer(row) for row in rows]
        self.stranded = stranded_since(self.queued, self.runnable_here, self.peers,
                                       self.stranded, self.pool.scheduler.now())
        self._note_differences(differing(self.identities, self.peers))

    def _note_differences(self, differs: dict[str, list[str]]) -> None:
        """Said once in the log when it starts: their jobs and routed requests may run
        on either configuration, with different outputs."""
        for key, names in differs.items():
            new = sorted(set(names) - set(self.differs.get(key, [])))
            if new:
                log.warning("model %s is configured otherwise on %s than here (source, "
                            "loader or options): its jobs may run on either", key,
                            ", ".join(new))
        self.differs = differs

    async def end_stranded(self) -> None:
        """End the waiting jobs of models that no live node has been able to run for
        stranded_timeout_s: every accepted job gets an ending."""
        limit = self.pool.config.cluster.stranded_timeout_s
        now = self.pool.scheduler.now()
        for key, since in list(self.stranded.items()):
            if limit and now - since >= limit:
                ended = await self.jobs.end_stranded(
                    key, f": no live node could run model {key!r} for {limit:g}s "
                    "(stranded_timeout_s)")
                log.warning("%d waiting jobs of %s ended: no live node could run it for "
                            "%gs", ended, key, limit)
                del self.stranded[key]

    def stranded_ends_in(self) -> dict[str, float | None]:
        limit = self.pool.config.cluster.stranded_timeout_s
        now = self.pool.scheduler.now()
        return {key: round(max(0.0, since + limit - now), 1) if limit else None
                for key, since in self.stranded.items()}

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
                             queued_jobs=dict(self.queued), stranded=self.stranded_ends_in(),
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
    return service, cluster


async def keep_in_touch(cluster: ClusterNode, jobs: JobService) -> None:
    """Connect (and migrate the schema), then beat and tick once a second; a PostgreSQL
    that is down only delays this, with back-off, while the daemon serves on."""
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
