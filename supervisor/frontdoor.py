"""The daemon's front door on its socket: the handshake, then each frame of a connection
decoded (never raising), checked against the connection's access, and handed to where
it goes: the pool, the job API, another daemon of the cluster, or a control operation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.jobs import (
    JOB_REQUESTS,
    CancelJob,
    Follow,
    ForgetJob,
    GetStats,
    JobKey,
    JobQuery,
    JobReply,
    JobRequest,
    JobsReply,
    ListJobs,
    Retrieve,
    StatsReply,
    Submit,
)
from modelpool.protocol.kinds import KIND_OF
from modelpool.protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Cancel,
    Error,
    GetStatus,
    Hello,
    ListModels,
    LoadModel,
    ModelsReply,
    ReloadConfig,
    StatusReply,
    StopDaemon,
    UnloadModel,
    Welcome,
)
from modelpool.protocol.status import PoolStatus
from modelpool.protocol.wire import client_decoder
from modelpool.supervisor import admission, control, status
from modelpool.supervisor.cluster import ClusterNode
from modelpool.supervisor.config import ConfigError
from modelpool.supervisor.connections import Connection
from modelpool.supervisor.jobservice import JobService
from modelpool.supervisor.jobstreams import JobStreams
from modelpool.supervisor.pool import Pool
from modelpool.supervisor.relay import relay

log = logging.getLogger("modelpool.server")

MAX_PENDING_REPLIES = 1024  # job requests (a retrieve waits) being answered per connection


class FrontDoor:
    def __init__(self, pool: Pool, jobs: JobService,
                 cluster: ClusterNode | None, status_report: Callable[[], PoolStatus],
                 stop: asyncio.Event, reload: Callable[[], Awaitable[str]]) -> None:
        self.pool = pool
        self.jobs = jobs
        self.streams = JobStreams(jobs)  # streamed jobs' replies, for Follow
        self.cluster = cluster
        self.status_report = status_report
        self.stop = stop
        self.reload = reload

    def _work(self, conn: Connection, request: Any, nbytes: int, cluster: ClusterNode) -> None:
        """A direct request in a cluster: a model not loaded here, loaded with room on
        another daemon, is asked there through the shared queue rather than loaded here
        too; so is one that only another daemon's config names. With route_remote off,
        the latter is refused saying so, not as if no node had it."""
        spec = admission.resolve(self.pool.registry, KIND_OF[type(request)], request)
        route_remote = self.pool.config.cluster.route_remote  # as a reload left it
        remote = (spec is None and bool(request.model)
                  and cluster.elsewhere(request.model) is not None)
        if remote and not route_remote:
            conn.send(Error(id=request.id, code=ErrorCode.UNKNOWN_MODEL, message=(
                f"model {request.model!r} is not configured on this node; another node of "
                "the cluster runs it, but [cluster] route_remote = false keeps direct "
                "requests here: submit it as a job, or ask that node")))
        elif remote or (spec is not None and route_remote and cluster.should_route(spec.key)):
            # A Cancel of it stops it, and its job.
            self._cancellable(conn, request.id,
                              relay(self.jobs, conn.peer.uid, request, conn.send))
        else:
            self.pool.submit(conn, request, nbytes)

    def _cancellable(self, conn: Connection, rid: int,
                     reply: Coroutine[Any, Any, Any]) -> None:
        """Answered later (a stream's chunks sent as they come), stopped by a Cancel of
        its id."""
        task = self._answer_later(conn, rid, reply)
        if task is not None:
            conn.relays[rid] = task
            task.add_done_callback(lambda done: conn.relays.pop(rid)
                                   if conn.relays.get(rid) is done else None)

    def _answer_later(self, conn: Connection, rid: int,
                      reply: Coroutine[Any, Any, Any]) -> asyncio.Task[None] | None:
        """Send what the coroutine returns, without holding up this connection's other
        requests; a bounded number at a time per connection."""
        if len(conn.tasks) >= MAX_PENDING_REPLIES:
            reply.close()
            conn.send(Error(id=rid, code=ErrorCode.OVERLOADED, retry_after_s=1.0,
                            message=f"{MAX_PENDING_REPLIES} job requests of this connection "
                                    "are still being answered"))
            return None

        async def answer() -> None:
            try:
                answered = await reply
                for message in answered if isinstance(answered, list) else [answered]:
                    conn.send(message)
            except Exception as exc:
                log.exception("internal error answering a job request")
                conn.send(Error(id=rid, code=ErrorCode.INTERNAL,
                                message=f"{type(exc).__name__}: {exc}"))

        task = asyncio.get_running_loop().create_task(answer())
        conn.tasks.add(task)
        task.add_done_callback(conn.tasks.discard)
        return task

    def greet(self, conn: Connection, payload: bytes | bytearray) -> bool:
        """The client's first frame, which must be its hello: welcome it, or say why
        not and close."""
        try:
            hello = msgspec.msgpack.decode(payload, type=Hello)
        except Exception as exc:  # see decode_request: not only DecodeError
            conn.goodbye(ErrorCode.BAD_REQUEST,
                         f"the first frame must be a hello: {_decode_failure(exc)}")
            return False
        if hello.protocol_version != PROTOCOL_VERSION:
            conn.goodbye(ErrorCode.PROTOCOL_VERSION,
                         f"client speaks protocol {hello.protocol_version}, "
                         f"daemon speaks {PROTOCOL_VERSION}")
            return False
        conn.send(Welcome(protocol_version=PROTOCOL_VERSION,
                          server_version=status.version(),
                          max_frame_bytes=conn.limit,
                          default_models=dict(self.pool.registry.defaults)))
        return True

    def reading(self) -> contextlib.AbstractContextManager[None]:
        return self.pool.admitting()

    def gone(self, conn: Connection) -> None:
        """The client has gone: what it waits for is ended (work nobody else waits for
        is cancelled), and so is what is being worked out for it."""
        self.pool.forget_sink(conn)
        for task in conn.tasks:  # retrieves waiting for a reply nobody will read
            task.cancel()

    def handle_frame(self, conn: Connection, payload: bytes | bytearray) -> None:
        msg = decode_request(payload)
        if type(msg) is Error:  # (isinstance of a msgspec type costs 5x as much)
            conn.send(msg)
            return
        rid = getattr(msg, "id", None)
        if rid is not None and type(msg) is not Cancel and (rid in conn.jobs
                                                            or rid in conn.relays):
            # Its own id would read as a final reply to the request in flight: no id.
            conn.send(Error(id=None, code=ErrorCode.BAD_REQUEST,
                            message=f"request id {rid} is already in flight on this "
                                    f"connection: this {type(msg).__name__} was refused, "
                                    f"request {rid} goes on"))
            return
        try:
            self._dispatch(conn, msg, len(payload))
        except control.ControlError as exc:
            conn.send(Error(id=rid, code=exc.code, message=exc.message))
        except Exception as exc:
            log.exception("internal error handling %s", type(msg).__name__)
            conn.send(Error(id=rid, code=ErrorCode.INTERNAL,
                            message=f"{type(exc).__name__}: {exc}"))

    def _dispatch(self, conn: Connection, msg: Any, nbytes: int) -> None:
        if refusal := conn.access.check(msg):
            conn.send(refusal)
            return
        match msg:
            case _ if type(msg) in KIND_OF and self.cluster is None:
                self.pool.submit(conn, msg, nbytes)
            case _ if type(msg) in KIND_OF:
                self._work(conn, msg, nbytes, self.cluster)
            case Follow():  # a Cancel of it stops the following, not the job
                self._cancellable(conn, msg.id,
                                  self.streams.follow(conn.peer.uid, msg, conn.send))
            case _ if isinstance(msg, JOB_REQUESTS):
                self._answer_later(conn, msg.id, self._job(conn.peer.uid, msg, nbytes))
            case Cancel(id=client_id):
                relayed = conn.relays.pop(client_id, None)
                if relayed is None or relayed.done():  # (done: its final reply is sent)
                    self.pool.cancel(conn, client_id)
                else:
                    relayed.cancel()
                    conn.send(Error(id=client_id, code=ErrorCode.CANCELLED,
                                    message=f"request {client_id} cancelled"))
            case GetStatus(id=rid):
                conn.send(StatusReply(id=rid, status=self.status_report()))
            case ListModels(id=rid):
                elsewhere = self.cluster.models_elsewhere() if self.cluster else []
                conn.send(ModelsReply(id=rid, models=status.models_info(self.pool) + elsewhere))
            case LoadModel(id=rid, model=name, workers=count):
                conn.send(Ack(id=rid, message=control.load_model(self.pool, name, count)))
            case UnloadModel(id=rid, model=name):
                conn.send(Ack(id=rid, message=control.unload_model(self.pool, name)))
            case ReloadConfig(id=rid):
                self._answer_later(conn, rid, self._reload(rid))
            case StopDaemon(id=rid):
                conn.send(Ack(id=rid, message="stopping"))
                self.stop.set()
            case Hello():
                conn.send(Error(id=None, code=ErrorCode.BAD_REQUEST, message="already greeted"))
            case _:
                conn.send(Error(id=getattr(msg, "id", None), code=ErrorCode.BAD_REQUEST,
                                message=f"unsupported request {type(msg).__name__}"))


    async def _reload(self, rid: int) -> Ack | Error:
        try:
            return Ack(id=rid, message=await self.reload())
        except ConfigError as exc:
            return Error(id=rid, code=ErrorCode.BAD_REQUEST, message=str(exc))

    async def _job(self, uid: int, msg: JobRequest, nbytes: int) -> Any:
        """The reply to one job API message from user uid (an Error for a PoolError)."""
        try:
            match msg:
                case Submit():
                    return JobKey(id=msg.id, key=await self.streams.submit(uid, msg, nbytes))
                case Retrieve(key=key, timeout_s=timeout_s):
                    return await self.jobs.retrieve(uid, key, timeout_s, msg.id)
                case JobQuery(key=key):
                    return JobReply(id=msg.id, job=await self.jobs.info(uid, key))
                case CancelJob(key=key):
                    await self.jobs.cancel(uid, key)
                case ForgetJob(key=key):
                    await self.jobs.forget(uid, key)
                    self.streams.forget(key)
                case ListJobs(limit=limit):
                    return JobsReply(id=msg.id, jobs=await self.jobs.recent(uid, limit))
                case GetStats():
                    return StatsReply(id=msg.id, stats=await self.jobs.stats())
        except PoolError as exc:
            return Error(id=msg.id, code=exc.code, message=exc.message,
                         retry_after_s=exc.retry_after_s)
        return Ack(id=msg.id)


class _Envelope(msgspec.Struct):
    """What an undecodable frame may still say: its request id. Decoding into it skips
    every other value without building it, so it costs no memory."""

    id: int | None = None


_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


def decode_request(payload: bytes | bytearray) -> Any:
    """The client's message, or the BAD_REQUEST Error that answers it. Never raises."""
    try:
        return client_decoder.decode(payload)
    except Exception as exc:  # also UnicodeDecodeError, RecursionError, MemoryError
        return Error(id=_request_id(payload), code=ErrorCode.BAD_REQUEST,
                     message=f"invalid request: {_decode_failure(exc)}")


def _request_id(payload: bytes | bytearray) -> int | None:
    """The request id of a frame that failed typed decoding, so the error can name it."""
    try:
        return _envelope_decoder.decode(payload).id
    except Exception:
        return None


def _decode_failure(exc: Exception) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"a string is not valid UTF-8 ({exc.reason})"
    if isinstance(exc, RecursionError):
        return "values nested too deeply"
    if isinstance(exc, msgspec.DecodeError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
