"""Imported once by the forkserver so every forked worker starts with these in memory.

Never touch CUDA here: a forked child of a process that initialised CUDA cannot use it.
"""

from __future__ import annotations

import gc
import os

# Loading progress bars would spam the daemon's log from every worker.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: F401
import transformers  # noqa: F401
from transformers import AutoModel, AutoTokenizer  # noqa: F401

import modelpool.registry.loaders
import modelpool.workers.capabilities
import modelpool.workers.main  # noqa: F401

# Out of the collector's reach already: importing the configured models' modules next
# (their loaders, diffusers, architectures) would otherwise collect this whole heap
# again and again.
gc.freeze()
# Then those modules (registry.loaders.preload_modules), and last workers.preloaded.
