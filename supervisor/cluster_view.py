"""What a node of the cluster knows of the other live nodes (their beats) and the pure
decisions it makes from that: who serves a model with room or could run it, whether to
load a model here, which models only others name, which jobs no live node can run, and
which keys two nodes configure otherwise.

A model's *variant* is a digest of what decides its outputs (model_identity): a job
carries the variant of the configuration that accepted it, and only nodes that
configure its model alike claim it, so one key configured otherwise on two nodes never
serves one's jobs with the other's model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgspec

from modelpool.protocol.jobs import PoolStats
from modelpool.protocol.messages import ModelInfo
from modelpool.protocol.status import ModelLoad
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor import memory
from modelpool.supervisor.admission import RemoteModel
from modelpool.supervisor.models import ModelState


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

    @cached_property
    def variants(self) -> dict[str, str]:
        """Each model of its config: its variant (made once per beat, not per look)."""
        return {key: variant_of(identity) for key, identity in self.identities.items()}

    def variant(self, key: str) -> str | None:
        """The variant of the model it configures under this key (None: it names no
        such model, or is of a version that does not say)."""
        return self.variants.get(key)


def peer_from_row(row: dict[str, Any]) -> Peer:
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


def variant_of(identity: str) -> str:
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def alike(peers: list[Peer], key: str, variant: str | None) -> list[Peer]:
    """The peers that would run a job of this model and variant as it was meant: those
    that configure the key alike, or do not say how (a node of an older version). A
    job of no variant (an older node's) may run anywhere."""
    return [peer for peer in peers
            if variant is None or peer.variant(key) in (None, variant)]


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


def model_identity(spec: ModelSpec, content: str | None = None) -> str:
    """What decides a model's outputs: two nodes whose configs give one key different
    identities serve different models under one name. Its files by their content where
    this node has it (registry/content.py: a path or a package, at any place), else
    where they come from (a hub repo and revision, a custom loader)."""
    files = [f"content:{content}", ""] if content else [spec.source, spec.subdir]
    return json.dumps([spec.capability, *files, spec.loader, spec.options],
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
    """The model a live peer that can run it knows by this name (its key or an alias),
    as that peer configures it."""
    for peer in peers:
        key = peer.names.get(name.lower())
        if key is not None and runs(peer, key) and key in peer.capabilities:
            return RemoteModel(key, peer.capabilities[key], peer.variant(key))
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


Waiting = tuple[str, str | None]  # the jobs of a model and variant


def jobs_of(key: str, variant: str | None, variants: Mapping[str, str]) -> str:
    """The model whose jobs these are, as this node (its variants) says it: by its key,
    and when it configures that key otherwise than they were accepted, which variant."""
    if variant is None or variants.get(key, variant) == variant:
        return key
    return f"{key} (as configured elsewhere, variant {variant})"


def stranded_since(waiting: Mapping[Waiting, int], runnable_here: Mapping[str, str],
                   peers: list[Peer], since: Mapping[Waiting, float],
                   now: float) -> dict[Waiting, float]:
    """Since when the waiting jobs of each model and variant have had no live node, this
    one included (runnable_here: the models it could run, with their variants), that
    could run them; a node too old to say what it can run might run anything."""
    def runnable(key: str, variant: str | None) -> bool:
        if key in runnable_here and variant in (None, runnable_here[key]):
            return True
        return any(peer.runnable is None or runs(peer, key)
                   for peer in alike(peers, key, variant))

    return {job: since.get(job, now) for job, n in waiting.items()
            if n and not runnable(*job)}
