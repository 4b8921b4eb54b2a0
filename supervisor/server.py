"""The daemon: the Unix socket, one connection handler per client, signals, start and stop.

One thread, one event loop. Signal handlers only set an event; the loop does the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.framing import frame
from modelpool.protocol.messages import Error, encoder
from modelpool.protocol.peers import peer_of
from modelpool.protocol.status import PoolStatus
from modelpool.registry import sources
from modelpool.supervisor import (
    access,
    activation,
    cgroups,
    cluster,
    eventloop,
    gpus,
    memory,
    pressure,
    realtime,
    sdnotify,
    shm,
    status,
)
from modelpool.supervisor.acceptor import Acceptor, raise_fd_limit
from modelpool.supervisor.clock import LoopScheduler
from modelpool.supervisor.config import Config, ConfigError, DaemonConfig
from modelpool.supervisor.connections import Connection, ConnectionTable
from modelpool.supervisor.frontdoor import FrontDoor
from modelpool.supervisor.http_front import HttpDoor, HttpReload
from modelpool.supervisor.pool import Pool
from modelpool.supervisor.reload import apply_reload, plan_reload
from modelpool.supervisor.shutdown import KILL_GRACE_S, drain_and_stop
from modelpool.supervisor.socket_dir import bind_unix_socket, regroup_socket
from modelpool.supervisor.workers import Launcher

log = logging.getLogger("modelpool.server")

SCALE_TICK_S = 1.0
MAX_PENDING_REPLIES = 1024  # job requests (a retrieve waits) being answered per connection
PASSED_SOCKET_GROUP = ("socket_group is not applied to a socket systemd passed: set "
                       "SocketGroup= and SocketMode= in the .socket unit")
MEMORY_REFRESH_S = 5.0  # re-measure workers' USS and VRAM (~2 ms a worker, in a thread)


def usable_cpus() -> int:
    """The CPUs this process may run on (taskset, a cgroup's cpuset), not the machine's:
    workers and their threads are sized from it."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


ReadConfig = Callable[[], tuple[Config, list[str]]]  # the config again, and its warnings


class Server:
    def __init__(self, config: Config, read_config: ReadConfig | None = None) -> None:
        # systemd's variables, taken out of the environment before any child is started.
        self.inherited = activation.take_listening_socket()
        self.service = sdnotify.ServiceNotifier.from_environ(LoopScheduler(),
                                                             self._service_status)
        fd_limit = raise_fd_limit()  # before any child is started: they inherit it
        self.read_config = read_config or (lambda: (config, []))
        self._reloading = asyncio.Lock()  # one reload at a time
        self.socket_path = os.path.abspath(config.daemon.socket)
        registry = config.registry()
        # First: a bad [http] section or a taken port stops the start before anything.
        self.http = HttpDoor(config, self.socket_path, dict(registry.defaults))
        self.stop_requested = asyncio.Event()
        self.started_at = time.monotonic()
        from modelpool.registry import loaders
        from modelpool.registry.loaders import onnx_cache

        specs = list(registry.specs.values())
        # Both before the forkserver starts: it and the workers read them.
        os.environ[onnx_cache.EXPORTS_BY_DAEMON_ENV] = "1"  # exports.py
        os.environ[loaders.LOADER_MODULES_ENV] = ",".join(loaders.custom_loader_modules(specs))
        self.exports_at_start = loaders.exports_to_make(specs)  # made before the first request
        self.launcher = Launcher(loaders.preload_modules(specs))
        gpu_list = gpus.discover()
        if gpu_list:
            log.info("GPUs: %s", ", ".join(f"{g.device} {g.name} ({g.total_mb:.0f} MiB)"
                                           for g in gpu_list))
        scheduler = LoopScheduler()
        self.pool = Pool(config, registry, self.launcher, scheduler, gpus=gpu_list,
                         cpus=usable_cpus())
        self.launcher.events = self.pool
        self.pool.intake.missing_files = sources.missing_files
        self.memory_cgroup = pressure.own_cgroup()
        self.pool.oom = pressure.OomCounter(self.memory_cgroup)
        self._follow_machine()
        self.jobs, self.cluster = cluster.job_service(
            config, self.pool, scheduler, config.cluster.node_name or socket.gethostname())
        self.access = access.AccessPolicy.from_config(config.access, os.geteuid())
        if warning := self.access.unreachable_group_warning(config.daemon.socket_group):
            log.warning("%s", warning)
        self._socket_inode: int | None = None
        self._made_socket_dir = False  # the daemon made its socket's directory
        self.connections = ConnectionTable(config.daemon, fd_limit, self.pool.scheduler.now)
        self.front = FrontDoor(self.pool, self.jobs, self.cluster, self.status_report,
                               self.stop_requested, self.reload)
        self._client_tasks: set[asyncio.Task[None]] = set()

    def status_report(self) -> PoolStatus:
        return msgspec.structs.replace(
            status.build_status(self.pool, self.socket_path, self.started_at,
                                self.cluster.status() if self.cluster else None),
            clients=self.connections.status())

    @property
    def config(self) -> Config:
        """The pool's: the config as started, with what reloads applied since."""
        return self.pool.config

    async def run(self) -> None:
        if self.config.daemon.realtime:
            realtime.enter_realtime()
        # The socket first: a daemon that may not serve there leaves nothing behind. From
        # here on, a start that fails removes what it made (the finally below).
        sock = self._listening_socket()
        loading_cgroup: Path | None = None
        acceptor: Acceptor | None = None
        tasks: list[asyncio.Task[None]] = []
        try:
            loading_cgroup = cgroups.enter(self.config.daemon.idle_cgroup)  # before forkserver
            loop = asyncio.get_running_loop()
            if removed := shm.remove_stale_segments():
                log.info("removed %d shared-memory segment(s) left by a dead daemon", removed)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop_requested.set)
            loop.add_signal_handler(signal.SIGHUP, self._reload_on_signal)
            acceptor = Acceptor(sock, self.pool.scheduler, self._accepted, self._refusal)
            acceptor.start()
            tasks = self._background(loop)
            self.http.start(self.socket_path)
            log.info("modelpool serving on %s (pid %d, %d models known, at most %d clients, "
                     "%s loop)", self.socket_path, os.getpid(), len(self.pool.models),
                     self.connections.max_connections, eventloop.running_loop_name())
            self.service.ready()
            await self.stop_requested.wait()
            log.info("stopping: refusing new work, draining")
            self.service.stopping(self.config.pool.shutdown_timeout_s + KILL_GRACE_S)
            acceptor.close()
            sock.close()
            _, _, kill_at = await drain_and_stop(self.pool)
            await self.jobs.settle()
            self.front.streams.close()
            self.pool.shared.release_all()
            await self.launcher.close(kill_at - self.pool.scheduler.now())
        finally:
            await self.pool.exports.close()  # also when the start failed half-way
            await self.http.stop()
            self.service.close()
            for conn in list(self.connections.live):
                conn.close()  # what they were told goes out before the process ends
            cgroups.leave(loading_cgroup)
            for task in tasks:
                task.cancel()
            if self.cluster is not None:
                await self.cluster.store.close()
            self._remove_socket()
            if acceptor is not None:
                acceptor.close()
            sock.close()

    async def reload(self) -> str:
        """Read the config again and apply its models (reload.py): what changed. A
        config that would not start raises ConfigError, and nothing changes."""
        async with self._reloading:
            self.service.reloading()
            try:
                new, http = self._read_config_again()
                pool = self.pool
                try:
                    plan = plan_reload(
                        pool.registry.specs, new.registry().specs, self.config, new,
                        frozenset(m.key for m in pool.models.values() if m.holder is not None),
                        {m.key: m.spec for m in pool.models.values() if m.retiring},
                        http=http.changed)
                    loading = plan.loading()
                    # In a cluster, the new models' identities need their files'
                    # content: read before anything changes, so no job sees them
                    # half-known.
                    contents = await self.cluster.digests(loading) if self.cluster else {}
                except BaseException:
                    self.http.discard(http)  # what it bound for a new address
                    raise
                before = self.config.daemon
                apply_reload(pool, plan, new)
                # No await in between: no beat sees a model without its identity.
                if self.cluster is not None:
                    self.cluster.reidentify(loading, contents)
                self._apply_sections(plan.applied, before)
                from modelpool.registry.loaders import exports_to_make

                for spec, model_dir, entry in exports_to_make(loading):
                    pool.exports.request(pool.models[spec.key], str(entry), str(model_dir))
                # A front door taken over lets its requests in flight finish first.
                await self.http.apply(http, dict(pool.registry.defaults))
                await self.jobs.end_removed(plan.removed)
            finally:
                self.service.reloaded()
        summary = plan.summary()
        log.info("config reloaded: %s", summary)
        return summary

    def _apply_sections(self, applied: tuple[str, ...], before: DaemonConfig) -> None:
        """The reloaded sections that are not the pool's, each to the part that owns it
        ([http] is the front door's: HttpDoor); before: [daemon] as it was."""
        if "[access]" in applied:
            self._apply_access()
        if "[pool]" in applied:
            self._follow_machine()  # the new budget, with the machine's facts
        if "[jobs]" in applied:
            self.jobs.follow_config(self.config.jobs)
        if "[cluster]" in applied and self.cluster is not None:
            self.cluster.follow_config(self.config.cluster)
        if "[daemon]" in applied:
            self._apply_daemon(before)

    def _apply_daemon(self, before: DaemonConfig) -> None:
        """Client limits, frame and connection caps, log level, realtime and the
        socket's group."""
        daemon = self.config.daemon
        self.connections.follow_config(daemon)
        logging.getLogger().setLevel(daemon.log_level.upper())
        if daemon.realtime != before.realtime:
            realtime.follow(daemon.realtime)
        if daemon.socket_group == before.socket_group:
            return
        if self._socket_inode is None:
            log.warning("%s", PASSED_SOCKET_GROUP)
            return
        for warning in regroup_socket(self.socket_path, daemon.socket_group,
                                      self._made_socket_dir):
            log.warning("%s", warning)
        if warning := self.access.unreachable_group_warning(daemon.socket_group):
            log.warning("%s", warning)

    def _apply_access(self) -> None:
        """The reloaded [access], for every connection from now on and every open one."""
        self.access = access.AccessPolicy.from_config(self.config.access, os.geteuid())
        if warning := self.access.unreachable_group_warning(self.config.daemon.socket_group):
            log.warning("%s", warning)
        for conn in list(self.connections.live):
            conn.reaccess(self.access)

    def _read_config_again(self) -> tuple[Config, HttpReload]:
        """The config file's, and what it makes of the HTTP front door (checked as at
        start; a new address bound)."""
        try:
            new, warnings = self.read_config()
            for warning in warnings:
                log.warning("%s", warning)
            return new, self.http.reloaded(new, dict(self.pool.registry.defaults))
        except ConfigError as exc:
            refused = f"{exc}; the daemon goes on with the config it has"
            log.error("reload refused: %s", refused)
            raise ConfigError(refused) from exc

    def _reload_on_signal(self) -> None:
        async def run() -> None:
            try:
                await self.reload()
            except ConfigError:
                pass  # logged by reload
            except Exception:
                log.exception("internal error reloading the config")

        task = asyncio.get_running_loop().create_task(run())
        self._client_tasks.add(task)  # (a strong reference until it is done)
        task.add_done_callback(self._client_tasks.discard)

    def _background(self, loop: asyncio.AbstractEventLoop) -> list[asyncio.Task[None]]:
        work = [self.launcher.warm_up(), self._scale_ticker(), self._health_ticker(),
                self._memory_ticker(), self.jobs.run(), self._connection_ticker()]
        if self.cluster is not None:
            work.append(cluster.keep_in_touch(self.cluster, self.jobs))
        for spec, model_dir, entry in self.exports_at_start:
            self.pool.exports.request(self.pool.models[spec.key], str(entry), str(model_dir))
        return [loop.create_task(w) for w in work]

    def _listening_socket(self) -> socket.socket:
        """The socket systemd passed (socket activation), else one bound here."""
        if self.inherited is None:
            directory = os.path.dirname(os.path.abspath(self.socket_path))
            self._made_socket_dir = not os.path.isdir(directory)
            sock = bind_unix_socket(self.socket_path, self.config.daemon.socket_group)
            self._socket_inode = os.stat(self.socket_path).st_ino
            return sock
        self.socket_path = activation.socket_name(self.inherited)
        log.info("serving the socket passed by systemd: %s", self.socket_path)
        if self.config.daemon.socket_group:
            log.warning("%s", PASSED_SOCKET_GROUP)
        return self.inherited

    def _service_status(self) -> str:
        return status.summary_line(self.pool, len(self.connections.live))

    def _remove_socket(self) -> None:
        if self._socket_inode is None:  # not bound here: a passed socket's path is not ours
            return
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
            self._follow_machine()

    def _follow_machine(self) -> None:
        """Budget from the cgroup's limit and the memory available now; under outside
        pressure, idle workers go first."""
        capacity = self.pool.capacity
        used = capacity.used_mb(self.pool.models.values())
        before = capacity.budget_mb
        capacity.follow_machine(memory.read_memory(), pressure.read_cgroup(self.memory_cgroup),
                                used)
        if abs(capacity.budget_mb - before) >= 64:
            log.info("memory budget now %.0f MiB (was %.0f): the pool holds %.0f MiB",
                     capacity.budget_mb, before, used)
        self.pool.apply(pressure.plan_relief(capacity.view(self.pool.models.values())))

    async def _connection_ticker(self) -> None:
        while True:
            await asyncio.sleep(self.connections.sweep_interval_s)
            self.connections.sweep()

    async def _health_ticker(self) -> None:
        # Often enough that a hung worker is killed within a quarter second of its
        # timeout (as a reload leaves it); each check only compares a few timestamps per
        # worker.
        while True:
            await asyncio.sleep(min(0.25, self.config.pool.heartbeat_timeout_s / 8))
            self.pool.check_health()

    # ---- one client --------------------------------------------------------------------

    def _accepted(self, sock: socket.socket) -> bool:
        """Serve a client just accepted; False if there is no room for it."""
        if not self.connections.reserve():
            return False
        task = asyncio.get_running_loop().create_task(self._serve_socket(sock))
        self._client_tasks.add(task)  # the loop keeps only a weak reference to tasks
        task.add_done_callback(self._client_tasks.discard)
        return True

    def _refusal(self) -> bytes:
        return frame(encoder.encode(Error(
            id=None, code=ErrorCode.OVERLOADED, retry_after_s=1.0,
            message=f"too many clients ({self.connections.max_connections}, "
                    f"max_connections): retry later")))

    async def _serve_socket(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn = Connection(self.connections, self.access, peer_of(sock), self.front,
                              self.config.daemon.max_frame_bytes, defer=loop.call_soon)
            await loop.create_unix_connection(lambda: conn, sock=sock)
        except OSError:  # gone before it was served
            self.connections.release()
            sock.close()


async def serve(config: Config, read_config: ReadConfig | None = None) -> None:
    await Server(config, read_config).run()
