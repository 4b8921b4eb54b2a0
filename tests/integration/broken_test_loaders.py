"""A custom loader whose module fails at import with an error that is not an ImportError
(tests/integration/test_preload.py)."""

from __future__ import annotations

raise RuntimeError("broken at import")
