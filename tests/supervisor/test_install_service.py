"""`modelpool install-service`: the units it renders and writes, and what systemd's own
tools say of them (skipped, saying so, where systemd-analyze is absent)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from modelpool.supervisor import cli_service
from modelpool.supervisor.cli import main

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze is absent (Debian's `systemd` package has it; "
    ".ci/run installs it)")
MAX_EXPOSURE = 3.0
ROOT = Path(__file__).resolve().parents[2]


def installed(tmp_path: Path, scope: str, capsys: pytest.CaptureFixture[str]) -> Path:
    target = tmp_path / scope
    assert main(["install-service", f"--{scope}", "--dir", str(target)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {target / 'modelpool.service'}" in out
    assert "enable --now modelpool.service" in out
    return target


@pytest.mark.parametrize("scope", ["user", "system"])
def test_units_point_at_this_installation(scope: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    target = installed(tmp_path, scope, capsys)
    service = (target / "modelpool.service").read_text()
    exec_start = re.search(r"^ExecStart=(.*)$", service, re.MULTILINE)
    assert exec_start is not None
    program = exec_start.group(1).split()[0]
    assert os.access(program, os.X_OK) and Path(program).parent == Path(sys.executable).parent
    assert "@EXEC@" not in service  # every placeholder filled
    for setting in ("Type=notify", "NotifyAccess=main", "WatchdogSec=", "KillMode=mixed",
                    "OOMPolicy=continue", "LimitNOFILE=", "ExecReload=/bin/kill -HUP $MAINPID"):
        assert f"\n{setting}" in service
    settings = [line for line in service.splitlines() if not line.startswith("#")]
    assert not [line for line in settings if "network.target" in line]
    assert not [line for line in settings if "HF_HUB_OFFLINE" in line]  # the user's choice
    assert "ListenStream=" in (target / "modelpool.socket").read_text()


def test_the_system_unit_has_its_own_user_and_directories(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    service = (installed(tmp_path, "system", capsys) / "modelpool.service").read_text()
    for setting in ("DynamicUser=yes", "RuntimeDirectory=modelpool", "StateDirectory=",
                    "CacheDirectory=modelpool", "Environment=HF_HOME=%C/modelpool",
                    "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                    "NoNewPrivileges=yes", "SystemCallFilter=@system-service",
                    "RestrictAddressFamilies=", "DeviceAllow=char-nvidia"):
        assert f"\n{setting}" in service
    assert "MemoryDenyWriteExecute" in service  # ... said why it is left out


def test_print_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert main(["install-service", "--print"]) == 0
    out = capsys.readouterr().out
    assert "# ---- modelpool.service" in out and "# ---- modelpool.socket" in out
    assert "ListenStream=%t/modelpool.sock" in out
    assert not (tmp_path / "systemd").exists()


def test_the_user_units_go_where_the_user_manager_looks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert main(["install-service"]) == 0
    assert (tmp_path / "systemd" / "user" / "modelpool.service").is_file()
    assert "systemctl --user daemon-reload" in capsys.readouterr().out


def test_a_directory_it_cannot_write_is_one_line(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["install-service", "--system", "--dir", str(blocker / "units")]) == 1
    err = capsys.readouterr().err
    assert "cannot write the units" in err and "Traceback" not in err


def test_exec_paths_are_quoted_for_systemd() -> None:
    assert cli_service.unit_quote("/opt/modelpool/bin/modelpool") == (
        "/opt/modelpool/bin/modelpool")
    assert cli_service.unit_quote("/opt/my models/bin/modelpool") == (
        '"/opt/my models/bin/modelpool"')
    assert cli_service.unit_quote("/opt/100%/$HOME") == "/opt/100%%/$$HOME"


def test_an_installation_in_a_home_directory_is_flagged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_service.sys, "executable", "/home/alice/.venv/bin/python")
    warnings = cli_service.system_warnings()
    assert any("/home/alice/.venv/bin/python is under a home directory" in w
               for w in warnings)


def test_a_built_wheel_carries_the_units_and_the_catalog_without_a_packaging_warning(
        tmp_path: Path) -> None:
    """What `pip install` of the project gets, not the checkout the other tests read: the
    unit templates and the catalog are package data, and setuptools warns (and says that
    it may drop them) when a data directory is not a package it was told of."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "tests", "models", "build", "*.egg-info", "__pycache__", ".*_cache",
        ".hypothesis"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(tmp_path / "wheel"), str(source)],
        capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    assert "Warning" not in built.stdout + built.stderr, built.stdout + built.stderr
    (wheel,) = (tmp_path / "wheel").glob("modelpool-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"modelpool/supervisor/units/modelpool-{scope}.{unit}.in"
            for scope in ("user", "system") for unit in ("service", "socket")} <= names
    assert "modelpool/registry/catalog.toml" in names


def analyze(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    return subprocess.run([ANALYZE, *args], capture_output=True, text=True, timeout=120,
                          env=env)


@needs_analyze
@pytest.mark.parametrize("scope", ["user", "system"])
def test_systemd_analyze_verify_is_clean(scope: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    target = installed(tmp_path, scope, capsys)
    runtime = tmp_path / "runtime"  # a user manager needs one to resolve %t
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    flags = ["--user"] if scope == "user" else []
    result = analyze("verify", *flags, str(target / "modelpool.service"),
                     str(target / "modelpool.socket"), env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "" and result.stdout.strip() == ""


@needs_analyze
def test_the_system_unit_is_exposed_at_most_3(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    target = installed(tmp_path, "system", capsys)
    result = analyze("security", "--offline=true", str(target / "modelpool.service"))
    found = re.search(r"Overall exposure level for modelpool\.service: ([0-9.]+)",
                      result.stdout)
    assert found is not None, result.stdout + result.stderr
    assert float(found.group(1)) <= MAX_EXPOSURE, result.stdout
