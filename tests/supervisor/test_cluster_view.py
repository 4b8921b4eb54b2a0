"""The cluster's pure decisions over its peers' beats: who serves a model with room or
could run it, whether this daemon should take jobs of a model it has not loaded (and so
load it), which models only others name, which jobs no live node can run, and which
keys two nodes configure otherwise (whose jobs each keeps to itself)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from modelpool.protocol.status import ModelLoad
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor.cluster_view import (
    Peer,
    alike,
    differing,
    jobs_of,
    may_load_here,
    model_elsewhere,
    model_identity,
    models_elsewhere,
    runs,
    serves_with_room,
    stranded_since,
    variant_of,
)

if TYPE_CHECKING:
    from conftest import Harness

MakeHarness = Callable[..., "Harness"]


def peer(**models: ModelLoad) -> Peer:
    return Peer(name="b", beat_s_ago=0.5, models=models, running_jobs=0)


def test_a_peer_serves_with_room_while_a_worker_idles_or_its_queue_is_short() -> None:
    assert serves_with_room(peer(m=ModelLoad(live=2, ready=2, idle=1, queued=0)), "m")
    assert serves_with_room(peer(m=ModelLoad(live=2, ready=2, idle=0, queued=1)), "m")
    assert not serves_with_room(peer(m=ModelLoad(live=2, ready=2, idle=0, queued=2)), "m")
    assert not serves_with_room(peer(m=ModelLoad(live=1, ready=0)), "m")  # still loading
    assert not serves_with_room(peer(), "m")


def test_a_model_served_elsewhere_with_room_is_not_loaded_here(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    model = h.pool.models["emb"]
    busy = peer(emb=ModelLoad(live=1, ready=1, idle=0, queued=5))
    roomy = peer(emb=ModelLoad(live=1, ready=1, idle=1))
    assert may_load_here(model, [busy], loading=0, max_loads=2, used_mb=0, budget_mb=1000,
                         runnable_here=True)
    assert not may_load_here(model, [roomy], loading=0, max_loads=2, used_mb=0,
                             budget_mb=1000, runnable_here=True)


def test_no_load_without_a_slot_or_memory_or_the_export_its_workers_need(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    model = h.pool.models["emb"]  # 10 MiB of weights and 10 a worker

    def may_load(loading: int, used_mb: float) -> bool:
        return may_load_here(model, [], loading=loading, max_loads=2, used_mb=used_mb,
                             budget_mb=1000, runnable_here=True)

    assert not may_load(loading=2, used_mb=0)
    assert not may_load(loading=0, used_mb=990)
    assert may_load(loading=1, used_mb=980)
    model.awaits_export_mb = 900.0  # forced to ONNX, its export still being made
    assert not may_load(loading=0, used_mb=0)


def test_a_model_this_node_cannot_run_is_left_to_the_peers_that_can(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    model = h.pool.models["emb"]
    assert not may_load_here(model, [], loading=0, max_loads=2, used_mb=0, budget_mb=1000,
                             runnable_here=False)
    assert runs(Peer(name="b", beat_s_ago=0.5, models={}, running_jobs=0,
                     runnable=frozenset({"emb"})), "emb")
    assert runs(peer(emb=ModelLoad(live=1, ready=1, idle=0, queued=9)), "emb")  # busy
    assert not runs(peer(emb=ModelLoad(live=1, ready=0)), "emb")  # loading, not runnable
    assert not runs(peer(), "emb")


def test_jobs_are_stranded_from_when_no_live_node_can_run_their_model() -> None:
    able = Peer(name="b", beat_s_ago=0.5, models={}, running_jobs=0, runnable=frozenset({"m"}))
    unable = Peer(name="c", beat_s_ago=0.5, models={}, running_jobs=0, runnable=frozenset())
    old = Peer(name="d", beat_s_ago=0.5, models={}, running_jobs=0)  # does not say
    m, n = ("m", None), ("n", None)
    waiting = {m: 3, n: 1, ("idle", None): 0}
    assert stranded_since(waiting, {}, [able, unable], {}, now=10.0) == {n: 10.0}
    assert stranded_since(waiting, {"n": "v"}, [able], {}, now=10.0) == {}
    # Since the first beat that saw it so, kept while it stays so, forgotten once not.
    since = stranded_since(waiting, {}, [unable], {n: 4.0}, now=10.0)
    assert since == {m: 10.0, n: 4.0}
    assert stranded_since(waiting, {}, [able], since, now=11.0) == {n: 4.0}
    assert stranded_since(waiting, {}, [old], since, now=11.0) == {}


def test_a_model_another_node_names_is_found_by_key_or_alias_while_it_can_run_it() -> None:
    def knows(runnable: set[str], served: dict[str, ModelLoad] | None = None) -> Peer:
        return Peer(name="b", beat_s_ago=0.5, models=served or {}, running_jobs=0,
                    runnable=frozenset(runnable), capabilities={"m": "text_embedding"},
                    names={"m": "m", "em": "m"}, identities={"m": "as b has it"})

    found = model_elsewhere("EM", [knows({"m"})])
    assert found is not None and (found.key, found.capability) == ("m", "text_embedding")
    assert found.variant == variant_of("as b has it")  # its jobs go to nodes like b
    assert model_elsewhere("m", [knows(set())]) is None  # it could not run it now
    assert model_elsewhere("m", [knows(set(), {"m": ModelLoad(live=1, ready=1)})])
    assert model_elsewhere("other", [knows({"m"})]) is None


def test_models_peers_run_are_listed_once_beside_this_nodes_own() -> None:
    def knows(name: str, runnable: set[str]) -> Peer:
        return Peer(name=name, beat_s_ago=0.5, models={}, running_jobs=0,
                    runnable=frozenset(runnable),
                    capabilities={"m": "text_embedding", "own": "text_embedding",
                                  "idle": "text_to_text"},
                    names={"m": "m", "em": "m", "own": "own", "idle": "idle"})

    listed = models_elsewhere([knows("b", {"m", "own"}), knows("c", {"m"})], here={"own"})
    assert [(m.key, m.aliases, m.source, m.state) for m in listed] == [
        ("m", ["em"], "node b", "elsewhere")]  # not "idle": no node can run it now


def test_a_model_one_key_names_differently_on_two_nodes_is_found() -> None:
    base = ModelSpec(key="m", capability="text_embedding", repo="org/m")
    same = model_identity(ModelSpec(key="m", capability="text_embedding", repo="org/m",
                                    aliases=["em"], max_workers=4, device="cpu"))
    assert same == model_identity(base)  # names and how it runs: the same outputs
    for other in (ModelSpec(key="m", capability="text_embedding", repo="org/m",
                            revision="v2"),
                  ModelSpec(key="m", capability="text_embedding", repo="org/m",
                            options={"pooling": "cls"}),
                  ModelSpec(key="m", capability="text_embedding", path="/models/m")):
        assert model_identity(other) != model_identity(base)

    def configures(name: str, **identities: str) -> Peer:
        return Peer(name=name, beat_s_ago=0.5, models={}, running_jobs=0,
                    identities=identities)

    here = {"m": "a", "n": "b"}
    peers = [configures("p", m="a", n="c"), configures("q", n="d", o="e")]
    assert differing(here, peers) == {"n": ["p", "q"]}


def test_local_files_are_known_by_their_content_and_the_rest_as_before() -> None:
    at_one = ModelSpec(key="m", capability="text_embedding", path="/srv/models/m")
    at_another = ModelSpec(key="m", capability="text_embedding", path="/data/m", aliases=["x"])
    assert model_identity(at_one, "c0ffee") == model_identity(at_another, "c0ffee")
    assert model_identity(at_one, "c0ffee") != model_identity(at_one, "decaf")
    assert model_identity(at_one, "c0ffee") != model_identity(  # how it is loaded still counts
        msgspec.structs.replace(at_one, options={"pooling": "cls"}), "c0ffee")
    # Without local files, as a node of the previous version says it: they stay alike.
    hub = ModelSpec(key="m", capability="text_embedding", repo="org/m",
                    options={"pooling": "cls"})
    assert model_identity(hub) == (
        '["text_embedding", "hub:org/m@main", "", null, {"pooling": "cls"}]')


def test_a_job_runs_only_where_its_model_is_configured_as_where_it_was_accepted() -> None:
    ours = model_identity(ModelSpec(key="m", capability="text_embedding", repo="org/m"))
    theirs = model_identity(ModelSpec(key="m", capability="text_embedding", repo="org/m",
                                      revision="v2"))
    mine, other = variant_of(ours), variant_of(theirs)
    assert mine != other and mine == variant_of(ours)  # the same on every node

    def configures(name: str, identities: dict[str, str]) -> Peer:
        return Peer(name=name, beat_s_ago=0.5, running_jobs=0, runnable=frozenset({"m"}),
                    models={"m": ModelLoad(live=1, ready=1, idle=1)}, identities=identities)

    like, unlike = configures("b", {"m": ours}), configures("c", {"m": theirs})
    old = configures("d", {})  # a node of a version that does not say: as before
    assert alike([like, unlike, old], "m", mine) == [like, old]
    assert alike([like, unlike, old], "m", other) == [unlike, old]
    assert alike([like, unlike, old], "m", None) == [like, unlike, old]  # an older job
    # Jobs of either variant wait: each is stranded only while no node like it lives.
    waiting = {("m", mine): 1, ("m", other): 2}
    assert stranded_since(waiting, {"m": mine}, [unlike], {}, now=5.0) == {}
    assert stranded_since(waiting, {"m": mine}, [], {}, now=5.0) == {("m", other): 5.0}
    assert stranded_since(waiting, {}, [like], {}, now=5.0) == {("m", other): 5.0}
    # Named so in status: another node's configuration of a key this node names.
    assert jobs_of("m", mine, {"m": mine}) == jobs_of("m", None, {"m": mine}) == "m"
    assert jobs_of("m", other, {"m": mine}) == f"m (as configured elsewhere, variant {other})"
    assert jobs_of("m", other, {}) == "m"  # a model only other nodes name
