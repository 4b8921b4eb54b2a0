"""The `modelpool` command: run the daemon, or talk to it."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from modelpool.protocol.errors import PoolError
from modelpool.supervisor import cli_common
from modelpool.supervisor.cli_health import add_health_command, model_entry
from modelpool.supervisor.cli_jobs import add_job_commands
from modelpool.supervisor.cli_models import add_model_commands
from modelpool.supervisor.cli_ops import add_request_commands
from modelpool.supervisor.cli_service import add_service_command


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return code
    except PoolError as exc:
        return cli_common.report(exc, getattr(args, "json", False))
    except BrokenPipeError:
        return cli_common.quiet_broken_pipe()
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelpool", description=__doc__,
                                     epilog=cli_common.EXIT_CODES_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"modelpool {_version()}")
    socket_help = ("daemon socket (default: $MODELPOOL_SOCKET, $XDG_RUNTIME_DIR/modelpool.sock, "
                   "or /tmp/modelpool-$USER/); also accepted after the command")
    parser.add_argument("--socket", help=socket_help)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--config", help="TOML config (default: $MODELPOOL_CONFIG, else built-in)")
    serve.add_argument("--http", metavar="HOST:PORT",
                       help="serve the OpenAI-compatible HTTP API there ([http] listen)")
    serve.set_defaults(func=_serve)
    add_request_commands(sub)
    add_job_commands(sub)
    _admin_commands(sub)
    add_service_command(sub)
    add_model_commands(sub)
    cli_common.add_after_subcommands(parser, "--socket", help=socket_help)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("modelpool")
    except PackageNotFoundError:
        return "unknown (not installed)"


SubParsers = Any  # argparse's _SubParsersAction, which has no public name


def _admin_commands(sub: SubParsers) -> None:
    for name, helptext, func in (("status", "pool state", _status),
                                 ("models", "known models and their state", _models)):
        cmd = sub.add_parser(name, help=helptext)
        cmd.add_argument("--json", action="store_true")
        cmd.set_defaults(func=func)

    add_health_command(sub)

    load = sub.add_parser("load", help="start a model's workers now")
    load.add_argument("model")
    load.add_argument("--workers", type=int, default=1)
    load.add_argument("--json", action="store_true")
    load.set_defaults(func=lambda a: _ack(a, lambda c: c.load(a.model, a.workers)))
    unload = sub.add_parser("unload", help="stop a model's workers")
    unload.add_argument("model")
    unload.add_argument("--json", action="store_true")
    unload.set_defaults(func=lambda a: _ack(a, lambda c: c.unload(a.model)))
    reload = sub.add_parser("reload", help="read the config again and apply what can be")
    reload.set_defaults(func=lambda a: _ack(a, lambda c: c.reload()))
    stop = sub.add_parser("stop", help="stop the daemon gracefully")
    stop.set_defaults(func=lambda a: _ack(a, lambda c: c.stop()))


def _ignore_working_directory() -> None:
    """Nothing in the directory the daemon was started from may shadow a module, in the
    daemon or in its workers (a stray queue.py there once broke every worker start, and
    would run its code in each). The forkserver is a `python -c` child, whose sys.path
    would start with its working directory: PYTHONSAFEPATH tells it not to."""
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", ".", cwd)]
    os.environ["PYTHONSAFEPATH"] = "1"


def _client(args: argparse.Namespace) -> Any:
    from modelpool.protocol.client import Client

    return Client(socket_path=args.socket)


def _serve(args: argparse.Namespace) -> int:
    _ignore_working_directory()
    import logging

    import msgspec

    from modelpool.protocol import logs
    from modelpool.supervisor import eventloop
    from modelpool.supervisor.activation import ActivationError
    from modelpool.supervisor.config import Config, ConfigError, load_config
    from modelpool.supervisor.server import serve
    from modelpool.supervisor.socket_dir import AlreadyRunning, UnsafeSocketDir
    from modelpool.supervisor.startcheck import check_models

    def read_config() -> tuple[Config, list[str]]:
        """At start, and again at each reload: the file with the command line's say."""
        config = load_config(args.config)
        warnings = check_models(config)
        if args.socket:
            config = msgspec.structs.replace(
                config, daemon=msgspec.structs.replace(config.daemon, socket=args.socket))
        if args.http:
            config = msgspec.structs.replace(
                config, http=msgspec.structs.replace(config.http, listen=args.http))
        return config, warnings

    try:
        config, warnings = read_config()
    except ConfigError as exc:
        print(f"modelpool: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.daemon.log_level.upper(), config.daemon.log_format)
    logs.hand_down(config.daemon.log_level.upper(), config.daemon.log_format)  # to workers
    for warning in warnings:
        logging.getLogger("modelpool.config").warning("%s", warning)
    try:
        eventloop.run(serve(config, read_config), config.daemon.event_loop)
    except ConfigError as exc:
        print(f"modelpool: {exc}", file=sys.stderr)
        return 2
    except (AlreadyRunning, UnsafeSocketDir, ActivationError) as exc:
        print(f"modelpool: {exc}", file=sys.stderr)
        return 1
    return eventloop.exit_without_teardown(0)


def _status(args: argparse.Namespace) -> None:
    with _client(args) as client:
        status = client.status()
    if args.json:
        print(json.dumps(status, indent=2))
        return
    print(f"{'MODEL':<42} {'CAPABILITY':<15} {'STATE':<9} {'QUEUED':>6} {'RUNNING':>7}  WORKERS")
    for model in status["models"]:
        print("\n".join(_model_text(model)))
    mem = status["memory"]
    print(f"memory: {mem['used_mb']:.0f} MiB charged of a {mem['budget_mb']:.0f} MiB budget "
          f"({mem['available_mb']:.0f} MiB available); daemon pid {status['pid']}, "
          f"up {status['uptime_s']:.0f}s")
    if status.get("cluster"):
        _print_cluster(status["cluster"], [m["key"] for m in status["models"]])


def _model_text(model: dict[str, Any]) -> list[str]:
    """A model's row of the status table, and the lines under it."""
    workers = ", ".join(_worker_text(w) for w in model["workers"]) or "-"
    lines = [f"{model['key']:<42} {model['capability']:<15} {model['state']:<9} "
             f"{model['queued']:>6} {model['running']:>7}  {workers}"]
    if model.get("loading"):
        lines.append(f"    {model['loading']}")
    forced = model["state"] == "exporting"  # forced to ONNX: no eager PyTorch meanwhile
    meanwhile = ("its workers start once it is made" if forced
                 else "eager PyTorch serves meanwhile")
    if model.get("export_waits_for_mb") is not None:
        lines.append(f"    ONNX export waits for ~{model['export_waits_for_mb']:.0f} MiB of the "
                     f"memory budget; {meanwhile}")
    elif model.get("exporting") or any("onnx_export" in (w.get("info") or {})
                                       for w in model["workers"]):
        lines.append(f"    ONNX export made in the background; {meanwhile}")
    replacing = [w for w in model["workers"] if w.get("replacing")]
    if replacing:
        lines.append(f"    replacing {len(replacing)} worker(s), one at a time as memory "
                     f"allows: {replacing[0]['replacing']}")
    if model.get("recommended"):
        lines.append("    unless a request sets them: " + ", ".join(
            f"{name} {value}" for name, value in model["recommended"].items())
                     + " (its generation_config.json)")
    if model.get("tokens_per_s") is not None:
        lines.append(f"    generating: {model['tokens_per_s']:.1f} tokens/s")
    if model["health"] != "ok":
        lines.append(f"    health: {model['health']}")
    elif model.get("last_error"):
        lines.append(f"    last error: {model['last_error']}")
    return lines


def _worker_text(worker: dict[str, Any]) -> str:
    """"4101:busy 2 threads 3/16 seq": pid, state ("idle silent": late, given no work),
    the intra-op threads it last reported (adaptive workers change them with load) and,
    for a worker that batches streams, its active sequences of its maximum."""
    text = f"{worker['pid']}:{worker['state']}" + (" silent" if worker.get("late") else "")
    threads = worker.get("threads")
    if threads:
        text += f" {threads} thread" + ("s" if threads > 1 else "")
    if worker.get("max_sequences") is not None:
        text += f" {worker['sequences']}/{worker['max_sequences']} seq"
    return text


def _print_cluster(cluster: dict[str, Any], keys: list[str]) -> None:
    """keys: this daemon's models; each node's line names those it cannot run and
    another node can (their work goes there)."""
    reach = "" if cluster["reachable"] else " (its PostgreSQL is unreachable)"
    print(f"cluster: this node is {cluster['node']}{reach}")
    runnable = {node["name"]: set(node["runnable"]) for node in cluster["nodes"]
                if node.get("runnable") is not None}
    for node in cluster["nodes"]:
        models = ", ".join(f"{key} {m['ready']}/{m['live']} ready, {m['queued']} queued"
                           for key, m in node["models"].items()) or "nothing loaded"
        mine = runnable.get(node["name"])
        unable = [key for key in keys if mine is not None and key not in mine
                  and any(key in theirs for theirs in runnable.values())]
        cannot = f"; cannot run {', '.join(unable)}, which others can" if unable else ""
        print(f"  {node['name']:<20} beat {node['beat_s_ago']:.1f}s ago, "
              f"{node['running_jobs']} running: {models}{cannot}")
    waiting = ", ".join(f"{k}: {n}" for k, n in cluster["queued_jobs"].items()) or "none"
    print(f"  jobs waiting in the shared queue: {waiting}")
    for key, nodes in cluster.get("differs", {}).items():
        print(f"  {key} is configured otherwise on {', '.join(nodes)} than here (its files, "
              "source, loader or options): each runs only its own jobs of it")
    for key, ends_in in cluster.get("stranded", {}).items():
        fate = "wait for one" if ends_in is None else f"end in {ends_in:.0f}s unless one comes"
        print(f"  no live node can run {key}: its jobs {fate}")


def _models(args: argparse.Namespace) -> None:
    with _client(args) as client:
        models = client.models()
    if args.json:
        print(json.dumps(models, indent=2))
        return
    for m in models:
        mark = "*" if m["default"] else " "
        print(f"{mark} {m['key']:<42} {m['capability']:<15} {m['state']:<9} {m['source']}")


def _ack(args: argparse.Namespace, call: Any) -> None:
    with _client(args) as client:
        message = call(client)
        if not getattr(args, "json", False):
            print(message)
            return
        entry = model_entry(client.status(), client.models(), args.model)
        print(json.dumps({"message": message, **entry}))


if __name__ == "__main__":
    sys.exit(main())
