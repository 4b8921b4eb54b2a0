"""The integration suite's fixtures, for the adversarial suite's real daemons (see
adversarial_helpers.py, which loads them)."""

from __future__ import annotations

import pytest
from adversarial_helpers import make_daemon, tiny_llm_dir

__all__ = ["make_daemon", "tiny_llm_dir"]


@pytest.fixture(scope="session", autouse=True)
def _minilm_exported(minilm_export: None) -> None:
    """Daemons here start with MiniLM's export cached (tests/conftest.py)."""
