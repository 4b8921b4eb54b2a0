"""Imported once by the forkserver so every forked worker starts with these in memory.

Never touch CUDA here: a forked child of a process that initialised CUDA cannot use it.
torch and transformers come in `workers.preload_torch`, which the forkserver imports
only when a configured model needs them (registry.loaders.preload_modules): a daemon
whose models all run cached ONNX exports starts its first worker without them.
"""

from __future__ import annotations

import gc
import os

# Loading progress bars would spam the daemon's log from every worker.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import modelpool.registry.loaders
import modelpool.workers.capabilities
import modelpool.workers.main  # noqa: F401
from modelpool.protocol import logs

# The daemon's log format (journald priorities, JSON) for what workers log and warn.
logs.configure_from_env()

# Out of the collector's reach already: importing the configured models' modules next
# (torch, their loaders, diffusers, architectures) would otherwise collect this whole
# heap again and again.
gc.freeze()
# Then those modules (registry.loaders.preload_modules), and last workers.preloaded.
