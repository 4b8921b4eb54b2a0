"""A reload's plan: what changed between the running config and the new one, what
applies at once and what waits for a restart (pure; test_reload.py applies plans)."""

from __future__ import annotations

from typing import Any

import msgspec

from modelpool.registry.spec import ModelSpec, Registry
from modelpool.supervisor.config import (
    AccessConfig,
    ClusterConfig,
    Config,
    DaemonConfig,
    HttpConfig,
    JobsConfig,
    PoolConfig,
)
from modelpool.supervisor.reload import applied_config, plan_reload


def spec(key: str, capability: str = "text_embedding", **fields: Any) -> ModelSpec:
    fields.setdefault("path", f"/models/{key}")
    return ModelSpec(key=key, capability=capability, weights_mb=10, per_worker_mb=10, **fields)


def specs(*models: ModelSpec) -> dict[str, ModelSpec]:
    return Registry(list(models)).specs


# ---- the plan ---------------------------------------------------------------------------


def test_plan_sorts_each_model_by_what_changed() -> None:
    running = specs(spec("same"), spec("gone"), spec("files"), spec("limits"), spec("opts"))
    new = specs(spec("same"), spec("files", path="/elsewhere"), spec("limits", max_queue=5),
                spec("opts", options={"mark": 2}), spec("new"))
    plan = plan_reload(running, new, Config(), Config())
    assert plan.added == ("new",)
    assert plan.removed == ("gone",)
    assert plan.replaced == ("files", "opts")
    assert plan.retuned == ("limits",)
    assert plan.kept == () and plan.restart_for == ()
    assert [s.key for s in plan.specs] == ["same", "files", "limits", "opts", "new"]
    assert [s.key for s in plan.loading()] == ["files", "opts", "new"]
    assert plan.summary() == ("added: new; removed (serving what it has, then stopping): "
                              "gone; replaced (its workers, one at a time): files, opts; "
                              "updated: limits")


def test_plan_of_the_same_config_changes_nothing() -> None:
    running = specs(spec("a"), spec("b", aliases=["bee"]))
    plan = plan_reload(running, specs(spec("a"), spec("b", aliases=["bee"])), Config(), Config())
    assert (plan.added, plan.removed, plan.replaced, plan.retuned) == ((), (), (), ())
    assert plan.summary() == "no change"


def test_a_new_capability_or_what_a_shared_holder_loads_waits_for_a_restart() -> None:
    running = specs(spec("cap"), spec("held"), spec("held_limits"))
    new = specs(spec("cap", capability="text_to_text"), spec("held", path="/other"),
                spec("held_limits", max_batch=4))
    plan = plan_reload(running, new, Config(), Config(),
                       shared=frozenset({"held", "held_limits"}))
    assert [key for key, _ in plan.kept] == ["cap", "held"]
    assert "capability changed (text_embedding to text_to_text)" in plan.kept[0][1]
    assert plan.retuned == ("held_limits",)  # its holder shares the same weights still
    kept = {s.key: s for s in plan.specs}
    assert kept["cap"] == running["cap"] and kept["held"] == running["held"]


def test_a_removed_model_that_still_drains_comes_back_only_as_what_it_was() -> None:
    draining = specs(spec("back"), spec("other"))
    new = specs(spec("back", path="/elsewhere"), spec("other", capability="text_to_text"))
    plan = plan_reload({}, new, Config(), Config(), draining=draining)
    assert plan.added == ("back",)  # new to the registry; its workers are replaced
    assert [key for key, _ in plan.kept] == ["other"]  # its queue holds embeddings
    assert [s.key for s in plan.specs] == ["back"]


def test_changes_outside_models_are_named_for_the_next_start() -> None:
    new = Config(cluster=ClusterConfig(node_name="n2"), daemon=DaemonConfig(log_format="json"))
    plan = plan_reload(specs(spec("a")), specs(spec("a")), Config(), new)
    assert plan.restart_for == ("[daemon]", "[cluster]")
    assert plan.summary() == "changes of [daemon], [cluster] apply at the next start"


