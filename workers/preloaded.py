"""Imported by the forkserver last, after workers.preload and the configured models'
modules: what must follow every import."""

from __future__ import annotations

import gc

from modelpool.workers import priority

# Everything imported is shared copy-on-write with every forked worker. Moving it out of
# the garbage collector's reach keeps a collection from writing to (and so copying) the
# pages of those objects (~40 MB per idle worker, measured, without it). A fresh worker
# inherits fewer than a thousand objects that were made after this.
gc.freeze()

# After the imports, which start-up waits for: from here on every worker is forked idle.
priority.lower()
