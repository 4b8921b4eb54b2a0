"""A config that cannot be served stops the start with one line and exit 2, and a start
that fails after its socket is bound leaves nothing behind."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from modelpool.registry import loaders
from modelpool.registry.loaders import onnx_cache
from modelpool.supervisor import server as server_module
from modelpool.supervisor.config import Config, ConfigError, DaemonConfig, load_config
from modelpool.supervisor.startcheck import check_models

ROOT = Path(__file__).resolve().parents[2]


def config_with(tmp_path: Path, entry: str) -> Config:
    path = tmp_path / "c.toml"
    path.write_text(f'[[models]]\nkey = "m"\n{entry}\n')
    return load_config(path)


def test_a_missing_path_is_refused_by_name(tmp_path: Path) -> None:
    config = config_with(tmp_path, f'capability = "text_embedding"\npath = "{tmp_path}/no"')
    with pytest.raises(ConfigError, match=r"models\[0\] \(m\): .*no does not exist"):
        check_models(config)


def test_unknown_options_are_refused_by_name_with_what_the_loader_takes(
        tmp_path: Path) -> None:
    config = config_with(tmp_path, f'capability = "rerank"\npath = "{tmp_path}"\n'
                         'options = { dtype = "float32", activaton = "none" }')
    with pytest.raises(ConfigError) as err:
        check_models(config)
    assert "'activaton'" in str(err.value) and "activation, dtype, max_length" in str(err.value)


@pytest.mark.parametrize("capability", ["text_to_text", "vision"])
def test_generation_takes_a_context(tmp_path: Path, capability: str) -> None:
    entry = f'capability = "{capability}"\npath = "{tmp_path}"\noptions = {{ context = 256 }}'
    assert check_models(config_with(tmp_path, entry)) == []
    with pytest.raises(ConfigError, match=r"'contxt'.*takes context, dtype"):
        check_models(config_with(tmp_path, entry.replace("context", "contxt")))


def test_custom_loaders_keep_their_own_options(tmp_path: Path) -> None:
    config = config_with(tmp_path, 'capability = "rerank"\nloader = "m:f"\noptions = { x = 1 }')
    assert check_models(config) == []


def test_a_repo_not_in_the_cache_is_a_warning_naming_pull(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    config = config_with(tmp_path, 'capability = "text_to_text"\nrepo = "org/m"')
    (warning,) = check_models(config)
    assert "run `modelpool pull m`" in warning


@pytest.mark.parametrize(("daemon", "expected"), [
    ('log_level = "LOUD"', "log_level 'LOUD' is not one of DEBUG"),
    ('socket_group = "no-such-group-mp"', "no group 'no-such-group-mp'"),
])
def test_daemon_field_errors_are_one_line_and_exit_2(tmp_path: Path, daemon: str,
                                                     expected: str) -> None:
    config = tmp_path / "c.toml"
    socket_dir = tmp_path / "s"
    config.write_text(f'[daemon]\n{daemon}\nsocket = "{socket_dir}/mp.sock"\n')
    run = subprocess.run([sys.executable, "-m", "modelpool.supervisor.cli", "serve",
                          "--config", str(config)], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and expected in run.stderr, run.stderr
    assert not socket_dir.exists()


def test_a_start_that_fails_after_binding_removes_its_socket_and_cgroup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    socket_path = f"/tmp/mpt-start-{os.getpid()}/mp.sock"
    made: list[Path | None] = []
    real_enter = server_module.cgroups.enter

    def enter(enabled: bool) -> Path | None:
        made.append(real_enter(enabled))
        return made[-1]

    def broken() -> int:
        assert os.path.exists(socket_path)  # bound by now
        raise RuntimeError("the start fails here")

    monkeypatch.setattr(server_module.cgroups, "enter", enter)
    monkeypatch.setattr(server_module.shm, "remove_stale_segments", broken)
    # serve() sets these for its forkserver and workers: gone again after this test,
    # or a later one in this process would take itself for a daemon's worker
    for name in (onnx_cache.EXPORTS_BY_DAEMON_ENV, loaders.LOADER_MODULES_ENV):
        monkeypatch.setenv(name, "")
    config = msgspec.structs.replace(Config(), daemon=DaemonConfig(socket=socket_path))
    with pytest.raises(RuntimeError, match="the start fails here"):
        asyncio.run(server_module.serve(config))
    assert not os.path.exists(socket_path)
    assert made and (made[0] is None or not made[0].exists())
    os.rmdir(os.path.dirname(socket_path))
