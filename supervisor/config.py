"""The daemon's configuration: a TOML file decoded into msgspec Structs.

A wrong field is reported with its path (e.g. "Expected `int`, got `str` - at
`$.pool.max_workers_per_model`"), an unknown one is refused by name.
"""

from __future__ import annotations

import grp
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import msgspec

from modelpool.protocol.fields import Priority, RequestDefaults
from modelpool.protocol.logs import LogFormat
from modelpool.protocol.paths import default_socket_path
from modelpool.protocol.peers import uid_of
from modelpool.protocol.pipes import ImagePolicy
from modelpool.registry.spec import ModelSpec, Registry, load_catalog
from modelpool.supervisor.eventloop import EventLoop, uvloop_installed

Positive = Annotated[float, msgspec.Meta(gt=0)]
Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
UserRef = int | str  # a uid, or a user name
GroupRef = int | str  # a gid, or a group name


def gid_of(group: int | str) -> int:
    """A gid given as a number, a string of digits or a group name. KeyError if unknown."""
    if isinstance(group, int):
        return group
    return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid


def _known(lookup: Callable[[int | str], int], name: int | str, what: str) -> None:
    try:
        lookup(name)
    except KeyError:
        raise ValueError(f"no {what} {name!r}") from None


class DaemonConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    socket: str = msgspec.field(default_factory=default_socket_path)
    socket_group: str | None = None  # set: socket is 0660 and owned by this group
    log_level: str = "INFO"
    log_format: LogFormat = "text"  # or "json": one object per line (protocol/logs.py)
    max_frame_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 64 * 1024 * 1024
    # One client's replies it has not read: over this, the client is dropped.
    max_client_buffer_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 64 * 1024 * 1024
    # All clients' unread replies: over this, the client holding the most is dropped.
    max_unread_total_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 256 * 1024 * 1024
    # 0: from the fd limit, a quarter kept for workers; more clients are told OVERLOADED.
    max_connections: Annotated[int, msgspec.Meta(ge=0)] = 0
    # A client with nothing in flight that sends nothing this long is closed; 0: never.
    idle_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 3600.0
    frame_timeout_s: Positive = 30.0  # a begun frame (and the hello) must arrive within this
    # uvloop where installed ("auto"), or asyncio's own loop (supervisor/eventloop.py).
    event_loop: EventLoop = "auto"
    realtime: bool = False  # the event loop as SCHED_FIFO, when permitted (supervisor/realtime.py)
    idle_cgroup: bool = True  # start, load, stop workers in an idle cpu cgroup (cgroups.py)

    def __post_init__(self) -> None:
        if self.socket_group is not None:
            _known(gid_of, self.socket_group, "group")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        if self.event_loop == "uvloop" and not uvloop_installed():
            raise ValueError('event_loop = "uvloop", but uvloop is not installed')


class AccessConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Who may use the daemon besides its own user and root (who always may, uncapped)."""

    allow_users: list[UserRef] = []  # may connect
    allow_groups: list[GroupRef] = []  # their members (primary or supplementary) may connect
    admin_users: list[UserRef] = []  # may connect and also stop, load and unload
    max_priority: Priority = "critical"  # the highest priority other users may ask for
    max_priority_for: dict[str, Priority] = {}  # per user name or uid, instead of max_priority

    def __post_init__(self) -> None:
        # An unknown name is a config error at start, not a surprise at the first client.
        for user in (*self.allow_users, *self.admin_users, *self.max_priority_for):
            _known(uid_of, user, "user")
        for group in self.allow_groups:
            _known(gid_of, group, "group")


class PoolConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    timeout_s: Positive = 30.0  # default per-request bound on total time
    cold_start_workers: Annotated[int, msgspec.Meta(ge=1)] = 2
    max_workers_per_model: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: cpus / threads
    cooldown_idle_s: Positive = 60.0
    max_concurrent_loads: Annotated[int, msgspec.Meta(ge=1)] = 2
    memory_fraction: Fraction = 0.80
    memory_budget_mb: Annotated[float, msgspec.Meta(gt=0)] | None = None  # overrides fraction
    max_batch: Annotated[int, msgspec.Meta(ge=1)] = 32
    max_batch_wait_ms: Annotated[float, msgspec.Meta(ge=0)] = 2.0  # only under load
    max_queue: Annotated[int, msgspec.Meta(ge=1)] = 1000  # per model -> QUEUE_FULL
    max_queued_total: Annotated[int, msgspec.Meta(ge=1)] = 5000  # all models -> OVERLOADED
    max_queued_bytes: Annotated[int, msgspec.Meta(ge=1)] = 1 << 30  # their bytes -> OVERLOADED
    priority_aging_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0  # 0: no ageing
    threads_per_worker: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: cpus / cold start
    heartbeat_interval_s: Positive = 0.5
    heartbeat_timeout_s: Positive = 5.0  # silent this long: hung, killed, work re-queued
    stall_timeout_s: Positive = 120.0  # holding work without progress this long: hung too
    shutdown_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    load_backoff_s: Positive = 1.0  # first respawn delay after a load failure; doubles
    load_backoff_max_s: Positive = 60.0
    max_load_failures: Annotated[int, msgspec.Meta(ge=1)] = 3
    load_timeout_s: Positive = 600.0  # a load still running after this fails
    load_stall_s: Positive = 120.0  # a load that reads and computes nothing this long fails
    idle_load_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0  # loads at idle priority this long


class JobsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Submitted jobs (the job API): their results and how long they are kept."""

    result_retention_s: Positive = 3600.0  # a result is kept this long after its job ended
    max_mailbox_bytes: Annotated[int, msgspec.Meta(ge=1)] = 1 << 30  # then OVERLOADED
    timeout_s: Positive = 3600.0  # a job's bound unless it gives its own timeout_s
    max_queued: Annotated[int, msgspec.Meta(ge=1)] = 100_000  # jobs waiting; then QUEUE_FULL


class ClusterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Daemons on several hosts sharing one PostgreSQL job queue and mailbox."""

    postgres: str = ""  # "postgresql://..."; default $MODELPOOL_POSTGRES; "": no cluster
    node_name: str = ""  # default: the host name
    lease_s: Positive = 10.0  # a claim lapses this long after its last renewal
    # Direct requests for a model served, or only runnable, elsewhere go there.
    route_remote: bool = True
    # Jobs waiting for a model that no live node can run end (MODEL_LOAD_FAILED) after
    # this long; 0: they wait for such a node however long.
    stranded_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 600.0

    @property
    def dsn(self) -> str:
        return self.postgres or os.environ.get("MODELPOOL_POSTGRES", "")


class HttpConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The OpenAI-compatible HTTP API (supervisor/httpapi); off unless `listen` is set."""

    listen: str = ""  # "127.0.0.1:8000", "[::1]:8000", "0.0.0.0:8000" (needs keys)
    api_keys: list[str] = []  # bearer keys; none: open, and only on loopback
    api_key_file: str = ""  # one key per line, read at start (kept out of the config)
    metrics_need_key: bool = True  # false: Prometheus may scrape /metrics without one
    max_body_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: daemon.max_frame_bytes
    body_timeout_s: Positive = 30.0  # a request body must arrive within this
    connections: Annotated[int, msgspec.Meta(ge=1, le=256)] = 8  # to the daemon's socket
    max_clients: Annotated[int, msgspec.Meta(ge=1)] = 1024  # more are answered 503
    max_priority: Priority = "critical"  # the highest priority an HTTP request may ask
    # Each client's (API key, else address) requests a minute, as OpenAI's limits; 0: none
    requests_per_minute: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Clients of different keys share no kept prompts (a side channel); false: they do.
    prefix_cache_per_key: bool = True
    # The Responses API's kept responses (previous_response_id), in the front door's memory
    kept_responses_mib: Annotated[int, msgspec.Meta(ge=0)] = 64
    in_loop: bool = False  # serve from the supervisor's own loop, not a process of its own


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    daemon: DaemonConfig = msgspec.field(default_factory=DaemonConfig)
    pool: PoolConfig = msgspec.field(default_factory=PoolConfig)
    images: ImagePolicy = msgspec.field(default_factory=ImagePolicy)
    defaults: RequestDefaults = msgspec.field(default_factory=RequestDefaults)
    jobs: JobsConfig = msgspec.field(default_factory=JobsConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    access: AccessConfig = msgspec.field(default_factory=AccessConfig)
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    models: list[ModelSpec] = []

    def registry(self) -> Registry:
        return Registry([*load_catalog(), *self.models])


class ConfigError(Exception):
    pass


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Read the config from path, else $MODELPOOL_CONFIG, else the defaults."""
    path = path or os.environ.get("MODELPOOL_CONFIG")
    if not path:
        return Config()
    try:
        data = Path(path).read_bytes()
        return msgspec.toml.decode(data, type=Config)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise ConfigError(f"bad config {path}: {exc}") from exc
