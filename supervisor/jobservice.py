"""The job API: a submitted job runs through the same pool as a direct request, with the
same priorities, deadlines, dedup, batching and recovery; its result goes to the mailbox
instead of a connection, so it outlives the connection that submitted it.

Jobs wait in a TaskQueue until this daemon claims them (at once in memory; when it has
room, with a shared queue) and their records and results live in a Mailbox; both are
interfaces, so a shared backend is a new module, not a change here or in the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sys
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.jobs import (
    ENDED,
    JobInfo,
    JobOutcome,
    JobResult,
    PoolStats,
    Submit,
)
from modelpool.protocol.kinds import KIND_OF
from modelpool.protocol.messages import (
    Error,
    WorkRequest,
    encoder,
)
from modelpool.supervisor import admission, jobroom, pool_stats
from modelpool.supervisor.admission import RemoteModel
from modelpool.supervisor.config import JobsConfig
from modelpool.supervisor.jobs import dedup_key
from modelpool.supervisor.jobsink import MailboxSink
from modelpool.supervisor.mailbox import JobRecord, Mailbox, MailboxFull
from modelpool.supervisor.pgstreams import RelayedStreams, StreamFollowers, StreamPiece
from modelpool.supervisor.pool import Pool
from modelpool.supervisor.tasks import QueueFull, TaskQueue

log = logging.getLogger("modelpool.jobs")

KEY_BYTES = 16  # 128 random bits: keys cannot be guessed
# What keeps the pool from taking a claimed job now, not the job from ever running.
WAITS_AGAIN = (ErrorCode.QUEUE_FULL, ErrorCode.OVERLOADED, ErrorCode.SHUTTING_DOWN)


def new_key() -> str:
    """A job key: hex, so that no key starts with '-' and reads as an option to a shell
    command (`modelpool result KEY`), and none needs quoting or URL escaping."""
    return secrets.token_hex(KEY_BYTES)


_request_decoder = msgspec.msgpack.Decoder(WorkRequest)
_result_decoder = msgspec.msgpack.Decoder(JobOutcome)


class JobService:
    def __init__(self, pool: Pool, queue: TaskQueue, mailbox: Mailbox, config: JobsConfig,
                 node: str, shared: bool = False) -> None:
        self.pool = pool
        self.queue = queue
        self.mailbox = mailbox
        self.config = config
        self.node = node
        self.shared = shared  # other daemons claim from the same queue
        # Set by the cluster: may this daemon load a model; the other nodes' figures.
        self.may_load: Callable[[str], bool] = lambda key: True
        self.peer_stats: Callable[[], list[PoolStats]] = list
        self.runs_elsewhere: Callable[[str], bool] = lambda key: False
        self.elsewhere: Callable[[str], RemoteModel | None] = lambda name: None
        self.variant: Callable[[str], str | None] = lambda key: None  # cluster_view.py
        self.streams: RelayedStreams | None = None  # relayed streams' text (pgstreams.py)
        # Without a cluster, the streams of this daemon's own jobs (jobstreams.py).
        self.own_streams = StreamFollowers()
        queue.on_cancel = self._cancel_here
        self._running: dict[str, MailboxSink] = {}  # jobs this daemon runs, by key
        # Results not yet stored (the shared mailbox was unreachable): retried each tick.
        self._unstored: dict[str, tuple[JobRecord, Any]] = {}
        self.duplicates = 0  # results dropped because the job had ended already
        self._pumping = self._pump_again = False
        self._endings: set[asyncio.Task[None]] = set()

    def follow_config(self, config: JobsConfig) -> None:
        """A reload's [jobs]: its bounds, retention and timeout from the next job on."""
        self.config, self.queue.max_queued = config, config.max_queued
        self.mailbox.retention_s = config.result_retention_s
        self.mailbox.max_bytes = config.max_mailbox_bytes

    # ---- what clients ask --------------------------------------------------------------

    async def submit(self, uid: int, msg: Submit, nbytes: int, *, key: str | None = None,
                     stream_to: str | None = None) -> str:
        """Admit a job and return its key. It is refused as a direct request would be
        (unknown model, bad field, ...), except that it waits in the job queue rather
        than the model's: QUEUE_FULL at [jobs] max_queued, OVERLOADED with a full
        mailbox. In a cluster, a model this daemon cannot run (its files, its device)
        is not refused while another node can: the job waits for that one."""
        request = msgspec.structs.replace(
            msg.request, id=0, timeout_s=msg.request.timeout_s or self.config.timeout_s)
        kind = KIND_OF[type(request)]
        spec = admission.resolve(self.pool.registry, kind, request)
        remote = self.elsewhere(request.model) if spec is None and request.model else None
        refusal = self.pool.intake.refusal(request, self.runs_elsewhere, remote)
        if refusal is not None:
            raise PoolError(refusal.code, refusal.message, refusal.retry_after_s)
        model = spec.key if spec else remote.key if remote else request.model
        # Only nodes configured alike run it, and only its like joins it.
        variant = remote.variant if remote else self.variant(model)
        # The node that runs a model fills in its defaults: one it lacks joins as sent.
        here = self.pool.models.get(model)
        filled = request if here is None else self.pool.intake.with_defaults(request, here)
        dedup = dedup_key(kind, filled, model)
        now = self.pool.scheduler.wall()
        deadline_in = admission.deadline_in(request, now)
        record = JobRecord(key=key or new_key(), uid=uid, tenant=request.tenant,
                           op=kind.op, stream_to=stream_to,
                           model=model, priority=request.priority,
                           request=encoder.encode(request), single=msg.single,
                           dedup=dedup + variant.encode() if dedup and variant else dedup,
                           variant=variant, submitted_at=now,
                           deadline_at=None if deadline_in is None else now + deadline_in)
        # Shared: with a worker free for it here it is claimed as it is written (no other
        # node is woken, no claim follows); else it waits for whichever node is free first.
        claim = (self.shared and not self.pool.shutting_down
                 and jobroom.free_now(self.pool, model))
        try:
            await self.mailbox.add(record, claim)
        except MailboxFull as exc:
            raise PoolError(ErrorCode.OVERLOADED, str(exc), 1.0) from None
        try:
            await self.queue.put(record)
        except QueueFull as exc:
            await self.mailbox.remove(record.key)
            raise PoolError(ErrorCode.QUEUE_FULL, str(exc), 1.0) from None
        if record.state == "running":
            await self._start(record)
        elif not self.shared:  # a shared queue notifies every node's run(), this one's too
            await self.pump()
        return record.key

    async def retrieve(self, uid: int, key: str, timeout_s: float, rid: int) -> JobResult:
        record = await self.mailbox.wait(key, timeout_s, uid)  # one read if it has ended
        if record is None:
            raise _not_found(key)
        if record.state not in ENDED:
            state = (await self.info(uid, key)).state
            raise PoolError(ErrorCode.TIMEOUT, f"job {key} is still {state} after "
                            f"{timeout_s:g}s; it goes on, retrieve it again later")
        if record.state != "done" or record.result is None:
            raise PoolError(ErrorCode(record.error_code or ErrorCode.INTERNAL),
                            record.error_message or "the job failed")
        return JobResult(id=rid, key=key, result=_result_decoder.decode(record.result),
                         single=record.single)

    async def record(self, uid: int, key: str) -> JobRecord:
        """The job as stored: its user's only (RESULT_NOT_FOUND otherwise)."""
        return await self._own(uid, key)

    async def info(self, uid: int, key: str) -> JobInfo:
        record = await self._own(uid, key)
        info = record.info()
        sink = self._running.get(key)
        if sink is not None and info.state not in ENDED:
            info = msgspec.structs.replace(info, state="running" if sink.running else "queued")
        return info

    async def cancel(self, uid: int, key: str) -> None:
        record = await self._own(uid, key)
        if record.state in ENDED:
            return
        sink = self._running.get(key)
        if sink is not None:
            self.pool.cancel(sink, 0)  # the sink gets CANCELLED, and ends the job
        elif await self.queue.cancel(key) and not self.shared:  # shared: stored with it
            await self._store(record, Error(id=0, code=ErrorCode.CANCELLED,
                                            message=f"job {key} cancelled"))

    async def end_removed(self, models: Sequence[str]) -> None:
        """Jobs still waiting for models a reload removed. In a cluster other nodes may
        run them (jobs no node can run end as stranded); here nothing else would."""
        if self.shared or not models:
            return
        for record in await self.queue.claim(dict.fromkeys(models, sys.maxsize)):
            await self._store(record, Error(id=0, code=ErrorCode.UNKNOWN_MODEL, message=(
                f"model {record.model!r} was removed from the daemon's config (reload) "
                "before this job ran")))

    async def forget(self, uid: int, key: str) -> None:
        await self.cancel(uid, key)
        await self.mailbox.remove(key)

    async def recent(self, uid: int, limit: int) -> list[JobInfo]:
        return [await self.info(uid, r.key) for r in await self.mailbox.recent(uid, limit)]

    def local_stats(self) -> PoolStats:
        """This daemon's own figures (a cluster's nodes beat them to each other)."""
        return pool_stats.of_pool(self.pool, self.duplicates)

    async def stats(self) -> PoolStats:
        """The pool's figures; in a cluster, every live node's added up."""
        stored, nbytes = await self.mailbox.usage()
        return pool_stats.added_up([self.local_stats(), *self.peer_stats()], stored, nbytes,
                                   await self.queue.length())

    # ---- running jobs ------------------------------------------------------------------

    async def pump(self) -> None:
        """Claim the best waiting jobs of each model that the pool has room for, and
        start them there. One pump at a time: a call while one runs makes it go round
        once more instead (every submit and every ending asks for one)."""
        if self._pumping:
            self._pump_again = True
            return
        self._pumping = True
        try:
            self._pump_again = True
            while self._pump_again:
                self._pump_again = False
                await self._pump_once()
        finally:
            self._pumping = False

    async def _pump_once(self) -> None:
        if self.pool.shutting_down:
            return
        rooms = {key: room for key in self.pool.models
                 if (room := jobroom.room(self.pool, key, self.shared, self.may_load)) > 0}
        full: set[str] = set()  # models the pool had no room for after all
        for record in await self.queue.claim(rooms):
            if record.model in full:
                await self.queue.release(record)  # it waits again
            elif not await self._start(record):
                full.add(record.model)

    async def _start(self, record: JobRecord) -> bool:
        sink = MailboxSink(self, record)
        self._running[record.key] = sink
        if self.pool.submit(sink, _request_decoder.decode(record.request), len(record.request)):
            await self.mailbox.start(record.key, self.node, self.pool.scheduler.wall())
            return True
        self._running.pop(record.key)
        if sink.refusal is not None and sink.refusal.code in WAITS_AGAIN:
            # It waits again (claimed as this daemon began to stop: for another node).
            await self.queue.release(record)
        else:  # it cannot run at all (its deadline passed, its model failed): say why
            await self._store(record, sink.refusal)
        return False

    def _cancel_here(self, key: str) -> None:
        sink = self._running.get(key)
        if sink is not None:
            self.pool.cancel(sink, 0)

    def stream_piece(self, record: JobRecord, part: str, offset: int, text: str) -> None:
        """A followed stream's piece as it is made, for the node its client is on (this
        one, without a cluster)."""
        if record.stream_to is None:
            return
        piece = StreamPiece(record.key, record.attempt, offset, text, part)
        if self.streams is None:
            self.own_streams.take(piece)
        else:
            self.streams.publisher.publish(record.stream_to, piece)

    def followed(self) -> tuple[StreamFollowers, str]:
        """Where a followed stream's pieces arrive here, and the channel that sends
        them here ("": this daemon runs every job it is given)."""
        if self.streams is None:
            return self.own_streams, ""
        return self.streams.followers, self.streams.channel

    def ended(self, sink: MailboxSink, result: Any) -> None:
        """The pool's final reply for a job (called in the pool's call stack)."""
        task = asyncio.get_running_loop().create_task(self._end(sink, result))
        self._endings.add(task)
        task.add_done_callback(self._endings.discard)

    async def _end(self, sink: MailboxSink, result: Any) -> None:
        key = sink.record.key
        self._running.pop(key, None)
        try:
            if self.shared and isinstance(result, Error) and \
                    result.code is ErrorCode.SHUTTING_DOWN:
                await self.queue.release(sink.record)  # another daemon runs it
                return
            await self._store(sink.record, result)
            if not await self.queue.complete(key):
                log.info("job %s ended here after its claim was lost: its result was kept "
                         "only if it was the first", key)
        except PoolError as exc:  # the shared store is unreachable: try again at the tick
            if not self._unstored:  # once per outage
                log.warning("results wait here to be stored: %s", exc.message)
            self._unstored[key] = (sink.record, result)
            return
        with contextlib.suppress(PoolError):  # unreachable: the tick claims once it is back
            await self.pump()  # room for the next one

    async def _store(self, record: JobRecord, result: Any) -> None:
        now = self.pool.scheduler.wall()
        if isinstance(result, Error):
            state = "cancelled" if result.code is ErrorCode.CANCELLED else "failed"
            outcome = JobRecord(key=record.key, uid=record.uid, op=record.op,
                                model=record.model, priority=record.priority, request=b"",
                                submitted_at=record.submitted_at, state=state,
                                finished_at=now, error_code=result.code.value,
                                error_message=result.message)
        else:
            outcome = JobRecord(key=record.key, uid=record.uid, op=record.op,
                                model=record.model, priority=record.priority, request=b"",
                                submitted_at=record.submitted_at, state="done",
                                finished_at=now, result=encoder.encode(result))
        if not await self.mailbox.finish(record.key, outcome):
            self.duplicates += 1
            log.info("job %s ended twice; the second result was dropped", record.key)

    async def tick(self) -> None:
        """Periodic: drop expired results; end waiting jobs whose deadline passed; renew
        the claims of jobs running here (and stop those whose claim lapsed: someone else
        runs them now); claim what waits."""
        await self._store_pending()
        now = self.pool.scheduler.wall()
        await self.mailbox.expire(now)
        for record in await self.queue.expire_waiting(now):
            waited = now - record.submitted_at
            await self._store(record, Error(id=0, code=ErrorCode.DEADLINE_EXPIRED,
                                            message=f"job {record.key}: its deadline passed "
                                            f"after {waited:.1f}s in the job queue"))
        if self._running:
            for key in await self.queue.extend(list(self._running)):
                self._lost(key)
        await self.queue.sweep()
        await self.pump()

    async def run(self) -> None:
        """Claim jobs as they come (the queue's `ready`, set by new jobs)."""
        while True:
            await self.queue.ready.wait()
            self.queue.ready.clear()
            try:
                await self.pump()
            except PoolError as exc:  # the shared queue is unreachable: it wakes us again
                log.warning("cannot claim jobs: %s", exc.message)

    def _lost(self, key: str) -> None:
        sink = self._running.pop(key, None)
        if sink is not None:
            log.warning("job %s: its claim lapsed and another daemon runs it; stopping it "
                        "here", key)
            sink.lost = True
            self.pool.cancel(sink, 0)

    async def settle(self) -> None:
        """Wait for results being stored (before the daemon exits)."""
        if self._endings:
            await asyncio.gather(*self._endings, return_exceptions=True)
        with contextlib.suppress(PoolError):
            await self._store_pending()  # one more try before the daemon exits

    async def _store_pending(self) -> None:
        for key, (record, result) in list(self._unstored.items()):
            await self._store(record, result)  # raises while still unreachable
            del self._unstored[key]

    async def _own(self, uid: int, key: str) -> JobRecord:
        record = await self.mailbox.get(key)
        if record is None or record.uid != uid:
            raise _not_found(key)  # another user's key is one that does not exist
        return record


def _not_found(key: str) -> PoolError:
    return PoolError(ErrorCode.RESULT_NOT_FOUND, f"no job {key!r}: never submitted, "
                     "forgotten, expired, or not yours")
