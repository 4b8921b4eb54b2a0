"""The integration suite's fixtures, for the adversarial suite's real daemons (see
adversarial_helpers.py, which loads them)."""

from __future__ import annotations

from adversarial_helpers import make_daemon, tiny_llm_dir

__all__ = ["make_daemon", "tiny_llm_dir"]
