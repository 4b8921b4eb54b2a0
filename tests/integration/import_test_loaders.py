"""A custom loader that records which process imported its module: the file named by
MP_IMPORT_LOG gets that process's pid, once per import (tests/integration/test_preload.py).
With MP_IMPORT_SLEEP_S, its import takes that long: a forkserver ready that much later."""

from __future__ import annotations

import os
import time
from pathlib import Path

from mp_test_loaders import SlowEmbedder, slow_embedder

from modelpool.registry.spec import ModelSpec

if log := os.environ.get("MP_IMPORT_LOG"):
    with open(log, "a") as imports:
        imports.write(f"{os.getpid()}\n")


def recorded(spec: ModelSpec, model_dir: Path | None) -> SlowEmbedder:
    return slow_embedder(spec, model_dir)

if pause := os.environ.get("MP_IMPORT_SLEEP_S"):
    time.sleep(float(pause))
