"""A throwaway PostgreSQL server for tests: initdb into a temporary directory, run as the
unprivileged `postgres` user (the server refuses root), tuned for speed, torn down at the end.

Only the server binaries run as that user; nothing of this interpreter does (it may live
where that user cannot read). The postmaster is our own child process, so `kill()` can
SIGKILL it to test a crash, and it gets SIGQUIT (immediate shutdown) should the test
process die without tearing it down.
"""

from __future__ import annotations

import ctypes
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import psutil
import psycopg

PG_USER = "postgres"  # the OS user that runs the server
SUPERUSER = "postgres"  # the server's superuser (trust auth: no password)
APP_ROLE = "modelpool"  # a plain login role owning APP_DATABASE
APP_DATABASE = "modelpool"
_BINARIES = ("initdb", "postgres")
_PR_SET_PDEATHSIG = 1

# Speed and determinism for a throwaway server. fsync=off survives a postmaster SIGKILL
# (what was written is in the page cache); synchronous_commit=off does not quite: a
# commit is acknowledged before its WAL is written, so a crash may lose the last few
# hundred milliseconds of commits. A test that crashes the server and counts what was
# acknowledged turns it on for its database (cluster_helpers.Database.durable_commits).
DEFAULT_SETTINGS: dict[str, str] = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",
    "shared_buffers": "32MB",
    "timezone": "UTC",
    "log_timezone": "UTC",
    "logging_collector": "off",
    "log_min_messages": "warning",
    "log_connections": "off",
    "max_wal_size": "256MB",
    "autovacuum": "on",
}


def find_bindir() -> Path | None:
    """The directory holding initdb and postgres: PATH first, then Debian's versioned dirs."""
    initdb = shutil.which("initdb")
    if initdb is not None and shutil.which("postgres") is not None:
        return Path(initdb).resolve().parent
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if all(os.access(Path(candidate, b), os.X_OK) for b in _BINARIES):
            return Path(candidate)
    return None


