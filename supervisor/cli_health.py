"""`modelpool health [MODEL] [--live | --ready] [--json]`: what an orchestrator's probes ask.

Liveness is the daemon's loop answering (a status round trip); readiness is that it
accepts work (it is not shutting down). A model that failed to load, or whose workers
are hung, makes the daemon *degraded*: still live and ready for every other model.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.supervisor.cli_common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNKNOWN_MODEL,
    EXIT_UNREACHABLE,
)

SubParsers = Any  # argparse's _SubParsersAction, which has no public name

OK, DEGRADED, NOT_READY, UNREACHABLE = "ok", "degraded", "not_ready", "unreachable"


@dataclass(frozen=True)
class Verdict:
    live: bool
    ready: bool
    state: str  # ok | degraded | not_ready | unreachable
    unhealthy: dict[str, str] = field(default_factory=dict)  # model key -> why
    detail: str = ""


def judge(status: dict[str, Any]) -> Verdict:
    """The daemon's health from its status: pure, for tests."""
    unhealthy = {m["key"]: m["health"] for m in status["models"] if m["health"] != "ok"}
    ready = not status["shutting_down"]
    state = NOT_READY if not ready else (DEGRADED if unhealthy else OK)
    active = sum(1 for m in status["models"] if m["workers"])
    detail = f"daemon pid {status['pid']}, {active} model(s) with workers"
    return Verdict(True, ready, state, unhealthy, detail)


def model_entry(status: dict[str, Any], models: list[dict[str, Any]],
                name: str) -> dict[str, Any]:
    """One model's state and health, found by key or alias."""
    info = next((m for m in models if name == m["key"] or name in m.get("aliases", [])), None)
    if info is None:
        raise PoolError(ErrorCode.UNKNOWN_MODEL, f"no model {name!r}")
    entry = next(m for m in status["models"] if m["key"] == info["key"])
    healthy = entry["health"] == "ok" and entry["state"] != "failed"
    return {"model": entry["key"], "healthy": healthy, "state": entry["state"],
            "health": entry["health"], "workers": len(entry["workers"]),
            "last_error": entry.get("last_error")}


def add_health_command(sub: SubParsers) -> None:
    health = sub.add_parser(
        "health", help="liveness, readiness and degraded models: exit 0 healthy, 1 not "
        "(degraded or not ready), 3 unreachable",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    health.add_argument("model", nargs="?", help="judge this model only: exit 0 if it "
                        "serves or can load, 1 if it failed, 4 if there is no such model")
    probe = health.add_mutually_exclusive_group()
    probe.add_argument("--live", action="store_true",
                       help="liveness only: exit 0 if the daemon's loop answers")
    probe.add_argument("--ready", action="store_true",
                       help="readiness only: exit 0 if it accepts work, degraded or not")
    health.add_argument("--json", action="store_true")
    health.set_defaults(func=_health)


def _health(args: argparse.Namespace) -> int:
    from modelpool.protocol.client import Client

    try:
        with Client(socket_path=args.socket, timeout_s=30) as client:
            status = client.status()
            models = client.models() if args.model else []
    except PoolError as exc:
        if exc.code is not ErrorCode.UNAVAILABLE:
            raise
        _say(args, {"live": False, "ready": False, "state": UNREACHABLE,
                    "error": exc.message}, f"unreachable: {exc.message}")
        return EXIT_UNREACHABLE
    if args.model:
        return _one_model(args, status, models)
    verdict = judge(status)
    report = {"live": verdict.live, "ready": verdict.ready, "state": verdict.state,
              "pid": status["pid"], "unhealthy": verdict.unhealthy}
    if args.live:
        _say(args, report, f"live: {verdict.detail}")
        return EXIT_OK
    if args.ready:
        _say(args, report, f"ready: {verdict.detail}" if verdict.ready
             else "not ready: the daemon is shutting down")
        return EXIT_OK if verdict.ready else EXIT_FAILED
    lines = [f"{verdict.state}: {key}: {why}" for key, why in verdict.unhealthy.items()]
    if not verdict.ready:
        lines.insert(0, "not_ready: the daemon is shutting down")
    _say(args, report, "\n".join(lines) or f"ok: {verdict.detail}")
    return EXIT_OK if verdict.state == OK else EXIT_FAILED


def _one_model(args: argparse.Namespace, status: dict[str, Any],
               models: list[dict[str, Any]]) -> int:
    try:
        entry = model_entry(status, models, args.model)
    except PoolError as exc:
        _say(args, {"model": args.model, "error": exc.message}, f"unknown: {exc.message}")
        return EXIT_UNKNOWN_MODEL
    word = "ok" if entry["healthy"] else "unhealthy"
    _say(args, entry, f"{word}: {entry['model']}: {entry['state']}, "
         f"{entry['workers']} worker(s), {entry['health']}")
    return EXIT_OK if entry["healthy"] else EXIT_FAILED


def _say(args: argparse.Namespace, report: dict[str, Any], text: str) -> None:
    print(json.dumps(report) if args.json else text)
