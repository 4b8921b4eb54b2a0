"""torch and transformers, imported once by the forkserver (after workers.preload) when
a configured model needs them; a worker that needs them without it imports them itself."""

from __future__ import annotations

import gc

import torch  # noqa: F401
import transformers  # noqa: F401
from transformers import AutoModel, AutoTokenizer  # noqa: F401

import modelpool.registry.loaders.common  # noqa: F401  (tqdm's lock, set on import)

gc.freeze()  # as in workers.preload: this heap is shared with every worker
