"""A worker started in a fresh interpreter instead of forked from the forkserver: while
the forkserver still imports what other models need (torch and transformers for an LLM
configured beside an embedding model on ONNX: seconds), a worker that needs none of it
starts at once. It does first what the forkserver does before forking one."""

from __future__ import annotations

import socket


def run_fresh_worker(settings: bytes, work: socket.socket, beat: socket.socket) -> None:
    import modelpool.workers.preload  # environment and log format, as in the forkserver
    import modelpool.workers.preloaded  # noqa: F401  (idle priority while it starts)
    from modelpool.workers.main import run_worker

    run_worker(settings, work, beat)
