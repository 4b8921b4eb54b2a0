"""The Responses API's kept responses: bounded in bytes (`[http] kept_responses_mib`),
shared by their owners, each one's least recently used dropped first; one that alone is
over the bound is never kept."""

from __future__ import annotations

import msgspec
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from modelpool.supervisor.config import ClusterConfig, Config, HttpConfig
from modelpool.supervisor.http_front import settings_of
from modelpool.supervisor.httpapi.app import Api
from modelpool.supervisor.httpapi.response_store import ResponseStore
from modelpool.supervisor.httpapi.response_store_pg import MemoryKept, PgKept
from modelpool.supervisor.httpapi.responses_in import ResponsesBody

BODY = ResponsesBody(input="hi")


def _turns(text: str) -> list[dict[str, str]]:
    return [{"type": "message", "role": "user", "content": text}]


def _size(text: str, response: dict[str, str]) -> int:
    return len(msgspec.json.encode(_turns(text))) + len(msgspec.json.encode(response))


def test_the_least_recently_used_are_dropped_for_a_new_one() -> None:
    response = {"id": "r"}
    store = ResponseStore(3 * _size("x" * 100, response))
    for name in "abc":
        assert store.keep(name, "A", _turns("x" * 100), BODY, response)
    assert len(store) == 3 and store.used == 3 * _size("x" * 100, response)
    assert store.get("a") is not None  # used: now the most recent
    assert store.keep("d", "A", _turns("x" * 100), BODY, response)
    assert store.get("b") is None and len(store) == 3
    assert [store.get(n) is not None for n in "acd"] == [True, True, True]
    assert store.keep("e", "A", _turns("x" * 250), BODY, response)  # as large as two
    assert [store.get(n) is not None for n in "acde"] == [False, False, True, True]
    assert store.used <= store.max_bytes


def test_an_owner_that_floods_the_store_drops_its_own_not_anothers() -> None:
    response = {"id": "r"}
    store = ResponseStore(4 * _size("x" * 100, response))
    assert store.keep("b1", "B", _turns("x" * 100), BODY, response)
    for index in range(10):
        assert store.keep(f"a{index}", "A", _turns("x" * 100), BODY, response)
    kept = [name for name in ["b1", *(f"a{i}" for i in range(10))] if store.get(name)]
    assert kept == ["b1", "a7", "a8", "a9"]
    assert store.keep("b2", "B", _turns("x" * 100), BODY, response)  # A holds more: A's go
    assert store.get("a7") is None and store.get("b1") is not None
    assert store.forget("b1") and store.forget("b2")
    assert store.used == 2 * _size("x" * 100, response) and len(store) == 2


def test_one_over_the_bound_is_never_kept_and_a_kept_one_is_replaced_or_forgotten() -> None:
    response = {"id": "r"}
    store = ResponseStore(_size("x" * 100, response) + len(msgspec.json.encode(BODY)))
    assert not store.fits(_turns("x" * store.max_bytes))
    assert not store.keep("big", "A", _turns("x" * store.max_bytes), BODY, response)
    assert len(store) == 0
    assert store.fits(_turns("x" * 10)) and store.keep("a", "A", _turns("x" * 10), BODY)
    kept = store.get("a")
    assert kept is not None and kept.response is None and kept.body is BODY
    assert store.keep("a", "A", _turns("x" * 100), BODY, response)  # its answer, once made
    assert len(store) == 1 and store.used == _size("x" * 100, response)
    replaced = store.get("a")
    assert replaced is not None and replaced.body is None  # the response echoes it
    assert store.forget("a") and not store.forget("a") and store.used == 0
    assert not ResponseStore(0).fits([])  # a bound of 0 keeps nothing


def test_the_bound_is_the_configs_and_metrics_show_what_is_kept() -> None:
    config = Config(http=HttpConfig(listen="127.0.0.1:8000", kept_responses_mib=2))
    settings = settings_of(config, "/s")
    assert settings.kept_responses_bytes == 2 * 2**20
    api = Api(settings)
    kept = api.responses.kept
    assert isinstance(kept, MemoryKept) and kept.store.max_bytes == 2 * 2**20
    kept.store.keep("r1", "A", _turns("x" * 100), BODY, {"id": "r1"})
    families = {f.name: f for f in text_string_to_metric_families(
        generate_latest(api.counters.registry).decode())}
    assert families["modelpool_http_kept_responses"].samples[0].value == 1
    assert (families["modelpool_http_kept_responses_bytes"].samples[0].value
            == _size("x" * 100, {"id": "r1"}))
    default = Config(http=HttpConfig(listen="127.0.0.1:8000"))
    assert settings_of(default, "/s").kept_responses_bytes == 64 * 2**20
    clustered = Config(http=HttpConfig(listen="127.0.0.1:8000"),
                       cluster=ClusterConfig(postgres="postgresql://db/mp"))
    assert settings_of(clustered, "/s").kept_responses_postgres == "postgresql://db/mp"
    assert isinstance(Api(settings_of(clustered, "/s")).responses.kept, PgKept)


def _items(*ids: str) -> list[dict[str, str]]:
    return [{"type": "message", "role": "user", "content": f"text of {i}", "id": i}
            for i in ids]


def test_input_items_are_found_by_id_for_their_owner_while_a_response_holds_them() -> None:
    store = ResponseStore(1 << 20)
    assert store.keep("r1", "A", _items("m1", "m2"), BODY, {"id": "r1"})
    assert store.keep("r2", "A", _items("m1", "m2", "m3"), BODY, {"id": "r2"})  # continued
    assert store.keep("r3", "B", _items("m1"), BODY, {"id": "r3"})  # B named one alike
    assert store.input_item("m2", "A") == _items("m2")[0]
    assert store.input_item("m1", "B") == _items("m1")[0]
    assert store.input_item("m3", "B") is None  # A's only
    assert store.input_item("nope", "A") is None
    assert store.forget("r2")
    assert store.input_item("m2", "A") is not None and store.input_item("m3", "A") is None
    assert store.forget("r1")
    assert store.input_item("m1", "A") is None and store.input_item("m1", "B") is not None
    assert store.keep("r3", "B", _items("m4"), BODY, {"id": "r3"})  # replaced
    assert store.input_item("m1", "B") is None and store.input_item("m4", "B") is not None
    twice = [*_items("m5"), {"type": "message", "role": "user", "content": "later", "id": "m5"}]
    assert store.keep("r4", "B", [*_items("m6"), *twice], BODY, {"id": "r4"})
    assert store.input_item("m5", "B") == twice[1]  # the last it holds
    assert store.forget("r4") and store.input_item("m5", "B") is None
    assert store._item_holders.keys() == {("B", "m4")}  # nothing of the others left