def test_a_change_of_access_pool_or_jobs_is_applied_not_left_for_a_restart() -> None:
    new = Config(access=AccessConfig(allow_users=["root"], max_priority="normal"),
                 pool=PoolConfig(max_batch=8), jobs=JobsConfig(timeout_s=5),
                 cluster=ClusterConfig(node_name="n2"))
    plan = plan_reload(specs(spec("a")), specs(spec("a")), Config(), new)
    assert plan.applied == ("[access]", "[pool]", "[jobs]")
    assert plan.restart_for == ("[cluster]",)
    assert plan.summary() == ("[access], [pool], [jobs] applied; changes of [cluster] "
                              "apply at the next start")
    assert plan_reload(specs(spec("a")), specs(spec("a")), new, new).applied == ()


def test_daemon_limits_log_level_realtime_and_group_apply_its_socket_waits() -> None:
    running = Config(daemon=DaemonConfig(socket="/run/a.sock"))
    limits = Config(daemon=DaemonConfig(socket="/run/b.sock", idle_timeout_s=5,
                                        log_level="DEBUG", max_client_buffer_bytes=4096,
                                        max_frame_bytes=4096, max_connections=7,
                                        realtime=True, socket_group="root"))
    plan = plan_reload({}, {}, running, limits)
    assert plan.applied == ("[daemon]",) and plan.restart_for == ("[daemon]",)
    applied = applied_config(running, limits).daemon
    assert (applied.idle_timeout_s, applied.log_level, applied.max_client_buffer_bytes,
            applied.max_frame_bytes, applied.max_connections, applied.realtime,
            applied.socket_group) == (5, "DEBUG", 4096, 4096, 7, True, "root")
    assert applied.socket == "/run/a.sock"  # the socket it serves on, until a restart
    for field, value in (("log_format", "json"), ("event_loop", "asyncio"),
                         ("idle_cgroup", False)):
        moved = Config(daemon=msgspec.structs.replace(running.daemon, **{field: value}))
        plan = plan_reload({}, {}, running, moved)
        assert (plan.applied, plan.restart_for) == ((), ("[daemon]",)), field


def test_cluster_routing_and_lease_apply_its_database_and_node_wait_for_a_restart() -> None:
    running = Config()
    routing = Config(cluster=ClusterConfig(route_remote=False, stranded_timeout_s=5,
                                           lease_s=5))
    plan = plan_reload({}, {}, running, routing)
    assert (plan.applied, plan.restart_for) == (("[cluster]",), ())
    assert applied_config(running, routing).cluster == routing.cluster
    for field, value in (("postgres", "postgresql://db/x"), ("node_name", "n2")):
        moved = Config(cluster=msgspec.structs.replace(running.cluster, **{field: value}))
        plan = plan_reload({}, {}, running, moved)
        assert (plan.applied, plan.restart_for) == ((), ("[cluster]",)), field


def test_every_http_field_applies_and_so_do_new_keys_in_its_key_file() -> None:
    running = Config(http=HttpConfig(listen="127.0.0.1:8000", api_keys=["a"]))
    keys = Config(http=HttpConfig(listen="127.0.0.1:8000", api_keys=["b"],
                                  max_priority="low", max_body_bytes=1024))
    plan = plan_reload(specs(spec("a")), specs(spec("a")), running, keys, http=True)
    assert plan.restart_for == () and plan.summary() == "[http] applied"
    for field, value in (("listen", "127.0.0.1:9000"), ("connections", 2),
                         ("max_clients", 8), ("in_loop", True), ("body_timeout_s", 5.0),
                         ("listen", "")):
        moved = Config(http=msgspec.structs.replace(running.http, **{field: value}))
        plan = plan_reload({}, {}, running, moved)
        assert (plan.applied, plan.restart_for) == (("[http]",), ()), field
        assert applied_config(running, moved).http == moved.http
    # The key file's keys changed, the config did not: the front door says so.
    assert plan_reload({}, {}, running, running, http=True).applied == ("[http]",)
    assert plan_reload({}, {}, running, running).summary() == "no change"
