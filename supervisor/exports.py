"""ONNX exports made in the background, so that a model's first request never waits for
one.

The daemon makes each export a model lacks once, in a process of its own at idle CPU
priority (serving comes first): from its start for models whose files are on this
machine, else when a worker names it. Meanwhile the model serves eager PyTorch: a worker
that found no export loads eager and its Ready info names the export (`onnx_export`: the
cache entry and the model's files, registry/loaders/encoder_exec.py). When the export
is the better runtime (its outputs match eager PyTorch's and it is faster), those
workers are marked `outdated` and the scaling policy replaces them one at a time
(scaling.plan_replacements), each new one loading the export; a model's first worker
that starts after it loads the export at once. Otherwise (slower, other vectors, a
failed export) the workers keep serving eager and their status says why. An export is
tried once per daemon, and one runs at a time, when the memory budget has room for its
expected peak (onnx_cache.export_peak_mb: the bundled model's peaked at 780 MiB
resident). It never evicts a worker, and it yields to one: while it runs its peak is
charged against the budget (`Capacity.used_mb`, so that it is not taken for outside
pressure), but the scaling policy plans as if it were free, and a worker start that
needs that memory stops the export, which waits for room again (Plan.stop_export).

A model forced to ONNX (execution = "onnx") has no eager PyTorch to serve meanwhile: the
daemon makes its export the same way and no worker of it starts until the export ends
(ModelState.awaits_export_mb, which the scaling policy reads), so that no worker makes
it inside its own load, uncharged. A worker that finds none anyway (a hub model whose
files it has just downloaded) hands it over (ExportFirst, handed_over) and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from modelpool.registry.loaders import onnx_cache, weights_size_mb
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor import scaling
from modelpool.supervisor.models import ModelState
from modelpool.supervisor.workers import Launcher, WorkerHandle

log = logging.getLogger("modelpool.exports")
ONNX = "onnx"  # an export's outcome when its model should run it; else why not
REPLACED_BECAUSE = "its model's ONNX export is ready"
OUTPUT_KEPT = 64 * 1024  # of what an export prints: its last line says why it failed

RunExport = Callable[[ModelSpec, Path, Path], Awaitable[str]]


async def run_export(launcher: Launcher, spec: ModelSpec, model_dir: Path,
                     entry: Path) -> str:
    """ONNX, or why the model keeps running eager PyTorch. The export runs in a process
    forked from the forkserver (onnx_cache.export_forked), killed if this is cancelled."""
    loop = asyncio.get_running_loop()
    result, result_end = socket.socketpair()
    output, output_end = socket.socketpair()
    process = launcher.ctx.Process(
        target=onnx_cache.export_forked, name="modelpool-onnx-export", daemon=True,
        args=(onnx_cache.export_payload(spec, model_dir, entry), result_end, output_end))
    # start() talks to the forkserver: when cancelled meanwhile, the process is still
    # started, then killed.
    starting = asyncio.ensure_future(loop.run_in_executor(None, process.start))
    try:
        await asyncio.shield(starting)
        result_end.close()
        output_end.close()
        reads = asyncio.gather(_read(result), _read(output))
        # Cancelled from outside (the daemon stopping), wait_for leaves the gather's own
        # CancelledError unread, which asyncio would log as an error.
        reads.add_done_callback(_retrieved)
        out, err = await asyncio.wait_for(reads, onnx_cache.EXPORT_TIMEOUT_S)
        await loop.run_in_executor(None, process.join)  # it has closed both: it ends
    except BaseException:  # a timeout, or the daemon stopping: the export goes too
        await _kill(process, starting)
        raise
    finally:
        for sock in (result, result_end, output, output_end):
            sock.close()
    if process.exitcode != 0:
        return f"the {onnx_cache.export_failure(process.exitcode or 0, err)}"
    manifest = msgspec.json.decode(out, type=onnx_cache.Manifest)
    return ONNX if manifest.choice == "onnx" else manifest.reason


async def _read(sock: socket.socket, keep: int = OUTPUT_KEPT) -> bytes:
    """What sock carries until it closes: its last `keep` bytes."""
    sock.setblocking(False)
    loop, got = asyncio.get_running_loop(), bytearray()
    while data := await loop.sock_recv(sock, 65536):
        got += data
        del got[:-keep]
    return bytes(got)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def _kill(process: BaseProcess, starting: asyncio.Future[None]) -> None:
    with contextlib.suppress(Exception):
        await starting
    if process.pid is None:  # it never started
        return
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    await asyncio.get_running_loop().run_in_executor(None, process.join)


class Pending(NamedTuple):
    model: ModelState  # the model that asked for it first
    model_dir: Path
    peak_mb: float  # onnx_cache.export_peak_mb


class Exports:
    """The background exports of this daemon, and what became of them. Which export
    starts, and when a running one yields its memory, the scaling policy decides
    (scaling.plan_export, Plan.stop_export); `changed` asks the pool to decide again."""

    def __init__(self, changed: Callable[[], None], run: RunExport) -> None:
        self.changed = changed
        self.run = run
        self.outcomes: dict[str, str] = {}  # entry -> ONNX or why eager
        self.waiting: dict[str, Pending] = {}  # entry -> an export not started, oldest first
        self.running: dict[str, tuple[Pending, asyncio.Task[None]]] = {}  # one at most
        self.models: dict[str, list[ModelState]] = {}  # entry -> the models that wait for it
        self.told: set[str] = set()  # entries whose wait for memory was logged
        self.closed = False

    @property
    def charged_mb(self) -> float:
        """The running export's expected peak (0 when none runs)."""
        return sum(pending.peak_mb for pending, _ in self.running.values())

    def view(self) -> scaling.ExportView:
        return scaling.ExportView(
            running_mb=self.charged_mb if self.running else None,
            waiting=tuple((e, p.peak_mb) for e, p in self.waiting.items()
                          if e not in self.running))

    def note_ready(self, model: ModelState, worker: WorkerHandle) -> None:
        """A worker is ready: start the export it names, or act on one that ended."""
        export = worker.info.get("onnx_export")
        if self.closed or not isinstance(export, dict):
            return
        entry, model_dir = str(export.get("entry", "")), str(export.get("model_dir", ""))
        if not entry or not model_dir:
            return
        if entry in self.outcomes:
            self._settle(model, entry)
        else:
            self.request(model, entry, model_dir)

    def request(self, model: ModelState, entry: str, model_dir: str) -> None:
        """Make the export in the background, unless it is made or being made. Two model
        keys may share one (the same files and options). A model that must run it
        (execution = "onnx") starts no worker until it is made."""
        waiting = self.models.setdefault(entry, [])
        if model not in waiting:
            waiting.append(model)
        if self.closed or entry in self.outcomes:
            return
        pending = self.waiting.get(entry) or (
            self.running[entry][0] if entry in self.running else None)
        if pending is None:
            weights = weights_size_mb(Path(model_dir)) or model.charge().weights_mb
            pending = Pending(model, Path(model_dir), onnx_cache.export_peak_mb(weights))
            self.waiting[entry] = pending
        if model.spec.execution == ONNX:  # it cannot serve eager PyTorch meanwhile
            model.awaits_export_mb = pending.peak_mb
        self.changed()

    def handed_over(self, model: ModelState, worker: WorkerHandle, entry: str,
                    model_dir: str) -> None:
        """A worker of a model forced to ONNX found no export (a hub model downloaded by
        its load) and exits, leaving it to the daemon. An export already tried and lost
        makes its exit a load failure instead: its model backs off, not retries."""
        outcome = self.outcomes.get(entry)
        if outcome is None:
            log.info("model %s: its worker leaves the ONNX export to the daemon "
                     "(execution = \"onnx\")", model.key)
            self.request(model, entry, model_dir)
        else:
            ended = "was made, then removed from the cache" if outcome == ONNX else outcome
            worker.load_error = f"execution = \"onnx\" and no export to load: {ended}"

    def start(self, entry: str) -> None:
        """Start this waiting export (the policy found room for its peak)."""
        if self.closed or self.running or entry not in self.waiting:
            return
        pending = self.waiting.pop(entry)
        log.info("model %s: making its ONNX export in the background (%s, ~%.0f MiB)",
                 pending.model.key, entry, pending.peak_mb)
        self.running[entry] = pending, asyncio.get_running_loop().create_task(
            self._export(pending.model, pending.model_dir, entry))

    def note_no_room(self, free_mb: float) -> None:
        """No waiting export fits: each is logged once."""
        for entry, pending in self.waiting.items():
            if entry not in self.told and entry not in self.running:
                self.told.add(entry)
                log.info("model %s: its ONNX export waits for memory: ~%.0f MiB at its "
                         "peak, %.0f free in the budget", pending.model.key,
                         pending.peak_mb, free_mb)

    def stop_running(self) -> None:
        """The running export yields its memory to a worker: its process is killed and
        it waits for room again, first."""
        for entry, (pending, task) in self.running.items():
            if entry in self.waiting:  # already stopping for an earlier start
                continue
            log.info("model %s: its ONNX export stops to leave its memory to a worker; "
                     "made again when the budget has room", pending.model.key)
            self.waiting = {entry: pending, **self.waiting}
            self.told.discard(entry)
            task.cancel()

    def forget(self, model: ModelState) -> None:
        """A reload removed the model or changed what it loads: an export that only it
        waited for and that has not started is not made (it is of the old config); one
        that runs finishes, for whoever may use its entry later."""
        for entry in [e for e, waiting in self.models.items() if model in waiting]:
            self.models[entry].remove(model)
            if not self.models[entry]:
                del self.models[entry]
                self.waiting.pop(entry, None)
        model.awaits_export_mb = None

    def making(self, model: ModelState) -> bool:
        """An export this model waits for is running."""
        return any(model in self.models.get(entry, ()) for entry in self.running)

    def waits_for_memory(self, model: ModelState) -> float | None:
        """The expected peak of an export this model waits for that does not fit yet."""
        peaks = [p.peak_mb for entry, p in self.waiting.items()
                 if model in self.models.get(entry, ())]
        return max(peaks) if peaks else None

    async def _export(self, model: ModelState, model_dir: Path, entry: str) -> None:
        try:
            outcome = await self.run(model.spec, model_dir, Path(entry))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the process could not start, its reply was garbled
            outcome = f"the ONNX export failed: {type(exc).__name__}: {exc}"
        finally:
            self.running.pop(entry, None)
        self.outcomes[entry] = outcome
        log.info("model %s: ONNX export done: %s", model.key,
                 "its workers run it now" if outcome == ONNX else outcome)
        for waiting in self.models.pop(entry, []):
            # A forced model's workers may start: they load the export (or, when its
            # process died before writing one, make it in their load).
            waiting.awaits_export_mb = None
            self._settle(waiting, entry)
        self.changed()

    def _settle(self, model: ModelState, entry: str) -> None:
        """Mark the workers that wait for this export: for replacement, or with the
        reason they stay eager."""
        outcome = self.outcomes[entry]
        for worker in model.live_workers():
            export = worker.info.get("onnx_export")
            if not isinstance(export, dict) or export.get("entry") != entry:
                continue
            if outcome == ONNX:
                worker.outdated = REPLACED_BECAUSE
            else:
                info = {k: v for k, v in worker.info.items() if k != "onnx_export"}
                worker.info = {**info, "execution_reason": outcome}

    async def close(self) -> None:
        """No more exports; those running are killed (the next start makes them)."""
        self.closed = True
        self.waiting.clear()
        for waiting in self.models.values():
            for model in waiting:
                model.awaits_export_mb = None
        tasks = [task for _, task in self.running.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
