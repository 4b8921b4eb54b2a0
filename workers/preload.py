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

import threading

import torch  # noqa: F401
import tqdm
import transformers  # noqa: F401
from transformers import AutoModel, AutoTokenizer  # noqa: F401

import modelpool.registry.loaders
import modelpool.workers.capabilities
import modelpool.workers.main  # noqa: F401
from modelpool.protocol import logs

# Every tqdm bar, even a disabled one (diffusers makes one per image), would otherwise
# create a named multiprocessing semaphore registered with the daemon's resource
# tracker. A worker leaves with os._exit, so it stays registered and the tracker warned
# "leaked semaphore objects" at every stop. A worker's bars share no terminal with
# another process: a thread lock is all they need.
tqdm.tqdm.set_lock(threading.RLock())
# The daemon's log format (journald priorities, JSON) for what workers log and warn.
logs.configure_from_env()

# Out of the collector's reach already: importing the configured models' modules next
# (their loaders, diffusers, architectures) would otherwise collect this whole heap
# again and again.
gc.freeze()
# Then those modules (registry.loaders.preload_modules), and last workers.preloaded.
