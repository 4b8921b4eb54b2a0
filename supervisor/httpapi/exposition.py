"""GET /metrics: the daemon's status and totals in Prometheus' text format, written by
prometheus_client from one status snapshot per scrape (the pool keeps the counts; this
only names them)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from modelpool.supervisor.httpapi.response_store_pg import MemoryKept, PgKept

MB = 1024 * 1024
WORKER_STATES = ("starting", "loading", "idle", "busy", "holding", "stopping")


class HttpCounters:
    """What the HTTP front door itself counts."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("modelpool_http_requests", "HTTP requests answered",
                                ["path", "status"], registry=self.registry)
        self.kept = Gauge("modelpool_http_kept_responses", "Responses API responses kept "
                          "(for previous_response_id)", registry=self.registry)
        self.kept_bytes = Gauge("modelpool_http_kept_responses_bytes", "Their size as JSON, "
                                "within [http] kept_responses_mib", registry=self.registry)

    def watch(self, kept: MemoryKept | PgKept) -> None:
        """The kept responses' count and bytes, read at each scrape (in PostgreSQL, the
        whole cluster's as last seen by this front door)."""
        self.kept.set_function(lambda: kept.count)
        self.kept_bytes.set_function(lambda: kept.used)


class StatusCollector(Collector):
    def __init__(self, status: dict[str, Any]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        yield from _daemon(self.status)
        models = self.status["models"]
        yield from _per_model(models)
        yield from _workers(models)
        yield from _requests(models)
        yield from _histograms(models)


def exposition(status: dict[str, Any], counters: HttpCounters) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(status))
    return generate_latest(registry) + generate_latest(counters.registry)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _daemon(status: dict[str, Any]) -> Iterator[Metric]:
    memory = status["memory"]
    yield _gauge("modelpool_up", "1 while the daemon answers", 1)
    yield _gauge("modelpool_shutting_down", "1 while the daemon drains",
                 int(status["shutting_down"]))
    yield _gauge("modelpool_uptime_seconds", "Seconds since the daemon started",
                 status["uptime_s"])
    yield _gauge("modelpool_memory_budget_bytes", "Memory the pool may use",
                 memory["budget_mb"] * MB)
    yield _gauge("modelpool_memory_used_bytes", "Memory charged to models",
                 memory["used_mb"] * MB)
    yield _gauge("modelpool_memory_available_bytes", "Memory the machine has available",
                 memory["available_mb"] * MB)
    if status.get("clients"):
        yield _gauge("modelpool_client_connections", "Clients connected to the socket",
                     status["clients"]["connections"])


def _per_model(models: list[dict[str, Any]]) -> Iterator[Metric]:
    families = {
        "queued": GaugeMetricFamily("modelpool_queue_depth", "Requests waiting",
                                    labels=["model"]),
        "running": GaugeMetricFamily("modelpool_requests_running", "Requests running",
                                     labels=["model"]),
        "memory_mb": GaugeMetricFamily("modelpool_model_memory_bytes",
                                       "Memory charged to the model", labels=["model"]),
    }
    totals = {
        "loads": CounterMetricFamily("modelpool_model_loads", "Workers that finished "
                                     "loading the model", labels=["model"]),
        "load_failures": CounterMetricFamily("modelpool_model_load_failures",
                                             "Failed loads", labels=["model"]),
        "worker_deaths": CounterMetricFamily("modelpool_worker_restarts", "Serving "
                                             "workers that exited unasked (and were "
                                             "replaced)", labels=["model"]),
        "prompt_tokens": CounterMetricFamily("modelpool_prompt_tokens", "Prompt tokens "
                                             "of the streams answered", labels=["model"]),
        "cached_tokens": CounterMetricFamily("modelpool_prompt_tokens_cached", "Prompt "
                                             "tokens taken from the prefix cache",
                                             labels=["model"]),
        "completion_tokens": CounterMetricFamily("modelpool_generation_tokens", "Tokens "
                                                 "generated in the streams answered",
                                                 labels=["model"]),
        "reasoning_tokens": CounterMetricFamily("modelpool_generation_tokens_reasoning",
                                                "Generated tokens a reasoning model "
                                                "thought", labels=["model"]),
    }
    ready = GaugeMetricFamily("modelpool_model_ready", "1 if the model serves",
                              labels=["model", "state"])
    for model in models:
        key = model["key"]
        for field, family in families.items():
            value = model[field] * MB if field == "memory_mb" else model[field]
            family.add_metric([key], value)
        ready.add_metric([key, model["state"]], int(model["state"] == "ready"))
        for field, family in totals.items():
            family.add_metric([key], (model.get("totals") or {}).get(field, 0))
    yield from families.values()
    yield from totals.values()
    yield ready


def _workers(models: list[dict[str, Any]]) -> Iterator[Metric]:
    family = GaugeMetricFamily("modelpool_workers", "Worker processes by state",
                               labels=["model", "state"])
    for model in models:
        counts = dict.fromkeys(WORKER_STATES, 0)
        for worker in model["workers"]:
            counts[worker["state"]] = counts.get(worker["state"], 0) + 1
        for state, count in counts.items():
            family.add_metric([model["key"], state], count)
    yield family


def _requests(models: list[dict[str, Any]]) -> Iterator[Metric]:
    requests = CounterMetricFamily("modelpool_requests", "Requests ended, by outcome "
                                   "(OK or the error code)",
                                   labels=["model", "operation", "priority", "code"])
    batches = CounterMetricFamily("modelpool_batches", "Batches sent to workers",
                                  labels=["model"])
    for model in models:
        totals = model.get("totals") or {}
        for op, priority, code, count in totals.get("outcomes", []):
            requests.add_metric([model["key"], op, priority, code], count)
        batch = totals.get("batch_size")
        batches.add_metric([model["key"]], batch["count"] if batch else 0)
    yield requests
    yield batches


def _histograms(models: list[dict[str, Any]]) -> Iterator[Metric]:
    latency = HistogramMetricFamily(
        "modelpool_request_duration_seconds", "From acceptance to the final reply",
        labels=["model", "operation"])
    wait = HistogramMetricFamily("modelpool_queue_wait_seconds",
                                 "From acceptance to a worker", labels=["model"])
    size = HistogramMetricFamily("modelpool_batch_size", "Inputs per batch",
                                 labels=["model"])
    for model in models:
        totals = model.get("totals") or {}
        for op, histogram in totals.get("latency_s", {}).items():
            _add(latency, [model["key"], op], histogram)
        if totals.get("queue_wait_s"):
            _add(wait, [model["key"]], totals["queue_wait_s"])
        if totals.get("batch_size"):
            _add(size, [model["key"]], totals["batch_size"])
    yield latency
    yield wait
    yield size


def _add(family: HistogramMetricFamily, labels: list[str], histogram: dict[str, Any]) -> None:
    buckets = [(_le(bound), count) for bound, count in zip(histogram["bounds"],
                                                           histogram["counts"], strict=True)]
    buckets.append(("+Inf", histogram["count"]))
    family.add_metric(labels, buckets, sum_value=histogram["sum"])


def _le(bound: float) -> str:
    return str(float(bound))
