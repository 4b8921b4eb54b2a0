"""The daemon: the Unix socket, one connection handler per client, signals, start and stop.

One thread, one event loop. Signal handlers only set an event; the loop does the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import stat
import time
from collections.abc import Coroutine
from typing import Any

import msgspec

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.framing import HEADER, frame
from modelpool.protocol.jobs import JOB_REQUESTS
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
    StatusReply,
    StopDaemon,
    UnloadModel,
    Welcome,
    encoder,
)
from modelpool.protocol.peers import Peer, peer_of
from modelpool.protocol.wire import client_decoder
from modelpool.supervisor import (
    access,
    admission,
    cgroups,
    cluster,
    control,
    gpus,
    realtime,
    shm,
    status,
)
from modelpool.supervisor.clock import LoopScheduler
from modelpool.supervisor.config import Config, gid_of
from modelpool.supervisor.pool import Pool
from modelpool.supervisor.shutdown import drain_and_stop
from modelpool.supervisor.socket_dir import secure_socket_dir
from modelpool.supervisor.workers import Launcher, forkserver_context

log = logging.getLogger("modelpool.server")

SCALE_TICK_S = 1.0
MAX_PENDING_REPLIES = 1024  # job requests (a retrieve waits) being answered per connection
MEMORY_REFRESH_S = 5.0  # re-measure workers' USS and VRAM (~2 ms a worker, in a thread)


_connection_ids = itertools.count(1)


class AlreadyRunning(Exception):
    pass


class Connection:
    """One client connection; the ReplySink of every job it submitted. `peer` is who the
    kernel says the client is (pid, uid, gid, groups), fixed for the connection's life;
    `access` applies the [access] policy to it."""

    def __init__(self, writer: asyncio.StreamWriter, max_buffer: int,
                 policy: access.AccessPolicy) -> None:
        self.writer = writer
        self.peer: Peer = peer_of(writer.get_extra_info("socket"))
        self.access = access.ConnectionAccess(policy, self.peer)
        self.max_buffer = max_buffer
        self.jobs: dict[int, Any] = {}
        self.tasks: set[asyncio.Task[None]] = set()  # replies being worked out (job API)
        self.closed = False
        self.owner = (self.peer.uid, next(_connection_ids))  # its turn in fair queueing

    def send(self, msg: msgspec.Struct) -> None:
        if self.closed:
            return
        self.writer.write(frame(encoder.encode(msg)))
        if self.writer.transport.get_write_buffer_size() > self.max_buffer:
            # A client that does not read its replies must not grow our memory.
            log.warning("dropping a client that stopped reading (%d bytes unsent)",
                        self.writer.transport.get_write_buffer_size())
            self.close(abort=True)

    def close(self, abort: bool = False) -> None:
        if not self.closed:
            self.closed = True
            if abort:
                self.writer.transport.abort()
            else:
                self.writer.close()


def bind_unix_socket(path: str, group: str | None) -> socket.socket:
    """Bind with the right mode from the start (umask before bind, not chmod after), in
    a directory no one else can swap it in (socket_dir.py)."""
    gid = gid_of(group) if group else None
    for warning in secure_socket_dir(os.path.dirname(path) or ".", gid):
        log.warning("%s", warning)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise AlreadyRunning(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise AlreadyRunning(f"another daemon is serving {path}")
        except ConnectionRefusedError:
            os.unlink(path)  # stale: its daemon died without cleaning up
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o117 if group else 0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old_umask)
    if gid is not None:
        os.chown(path, -1, gid)
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class Server:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.socket_path = os.path.abspath(config.daemon.socket)
        self.stop_requested = asyncio.Event()
        self.started_at = time.monotonic()
        registry = config.registry()
        from modelpool.registry.loaders import preload_modules

        ctx = forkserver_context(preload_modules(list(registry.specs.values())))
        self.launcher = Launcher(ctx)
        gpu_list = gpus.discover()
        if gpu_list:
            log.info("GPUs: %s", ", ".join(f"{g.device} {g.name} ({g.total_mb:.0f} MiB)"
                                           for g in gpu_list))
        scheduler = LoopScheduler()
        self.pool = Pool(config, registry, self.launcher, scheduler, gpus=gpu_list,
                         cpus=os.cpu_count() or 1)
        self.launcher.events = self.pool
        self.jobs, self.cluster = cluster.job_service(
            config, self.pool, scheduler, config.cluster.node_name or socket.gethostname())
        self.access = access.AccessPolicy.from_config(config.access, os.geteuid())
        if warning := self.access.unreachable_group_warning(config.daemon.socket_group):
            log.warning("%s", warning)
        self._socket_inode: int | None = None

    async def run(self) -> None:
        if self.config.daemon.realtime:
            realtime.enter_realtime()
        # The socket first: a daemon that may not serve there leaves nothing behind.
        sock = bind_unix_socket(self.socket_path, self.config.daemon.socket_group)
        loading_cgroup = cgroups.enter(self.config.daemon.idle_cgroup)  # before the forkserver
        loop = asyncio.get_running_loop()
        if removed := shm.remove_stale_segments():
            log.info("removed %d shared-memory segment(s) left by a dead daemon", removed)
        self._socket_inode = os.stat(self.socket_path).st_ino
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_requested.set)
        server = await asyncio.start_unix_server(self._serve_client, sock=sock)
        warm = loop.create_task(self.launcher.warm_up())
        ticker = loop.create_task(self._scale_ticker())
        health = loop.create_task(self._health_ticker())
        measure = loop.create_task(self._memory_ticker())
        claims = loop.create_task(self.jobs.run())
        touch = (loop.create_task(cluster.keep_in_touch(self.cluster, self.jobs))
                 if self.cluster else None)
        log.info("modelpool serving on %s (pid %d, %d models known)", self.socket_path,
                 os.getpid(), len(self.pool.models))
        try:
            await self.stop_requested.wait()
            log.info("stopping: refusing new work, draining")
            server.close()
            _, _, kill_at = await drain_and_stop(self.pool)
            await self.jobs.settle()
            self.pool.shared.release_all()
            await self.launcher.close(kill_at - self.pool.scheduler.now())
        finally:
            cgroups.leave(loading_cgroup)
            ticker.cancel()
            health.cancel()
            measure.cancel()
            claims.cancel()
            if touch is not None:
                touch.cancel()
                await self.cluster.store.close()  # type: ignore[union-attr]
            warm.cancel()
            self._remove_socket()
            server.close()

    def _remove_socket(self) -> None:
        with contextlib.suppress(OSError):
            if os.stat(self.socket_path).st_ino == self._socket_inode:
                os.unlink(self.socket_path)

    async def _scale_ticker(self) -> None:
        while True:
            await asyncio.sleep(min(SCALE_TICK_S, self.config.pool.cooldown_idle_s / 4))
            self.pool.tick()
            if self.cluster is None:  # a cluster's jobs tick with its beat
                await self.jobs.tick()

    async def _memory_ticker(self) -> None:
        """Apart from the scale ticker, which must not wait on nvidia-smi (it can take
        seconds to answer on a busy GPU)."""
        while True:
            await asyncio.sleep(MEMORY_REFRESH_S)
            await status.refresh_memory(self.pool)

    async def _health_ticker(self) -> None:
        # Often enough that a hung worker is killed within a quarter second of its
        # timeout; each check only compares a few timestamps per worker.
        interval = min(0.25, self.config.pool.heartbeat_timeout_s / 8)
        while True:
            await asyncio.sleep(interval)
            self.pool.check_health()

    # ---- one client --------------------------------------------------------------------

    async def _serve_client(self, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        conn = Connection(writer, self.config.daemon.max_client_buffer_bytes, self.access)
        try:
            if refusal := conn.access.refusal():
                await access.turn_away(conn, reader, refusal)
            elif await self._handshake(conn, reader):
                while (payload := await self._read_frame(conn, reader)) is not None:
                    self._handle_frame(conn, payload)
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception:
            log.exception("client connection failed")
        finally:
            self.pool.forget_sink(conn)
            for task in conn.tasks:  # retrieves waiting for a reply nobody will read
                task.cancel()
            conn.close()

    def _served_elsewhere(self, request: Any) -> bool:
        """In a cluster: a model not loaded here, loaded with room on another daemon,
        is asked there through the shared queue rather than loaded here too."""
        if self.cluster is None or not self.config.cluster.route_remote:
            return False
        spec = admission.resolve(self.pool.registry, KIND_OF[type(request)], request)
        return spec is not None and self.cluster.should_route(spec.key)

    def _answer_later(self, conn: Connection, rid: int, reply: Coroutine[Any, Any, Any]) -> None:
        """Send what the coroutine returns, without holding up this connection's other
        requests; a bounded number at a time per connection."""
        if len(conn.tasks) >= MAX_PENDING_REPLIES:
            reply.close()
            conn.send(Error(id=rid, code=ErrorCode.OVERLOADED, retry_after_s=1.0,
                            message=f"{MAX_PENDING_REPLIES} job requests of this connection "
                                    "are still being answered"))
            return

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

    async def _handshake(self, conn: Connection, reader: asyncio.StreamReader) -> bool:
        payload = await self._read_frame(conn, reader)
        if payload is None:
            return False
        try:
            hello = msgspec.msgpack.decode(payload, type=Hello)
        except msgspec.DecodeError as exc:
            conn.send(Error(id=None, code=ErrorCode.BAD_REQUEST,
                            message=f"the first frame must be a hello: {exc}"))
            return False
        if hello.protocol_version != PROTOCOL_VERSION:
            conn.send(Error(id=None, code=ErrorCode.PROTOCOL_VERSION,
                            message=f"client speaks protocol {hello.protocol_version}, "
                                    f"daemon speaks {PROTOCOL_VERSION}"))
            return False
        conn.send(Welcome(protocol_version=PROTOCOL_VERSION,
                          server_version=status.version(),
                          max_frame_bytes=self.config.daemon.max_frame_bytes,
                          default_models=dict(self.pool.registry.defaults)))
        return True

    async def _read_frame(self, conn: Connection, reader: asyncio.StreamReader) -> bytes | None:
        """The next frame; None at end of stream. Oversized frames are skipped, not fatal."""
        limit = self.config.daemon.max_frame_bytes
        while True:
            try:
                (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
                if size <= limit:
                    return await reader.readexactly(size)
                await _discard(reader, size)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    conn.send(Error(id=None, code=ErrorCode.BAD_REQUEST,
                                    message=f"truncated frame: the stream ended after "
                                            f"{len(exc.partial)} bytes"))
                return None
            conn.send(Error(id=None, code=ErrorCode.BAD_REQUEST,
                            message=f"frame of {size} bytes exceeds the limit of {limit}"))

    def _handle_frame(self, conn: Connection, payload: bytes) -> None:
        try:
            msg = client_decoder.decode(payload)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            conn.send(Error(id=_guess_id(payload), code=ErrorCode.BAD_REQUEST,
                            message=f"invalid request: {exc}"))
            return
        try:
            self._dispatch(conn, msg, len(payload))
        except control.ControlError as exc:
            conn.send(Error(id=getattr(msg, "id", None), code=exc.code, message=exc.message))
        except Exception as exc:
            log.exception("internal error handling %s", type(msg).__name__)
            conn.send(Error(id=getattr(msg, "id", None), code=ErrorCode.INTERNAL,
                            message=f"{type(exc).__name__}: {exc}"))

    def _dispatch(self, conn: Connection, msg: Any, nbytes: int) -> None:
        if refusal := conn.access.check(msg):
            conn.send(refusal)
            return
        match msg:
            case _ if type(msg) in KIND_OF and self._served_elsewhere(msg):
                self._answer_later(conn, msg.id, self.jobs.relay(conn.peer.uid, msg))
            case _ if type(msg) in KIND_OF:
                self.pool.submit(conn, msg, nbytes)
            case _ if isinstance(msg, JOB_REQUESTS):
                self._answer_later(conn, msg.id, self.jobs.answer(conn.peer.uid, msg, nbytes))
            case Cancel(id=client_id):
                self.pool.cancel(conn, client_id)
            case GetStatus(id=rid):
                report = status.build_status(
                    self.pool, self.socket_path, self.started_at,
                    self.cluster.status() if self.cluster else None)
                conn.send(StatusReply(id=rid, status=report))
            case ListModels(id=rid):
                conn.send(ModelsReply(id=rid, models=status.models_info(self.pool)))
            case LoadModel(id=rid, model=name, workers=count):
                conn.send(Ack(id=rid, message=control.load_model(self.pool, name, count)))
            case UnloadModel(id=rid, model=name):
                conn.send(Ack(id=rid, message=control.unload_model(self.pool, name)))
            case StopDaemon(id=rid):
                conn.send(Ack(id=rid, message="stopping"))
                self.stop_requested.set()
            case Hello():
                conn.send(Error(id=None, code=ErrorCode.BAD_REQUEST, message="already greeted"))
            case _:
                conn.send(Error(id=getattr(msg, "id", None), code=ErrorCode.BAD_REQUEST,
                                message=f"unsupported request {type(msg).__name__}"))


async def _discard(reader: asyncio.StreamReader, size: int) -> None:
    while size > 0:
        size -= len(await reader.readexactly(min(size, 1 << 16)))


def _guess_id(payload: bytes) -> int | None:
    """The request id of a frame that failed typed decoding, so the error can name it."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    rid = raw.get("id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else None


async def serve(config: Config) -> None:
    await Server(config).run()
