"""The custom loaders' modules, imported once by the forkserver (registry.loaders:
LOADER_MODULES_ENV names them), so that each worker starts with what its loader imports:
torch only for a loader that imports it.

A module that fails here is left to its own workers, whose load fails with the error and
is reported for that model alone; the forkserver, which forks every model's workers, goes
on. Its ImportError would be swallowed by multiprocessing anyway; anything else would end
the forkserver.
"""

from __future__ import annotations

import importlib
import os

from modelpool.registry.loaders import LOADER_MODULES_ENV

for name in filter(None, os.environ.get(LOADER_MODULES_ENV, "").split(",")):
    try:
        importlib.import_module(name)
    except Exception:  # its workers report it, as above
        continue