def unavailable_reason() -> str | None:
    """Why a throwaway server cannot run here, or None when it can."""
    if find_bindir() is None:
        return "PostgreSQL server binaries (initdb, postgres) not found on PATH"
    if os.geteuid() != 0:
        return "the PostgreSQL tests run the server as the postgres user and need root"
    try:
        pwd.getpwnam(PG_USER)
    except KeyError:
        return f"no {PG_USER!r} user to run the PostgreSQL server as"
    return None


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """preexec: SIGQUIT the postmaster if we die (runs after the uid change, which clears it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGQUIT, 0, 0, 0)


class PgServer:
    """One PostgreSQL cluster in a temporary directory, listening on its own Unix-socket
    directory and on TCP at `listen` addresses (one port for all of them)."""

    def __init__(self, listen: Iterable[str] = ("127.0.0.1",),
                 settings: dict[str, str] | None = None) -> None:
        bindir = find_bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL binaries not found")
        self.bindir = bindir
        self.listen: list[str] = list(listen)
        self.settings = {**DEFAULT_SETTINGS, **(settings or {})}
        self.port = free_tcp_port()
        user = pwd.getpwnam(PG_USER)
        self._uid, self._gid = user.pw_uid, user.pw_gid
        # Not under pytest's tmp_path: that is root's 0700 directory.
        self.root = Path(tempfile.mkdtemp(prefix="modelpool-pg-"))
        os.chown(self.root, self._uid, self._gid)
        self.datadir = self.root / "data"
        self.socket_dir = self.root / "sock"
        self.log_path = self.root / "postgres.log"
        self.process: subprocess.Popen[bytes] | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def init(self) -> None:
        """initdb, then the app role and database."""
        self._as_postgres_dir(self.socket_dir)
        subprocess.run(
            [str(self.bindir / "initdb"), "-D", str(self.datadir), "-U", SUPERUSER,
             "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"],
            **self._as_postgres(), check=True, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, timeout=120,
        )
        # Trust from anywhere the server listens: it is a throwaway server, and it only
        # listens on loopback, its socket directory and the tests' own veth addresses.
        with open(self.datadir / "pg_hba.conf", "w") as hba:
            hba.write("local all all trust\n"
                      "host all all 0.0.0.0/0 trust\n")
        self.start()
        with self.connect(dbname="postgres", user=SUPERUSER) as conn:
            conn.execute(f"CREATE ROLE {APP_ROLE} LOGIN CREATEDB")
            conn.execute(f"CREATE DATABASE {APP_DATABASE} OWNER {APP_ROLE}")

    def start(self, timeout_s: float = 30) -> None:
        """Start the postmaster (data kept) and wait until it accepts connections."""
        if self.running:
            return
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it
        try:
            self.process = subprocess.Popen(
                [str(self.bindir / "postgres"), "-D", str(self.datadir), *self._options()],
                **self._as_postgres(), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
            )
        finally:
            log.close()
        self._wait_ready(timeout_s)

    def stop(self, timeout_s: float = 20) -> None:
        """Fast shutdown (SIGINT: sessions are cut, data is kept); SIGKILL if it hangs."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self) -> None:
        self.stop()
        self.start()

    def kill(self, timeout_s: float = 10) -> None:
        """SIGKILL the postmaster, as a crash would; returns once its backends have gone
        too (they exit on their own when the postmaster dies), so start() can follow."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        try:
            children = psutil.Process(process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        process.kill()
        process.wait()
        _, alive = psutil.wait_procs(children, timeout=timeout_s)
        for child in alive:  # our own server's backends, by pid
            child.kill()
        psutil.wait_procs(alive, timeout=timeout_s)

    def destroy(self) -> None:
        """Stop the server and delete its directory."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def listen_on(self, addresses: Iterable[str]) -> None:
        """Also listen on these TCP addresses (they must exist): restarts if they are new."""
        wanted = [a for a in addresses if a not in self.listen]
        if wanted:
            self.listen.extend(wanted)
            if self.running:
                self.restart()

    # -- access ------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.running and self.process else None

    def dsn(self, host: str | None = None, dbname: str = APP_DATABASE,
            user: str = APP_ROLE) -> str:
        """A libpq URI: TCP to `host` (one of `listen`), or the Unix socket when None."""
        if host is None:
            return f"postgresql://{user}@/{dbname}?host={self.socket_dir}&port={self.port}"
        if host not in self.listen:
            raise ValueError(f"the server does not listen on {host}; listen_on() it first")
        return f"postgresql://{user}@{host}:{self.port}/{dbname}"

    def connect(self, dbname: str = APP_DATABASE, user: str = APP_ROLE,
                host: str | None = None) -> psycopg.Connection:
        """A synchronous autocommit connection (for setup and checks)."""
        return psycopg.connect(self.dsn(host, dbname, user), autocommit=True, connect_timeout=5)

    def create_database(self, name: str, owner: str = APP_ROLE) -> str:
        """A fresh empty database (e.g. one per test); dropped with the server."""
        with self.connect(dbname="postgres", user=SUPERUSER) as conn:
            conn.execute(f'CREATE DATABASE "{name}" OWNER "{owner}"')
        return name

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # -- internals ---------------------------------------------------------------------

    def _options(self) -> list[str]:
        settings = {**self.settings,
                    "listen_addresses": ",".join(self.listen),
                    "port": str(self.port),
                    "unix_socket_directories": str(self.socket_dir)}
        options: list[str] = []
        for key, value in settings.items():
            options += ["-c", f"{key}={value}"]
        return options

    def _as_postgres(self) -> dict[str, object]:
        """Popen arguments that run a server binary as the postgres user, from a directory
        and with an environment that user can use."""
        return {
            "user": self._uid, "group": self._gid, "extra_groups": [],
            "cwd": str(self.root),
            "env": {"PATH": f"{self.bindir}:/usr/bin:/bin", "LC_ALL": "C", "TZ": "UTC"},
        }

    def _as_postgres_dir(self, path: Path) -> None:
        path.mkdir(mode=0o700)
        os.chown(path, self._uid, self._gid)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"postgres exited at start:\n{self.log()[-4000:]}")
            try:
                with self.connect(dbname="postgres", user=SUPERUSER):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"postgres not ready in {timeout_s} s:\n{self.log()[-4000:]}"
                    ) from None
                time.sleep(0.02)
