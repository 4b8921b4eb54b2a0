"""The CLI's request commands, one per row of the request-kind table: `modelpool embed`,
`generate`, `embed-image`, `describe`, `generate-image`, ...

Each command's arguments come from its row's client builder: parameters before `model`
are positional (a list one takes several values), keyword-only ones are flags
(`max_tokens` -> `--max-tokens`). What is printed depends on the kind of reply: arrays
as one JSON row per line, text as it streams, images to the file given with -o.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
import typing
from typing import Any

import msgspec

from modelpool.protocol.fields import PRIORITIES
from modelpool.protocol.kinds import KINDS, Kind
from modelpool.supervisor.cli_common import Stdin, from_stdin, on_terminal

SubParsers = Any  # argparse's _SubParsersAction, which has no public name


def add_request_commands(sub: SubParsers) -> None:
    for kind in KINDS:
        _add_command(sub, kind, job=False)


def add_submit_commands(sub: SubParsers) -> None:
    """`modelpool submit OP ARGS...`: the same commands, as jobs."""
    for kind in KINDS:
        _add_command(sub, kind, job=True)


def _add_command(sub: SubParsers, kind: Kind, job: bool) -> None:
    doc = inspect.getdoc(kind.build) or kind.op
    cmd = sub.add_parser(kind.op.replace("_", "-"), help=doc.splitlines()[0], description=doc)
    hints = typing.get_type_hints(kind.build)
    for param in inspect.signature(kind.build).parameters.values():
        hint = hints.get(param.name, str)
        if param.name == "model":
            cmd.add_argument("--model", help="model key or alias (default: the default "
                             "model of the capability)")
        elif param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            optional = param.default is not inspect.Parameter.empty
            nargs = "+" if _takes_many(hint) else ("?" if optional else None)
            cmd.add_argument(param.name, nargs=nargs,
                             default=param.default if optional else None)
        else:
            _add_flag(cmd, param, hint)
    if kind.reply == "image" and not job:
        cmd.add_argument("-o", "--output", required=True, help="PNG file to write")
    if kind.reply == "text" and job:
        cmd.add_argument("--stream", action="store_true", help="keep its text as it is "
                         "made: `modelpool follow KEY` prints it, live")
    cmd.add_argument("--json", action="store_true", help='print {"key": ...}' if job else
                     "JSON lines: one per row, chunk or step, then one for the end")
    cmd.add_argument("--priority", choices=PRIORITIES, default="normal")
    cmd.add_argument("--timeout", type=float, dest="timeout_s", help="seconds (default: "
                     "the daemon's timeout_s)")
    cmd.add_argument("--deadline", type=float, dest="deadline_s",
                     help="seconds from now; expired work is never started")
    cmd.add_argument("--tenant", default="", help="whose turn in the queues: requests "
                     "naming one tenant take one, whichever connection (up to 64 characters)")
    cmd.set_defaults(func=lambda args: (submit if job else run)(args, kind))


def _add_flag(cmd: argparse.ArgumentParser, param: inspect.Parameter, hint: Any) -> None:
    flag = "--" + param.name.replace("_", "-")
    if hint is bool:
        cmd.add_argument(flag, action="store_true", dest=param.name)
    elif typing.get_origin(hint) is typing.Literal:
        cmd.add_argument(flag, choices=typing.get_args(hint), default=param.default,
                         dest=param.name)
    elif _takes_many(hint):
        cmd.add_argument(flag, action="append", dest=param.name, help="may be repeated")
    else:
        cmd.add_argument(flag, type=_scalar(hint), default=param.default, dest=param.name)


def _takes_many(hint: Any) -> bool:
    """A list of texts, images, token ids ...: several values on the command line. A
    list of chat messages (dicts), or a prompt's token ids beside its text, is not
    something a command line gives."""
    lists = [h for h in (typing.get_args(hint) if _is_union(hint) else (hint,))
             if typing.get_origin(h) is list]
    return hint == list[int] or any(typing.get_args(h)[0] in (str, Any) for h in lists)


def _scalar(hint: Any) -> Any:
    if _is_union(hint):
        return next(h for h in typing.get_args(hint) if h is not type(None))
    return hint


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def run(args: argparse.Namespace, kind: Kind) -> None:
    from modelpool.protocol.client import Client

    with Client(socket_path=args.socket) as client:
        result = getattr(client, kind.op)(**_arguments(args, kind))
        if kind.reply == "array":
            print_rows(result)
        elif kind.reply == "text":
            print_text(result, args.json)
        elif kind.reply == "message":
            print(json.dumps({k: v for k, v in msgspec.to_builtins(result).items()
                              if k not in ("id", "op")}))
        else:
            write_image(result, args.output, args.json)


def submit(args: argparse.Namespace, kind: Kind) -> None:
    from modelpool.protocol.client import Client

    with Client(socket_path=args.socket) as client:
        key = client.submit(kind.op, stream=getattr(args, "stream", False),
                            **_arguments(args, kind))
    print(json.dumps({"key": key}) if args.json else key)


def _arguments(args: argparse.Namespace, kind: Kind) -> dict[str, Any]:
    stdin = Stdin()
    kwargs = {name: from_stdin(name, getattr(args, name), stdin)
              for name in inspect.signature(kind.build).parameters}
    kwargs.update(priority=args.priority, timeout_s=args.timeout_s, deadline_s=args.deadline_s,
                  tenant=args.tenant)
    return kwargs


def print_rows(array: Any) -> None:
    for row in array:
        value = [round(float(x), 7) for x in row] if getattr(row, "ndim", 0) else float(row)
        print(json.dumps(value))


def print_text(chunks: Any, as_json: bool = False) -> None:
    """The answer on stdout as it comes; a reasoning model's thinking on stderr (so that
    what a script reads is the answer)."""
    thinking = False
    for chunk in chunks:
        if as_json:
            print(json.dumps(_text_line(chunk)), flush=True)
            continue
        if chunk.reasoning:
            sys.stderr.write(chunk.reasoning)
            sys.stderr.flush()
            thinking = True
        if chunk.text and thinking:
            sys.stderr.write("\n")
            thinking = False
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        if chunk.finish_reason:
            print_text_end(chunk)


def _text_line(chunk: Any) -> dict[str, Any]:
    line: dict[str, Any] = {"text": chunk.text} if chunk.finish_reason is None else {
        "finish_reason": chunk.finish_reason, "prompt_tokens": chunk.prompt_tokens,
        "completion_tokens": chunk.completion_tokens}
    if getattr(chunk, "reasoning", ""):  # a reasoning model's thinking
        line["reasoning"] = chunk.reasoning
    for name in ("cached_tokens", "reasoning_tokens"):  # of the prompt's, of the output's
        if getattr(chunk, name, None):
            line[name] = getattr(chunk, name)
    if getattr(chunk, "calls", None):  # with --tool-choice auto: the calls as written
        line["calls"] = [{"index": d.index, **({"name": d.name, "id": d.id} if d.name else {}),
                          "arguments": d.arguments} for d in chunk.calls]
    if getattr(chunk, "tool_calls", None):
        line["tool_calls"] = _calls(chunk)
    for name in ("logprobs", "prompt_logprobs"):  # with --logprobs / --prompt-logprobs
        if getattr(chunk, name, None) is not None:
            line[name] = [{"token": e.token, "token_id": e.token_id, "logprob": e.logprob,
                           "top": {t.token: t.logprob for t in e.top}}
                          for e in getattr(chunk, name)]
    return line


def _calls(result: Any) -> list[dict[str, str]]:
    return [{"name": c.name, "arguments": c.arguments} for c in result.tool_calls or ()]


def print_text_end(result: Any) -> None:
    """The end of a text: a new line, each tool call the model made as a JSON line, and
    the counts on stderr."""
    sys.stdout.write("\n")
    for call in _calls(result):
        print(json.dumps(call))
    cached = getattr(result, "cached_tokens", None)
    thought = getattr(result, "reasoning_tokens", None)
    print(f"[{result.finish_reason}: {result.prompt_tokens} prompt "
          f"{f'({cached} cached) ' if cached else ''}+ {result.completion_tokens} generated "
          f"{f'({thought} thinking) ' if thought else ''}tokens]", file=sys.stderr)


def write_image(chunks: Any, output: str, as_json: bool = False) -> None:
    """Progress as a bar on a terminal (JSON lines with --json, else nothing), then the
    PNG to `output`."""
    bar = on_terminal() and not as_json
    for chunk in chunks:
        if chunk.png is None:
            if as_json:
                print(json.dumps({"step": chunk.step, "total_steps": chunk.total_steps}),
                      flush=True)
            elif bar:
                done = int(30 * chunk.step / max(1, chunk.total_steps))
                print(f"\r[{'#' * done}{'.' * (30 - done)}] step {chunk.step}/"
                      f"{chunk.total_steps}", end="", file=sys.stderr, flush=True)
            continue
        with open(output, "wb") as out:
            out.write(chunk.png)
        if as_json:
            print(json.dumps({"output": output, "width": chunk.width, "height": chunk.height,
                              "seed": chunk.seed}))
        else:
            after_bar = "\n" if bar else ""
            print(f"{after_bar}wrote {output} ({chunk.width}x{chunk.height}, "
                  f"seed {chunk.seed})", file=sys.stderr)
