"""`modelpool install-service [--user|--system] [--print]`: the systemd units of this
installation (supervisor/units/*.in, with ExecStart pointing at this interpreter's
`modelpool`), written where systemd looks for them, and what to run next."""

from __future__ import annotations

import argparse
import os
import sys
from importlib import resources
from pathlib import Path
from typing import Any

UNIT_NAMES = ("modelpool.service", "modelpool.socket")
SYSTEM_DIR = "/etc/systemd/system"
# ProtectHome= in the system unit hides these: an installation under them cannot run.
HOME_DIRS = ("/home", "/root", "/run/user")


def add_service_command(sub: Any) -> None:
    cmd = sub.add_parser(
        "install-service", help="write systemd units (a service and its socket) for this "
        "installation and say how to enable them")
    scope = cmd.add_mutually_exclusive_group()
    scope.add_argument("--user", dest="scope", action="store_const", const="user",
                       help="a user service in ~/.config/systemd/user (the default)")
    scope.add_argument("--system", dest="scope", action="store_const", const="system",
                       help=f"a system service under its own user, in {SYSTEM_DIR}")
    cmd.add_argument("--print", action="store_true",
                     help="write the units to stdout instead of installing them")
    cmd.add_argument("--dir", help="install into this directory instead")
    cmd.set_defaults(func=install_service, scope="user")


def exec_command() -> str:
    """What runs this installation's daemon: the `modelpool` script beside this
    interpreter (a venv's bin/), else the interpreter with -m. Not resolved: a venv's
    python is a symlink whose target would leave the venv."""
    script = Path(sys.executable).parent / "modelpool"
    if script.is_file() and os.access(script, os.X_OK):
        return unit_quote(str(script.absolute()))
    return f"{unit_quote(str(Path(sys.executable).absolute()))} -m modelpool.supervisor.cli"


def unit_quote(word: str) -> str:
    """One word of a unit file's command line: specifiers (%) and variables ($)
    escaped, quoted when it holds spaces or quotes."""
    word = word.replace("%", "%%").replace("$", "$$")
    if any(c.isspace() or c in "\"'\\;" for c in word):
        return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def render(scope: str, command: str | None = None) -> dict[str, str]:
    """The unit files' names and texts for scope ("user" or "system")."""
    command = command or exec_command()
    units = resources.files("modelpool.supervisor").joinpath("units")
    return {name: units.joinpath(f"{name.replace('.', f'-{scope}.')}.in").read_text()
            .replace("@EXEC@", command) for name in UNIT_NAMES}


def unit_dir(scope: str) -> Path:
    if scope == "system":
        return Path(SYSTEM_DIR)
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"),
                                                               ".config")
    return Path(config) / "systemd" / "user"


def system_warnings() -> list[str]:
    """Why the system unit's user (DynamicUser, behind ProtectHome=) could not run this
    installation, if it could not."""
    paths = {Path(sys.executable).absolute(), Path(os.path.realpath(sys.executable)),
             Path(__file__).resolve().parent}
    problems = []
    for path in sorted(paths):
        if any(path == Path(home) or Path(home) in path.parents for home in HOME_DIRS):
            problems.append(f"{path} is under a home directory, which ProtectHome= hides "
                            f"from the system service: install modelpool elsewhere (such "
                            f"as a venv in /opt/modelpool)")
        elif closed := [p for p in (path, *path.parents) if not os.stat(p).st_mode & 0o005]:
            problems.append(f"{path} cannot be reached by the service's own user: {closed[-1]} "
                            f"is not readable and searchable by others")
    return problems


def install_service(args: argparse.Namespace) -> int:
    units = render(args.scope)
    for warning in system_warnings() if args.scope == "system" else []:
        print(f"warning: {warning}", file=sys.stderr)
    if args.print:
        for name, text in units.items():
            print(f"# ---- {name}\n{text}")
        return 0
    directory = Path(args.dir) if args.dir else unit_dir(args.scope)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in units.items():
            (directory / name).write_text(text)
            print(f"wrote {directory / name}")
    except OSError as exc:
        hint = " (run it as root, or use --print)" if args.scope == "system" else ""
        print(f"modelpool: cannot write the units to {directory}: {exc.strerror}{hint}",
              file=sys.stderr)
        return 1
    print(next_steps(args.scope))
    return 0


def next_steps(scope: str) -> str:
    ctl = "systemctl --user" if scope == "user" else "systemctl"
    socket = ("$XDG_RUNTIME_DIR/modelpool.sock" if scope == "user"
              else "/run/modelpool/modelpool.sock, or /run/modelpool.sock with the .socket "
                   "unit (clients: MODELPOOL_SOCKET=...)")
    lines = [
        "Then:",
        f"  {ctl} daemon-reload",
        f"  {ctl} enable --now modelpool.service   # start it now and at "
        f"{'login' if scope == 'user' else 'boot'}",
        "or, to start it at its first client instead:",
        f"  {ctl} enable --now modelpool.socket",
        f"Its socket: {socket}; its log: journalctl {'--user ' if scope == 'user' else ''}"
        f"-u modelpool; its state: {ctl} status modelpool",
        f"Local changes go in a drop-in, which reinstalling keeps: {ctl} edit modelpool.service",
    ]
    if scope == "user":
        lines.append("To keep it running while you are logged out: loginctl enable-linger")
    return "\n".join(lines)
