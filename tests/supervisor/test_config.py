"""The daemon config: defaults, errors that name their path, registry merging, socket path."""

from __future__ import annotations

import getpass
from pathlib import Path

import pytest

from modelpool.protocol.paths import default_socket_path
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor.config import Config, ConfigError, PoolConfig, load_config

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MODELPOOL_CONFIG", raising=False)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "modelpool.toml"
    path.write_text(text)
    return path


def test_defaults_without_path_or_env() -> None:
    config = load_config()
    assert config.pool == PoolConfig()
    assert config.pool.max_workers_per_model == 0  # auto: cpus / threads
    assert config.pool.cold_start_workers == 2
    assert config.pool.cooldown_idle_s == 60.0
    assert config.pool.memory_fraction == 0.80
    assert config.pool.shutdown_timeout_s == 5.0
    assert config.pool.timeout_s == 30.0
    assert config.models == []


def test_values_are_read(tmp_path: Path) -> None:
    path = write(tmp_path, '[pool]\nmax_workers_per_model = 7\n[daemon]\nlog_level = "DEBUG"\n')
    config = load_config(path)
    assert config.pool.max_workers_per_model == 7
    assert config.daemon.log_level == "DEBUG"
    assert config.pool.cooldown_idle_s == 60.0  # untouched fields keep their defaults


def test_request_defaults_are_read_and_checked(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[defaults]\nmax_tokens = 64\nsteps = 4\n"))
    assert (config.defaults.max_tokens, config.defaults.steps) == (64, 4)
    assert config.defaults.temperature == 1.0  # the rest keep their built-in values
    with pytest.raises(ConfigError, match=r"defaults\.top_p"):
        load_config(write(tmp_path, "[defaults]\ntop_p = 2.0\n"))
    with pytest.raises(ConfigError, match="max_tokenz"):
        load_config(write(tmp_path, "[defaults]\nmax_tokenz = 5\n"))


def test_wrong_type_names_the_path(tmp_path: Path) -> None:
    path = write(tmp_path, '[pool]\nmax_workers_per_model = "four"\n')
    with pytest.raises(ConfigError, match=r"\$\.pool\.max_workers_per_model") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_out_of_range_value_names_the_path(tmp_path: Path) -> None:
    path = write(tmp_path, "[pool]\nmemory_fraction = 1.5\n")
    with pytest.raises(ConfigError, match=r"\$\.pool\.memory_fraction"):
        load_config(path)


def test_unknown_field_is_refused_by_name(tmp_path: Path) -> None:
    path = write(tmp_path, "[pool]\nmax_wrokers = 3\n")
    with pytest.raises(ConfigError, match="max_wrokers"):
        load_config(path)


def test_unknown_section_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="poool"):
        load_config(write(tmp_path, "[poool]\nx = 1\n"))


def test_model_with_path_and_repo_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, '[[models]]\nkey = "m"\ncapability = "text_embedding"\n'
                           'path = "/models/m"\nrepo = "org/m"\n')
    with pytest.raises(ConfigError, match=r"only one of path, package, repo") as info:
        load_config(path)
    assert "$.models[0]" in str(info.value)


def test_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_config(write(tmp_path, "[pool\n"))


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=r"nope\.toml"):
        load_config(missing)


def test_env_var_is_honoured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "[pool]\ncooldown_idle_s = 5\n")
    monkeypatch.setenv("MODELPOOL_CONFIG", str(path))
    assert load_config().pool.cooldown_idle_s == 5.0


def test_explicit_path_beats_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPOOL_CONFIG", str(tmp_path / "missing.toml"))
    path = write(tmp_path, "[pool]\nmax_batch = 8\n")
    assert load_config(path).pool.max_batch == 8


def test_registry_has_catalogue_minilm_as_default() -> None:
    registry = Config().registry()
    spec = registry.resolve("minilm")
    assert spec is not None and spec.key == MINILM
    assert registry.resolve(MINILM) is spec
    assert registry.defaults["text_embedding"] == MINILM


def test_config_model_overrides_catalogue_entry(tmp_path: Path) -> None:
    path = write(tmp_path, f'[[models]]\nkey = "{MINILM}"\ncapability = "text_embedding"\n'
                           f'path = "{tmp_path}"\naliases = ["mine"]\n')
    registry = load_config(path).registry()
    spec = registry.resolve(MINILM)
    assert spec is not None and spec.source == f"path:{tmp_path}"
    assert registry.resolve("mine") is spec
    # The override replaces the whole entry, its aliases included.
    assert registry.resolve("minilm") is None
    assert registry.defaults["text_embedding"] == MINILM
    assert sum(1 for key in registry.specs if key == MINILM) == 1


def test_config_model_extends_catalogue(tmp_path: Path) -> None:
    extra = ModelSpec(key="my/llm", capability="text_to_text", path=str(tmp_path), default=True)
    registry = Config(models=[extra]).registry()
    assert registry.resolve("MY/LLM") is extra
    assert registry.defaults["text_to_text"] == "my/llm"
    assert registry.resolve("minilm") is not None  # the catalogue is still there


# ---- socket path ---------------------------------------------------------------------


def test_socket_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MODELPOOL_SOCKET", str(tmp_path / "x.sock"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket_path() == str(tmp_path / "x.sock")


def test_socket_in_xdg_runtime_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MODELPOOL_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket_path() == str(tmp_path / "modelpool.sock")


def test_socket_fallback_in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MODELPOOL_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "does-not-exist"))
    expected = f"/tmp/modelpool-{getpass.getuser()}/modelpool.sock"
    assert default_socket_path() == expected
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket_path() == expected


def test_daemon_socket_default_follows_env(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    monkeypatch.setenv("MODELPOOL_SOCKET", str(tmp_path / "d.sock"))
    assert load_config().daemon.socket == str(tmp_path / "d.sock")


# ---- cluster --------------------------------------------------------------------------


def test_cluster_settings_their_defaults_and_modelpool_postgres(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MODELPOOL_POSTGRES", raising=False)
    default = load_config().cluster
    assert (default.dsn, default.node_name, default.lease_s, default.route_remote) \
        == ("", "", 10.0, True)  # no cluster; the daemon names a node after its host
    monkeypatch.setenv("MODELPOOL_POSTGRES", "postgresql://env@db/a")
    assert load_config().cluster.dsn == "postgresql://env@db/a"  # without a config too
    config = load_config(write(tmp_path, '[cluster]\npostgres = "postgresql://cfg@db/b"\n'
                                         'node_name = "n1"\nlease_s = 2.5\n'
                                         "route_remote = false\n")).cluster
    assert config.dsn == "postgresql://cfg@db/b"  # the config's wins over the environment
    assert (config.node_name, config.lease_s, config.route_remote) == ("n1", 2.5, False)
    with pytest.raises(ConfigError, match=r"\$\.cluster\.lease_s"):
        load_config(write(tmp_path, "[cluster]\nlease_s = 0\n"))
    with pytest.raises(ConfigError, match="postgress"):
        load_config(write(tmp_path, '[cluster]\npostgress = "postgresql://x"\n'))
