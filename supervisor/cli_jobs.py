"""The CLI's job commands: `modelpool submit OP ARGS...`, `result KEY`, `follow KEY`,
`jobs`, `stats`.

With the in-memory backend (the default) jobs and their results live in the daemon's
memory: they are gone when it stops.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any

from modelpool.supervisor.cli_ops import (
    add_submit_commands,
    print_rows,
    print_text,
    print_text_end,
    write_image,
)

SubParsers = Any  # argparse's _SubParsersAction, which has no public name
KEPT = ("with the default in-memory backend, jobs and results are kept in the daemon's "
        "memory only: they are lost when it stops ([cluster] postgres keeps them in "
        "PostgreSQL, shared by every daemon of the cluster)")


def add_job_commands(sub: SubParsers) -> None:
    submit = sub.add_parser("submit", help="hand a request over as a job; prints its key",
                            description=f"Submit OP as a job and print its key; {KEPT}.")
    add_submit_commands(submit.add_subparsers(dest="op", required=True, metavar="OP"))

    result = sub.add_parser("result", help="a job's result (as the direct command prints it)")
    result.add_argument("key")
    result.add_argument("--wait", type=float, default=30.0, metavar="S",
                        help="seconds to wait for a job still running (default 30)")
    result.add_argument("-o", "--output", help="PNG file for a generate-image job's image")
    result.set_defaults(func=_result)

    follow = sub.add_parser(
        "follow", help="a generate or describe job's text as it is made",
        description="A generate or describe job's text, from its start, as `generate` "
                    "prints it: live while it runs if it was submitted with --stream, "
                    "else whole once it has ended. Leaving (Ctrl-C) does not stop the job.")
    follow.add_argument("key")
    follow.add_argument("--json", action="store_true",
                        help="JSON lines: one per chunk, then one for the end")
    follow.set_defaults(func=_follow)

    jobs = sub.add_parser("jobs", help="your recent jobs and their states",
                          description=f"Your recent jobs, newest first; {KEPT}.")
    jobs.add_argument("--limit", type=int, default=50)
    jobs.add_argument("--json", action="store_true")
    jobs.set_defaults(func=_jobs)

    stats = sub.add_parser("stats", help="workers, jobs, memory, completed and failed counts")
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(func=_stats)


def _client(args: argparse.Namespace) -> Any:
    from modelpool.protocol.client import Client

    return Client(socket_path=args.socket)


def _result(args: argparse.Namespace) -> int:
    from modelpool.protocol.client import ImageChunk, TextResult

    with _client(args) as client:
        result = client.retrieve(args.key, timeout_s=args.wait)
    if isinstance(result, TextResult):
        if result.reasoning:  # a reasoning model's thinking: stderr, as generate's
            print(result.reasoning, file=sys.stderr)
        sys.stdout.write(result.text)
        print_text_end(result)
    elif isinstance(result, ImageChunk):
        if not args.output:
            print("modelpool: the result is an image: give -o FILE.png", file=sys.stderr)
            return 2
        write_image([result], args.output)
    else:
        print_rows(result)
    return 0


def _follow(args: argparse.Namespace) -> None:
    with _client(args) as client:
        print_text(client.follow(args.key), args.json)


def _jobs(args: argparse.Namespace) -> None:
    with _client(args) as client:
        jobs = client.jobs(limit=args.limit)
    if args.json:
        print(json.dumps(jobs, indent=2))
        return
    print(f"{'KEY':<24} {'OP':<15} {'STATE':<10} {'SUBMITTED':<20} MODEL")
    for job in jobs:
        when = datetime.datetime.fromtimestamp(job["submitted_at"]).strftime("%Y-%m-%d %H:%M:%S")
        print(f"{job['key']:<24} {job['op']:<15} {job['state']:<10} {when:<20} {job['model']}")
        if job.get("error_code"):
            print(f"    {job['error_code']}: {job['error_message']}")


def _stats(args: argparse.Namespace) -> None:
    with _client(args) as client:
        stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return
    for name, value in stats.items():
        print(f"{name:<18} {value}")
