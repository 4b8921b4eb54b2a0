"""The event loop the daemon runs on: uvloop where installed unless asyncio's is asked
for; "uvloop" without it is a config error."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from modelpool.supervisor import eventloop
from modelpool.supervisor.config import ConfigError, load_config


async def _name() -> str:
    await asyncio.sleep(0)
    return eventloop.running_loop_name()


def test_auto_runs_uvloop_when_installed_and_asyncio_on_request() -> None:
    pytest.importorskip("uvloop", reason="uvloop is not installed here")
    assert eventloop.run(_name(), "auto") == "uvloop"
    assert eventloop.run(_name(), "uvloop") == "uvloop"
    assert eventloop.run(_name(), "asyncio") == "asyncio"


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvloop" else real(name, *a))
    assert eventloop.run(_name(), "auto") == "asyncio"
    path = tmp_path / "modelpool.toml"
    path.write_text('[daemon]\nevent_loop = "uvloop"\n')
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        load_config(path)
    path.write_text('[daemon]\nevent_loop = "asyncio"\n')
    assert load_config(path).daemon.event_loop == "asyncio"


def test_an_unknown_loop_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "modelpool.toml"
    path.write_text('[daemon]\nevent_loop = "trio"\n')
    with pytest.raises(ConfigError, match=r"\$\.daemon\.event_loop"):
        load_config(path)
