"""Where exported ONNX models live on disk, and what decided them. Free of torch.

An entry is a directory named by a hash of everything its export depends on: the model's
files (path, size, modification time), its capability and the options that change what
it computes, the versions of torch, transformers, tokenizers, onnx and onnxruntime, and
the CPU's instruction sets (the entry holds weights prepacked for them). A changed file,
an upgrade or another kind of CPU makes a new key, so an entry is never stale; it is
written whole into a temporary directory and renamed into place, so a reader never sees
half of one.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import importlib.metadata
import os
import platform
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import msgspec

from modelpool.registry.content import cache_dir
from modelpool.registry.spec import ModelSpec

FORMAT = "4"  # bump when the export or the manifest changes
VERSIONED = ("torch", "transformers", "tokenizers", "onnx", "onnxruntime")
MANIFEST = "manifest.json"
MODEL_FILE = "model.onnx"
TOKENIZER_FILE = "tokenizer.json"
REFERENCE_FILE = "reference.npy"  # eager PyTorch's outputs for the reference inputs
# Set for a daemon's workers: an export to make is the daemon's (supervisor/exports.py),
# which charges its peak to the memory budget, not the loading worker's.
EXPORTS_BY_DAEMON_ENV = "MODELPOOL_EXPORTS_BY_DAEMON"


# The capabilities whose built-in loader can run an export, and the options that change
# what their graph computes (part of an entry's key).
OUTPUT_OPTIONS = {
    "text_embedding": ("pooling", "normalize", "max_seq_length", "dtype"),
    "rerank": ("activation", "max_length", "dtype"),
}


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """What an export found, so that the next load decides without exporting."""

    choice: Literal["onnx", "eager"]  # what "auto" runs
    reason: str  # why, in words (shown in status)
    inputs: list[str] = []  # the graph's inputs, from the tokenizer's encodings
    lowercase: bool = False  # lower-case texts before tokenizing, as eager does
    max_seq_length: int = 0
    dim: int = 0
    activation: str = ""  # rerank: the scores' ("sigmoid", "none")
    min_cosine: float | None = None  # embeddings: against eager on the reference texts
    max_score_error: float | None = None  # rerank: against eager on the reference pairs
    eager_ms: float | None = None  # the reference set, same threads, best of a few
    onnx_ms: float | None = None

    @property
    def checked(self) -> bool:
        """Whether the export's outputs matched eager PyTorch's when it was made."""
        return self.min_cosine is not None or self.max_score_error is not None


_PR_SET_NAME = 15  # prctl(2)
EXPORT_TIMEOUT_S = 600  # a load's own bound (load_timeout_s) is the same by default
# An export's process at its peak: what it imports (torch, transformers, onnx) and a few
# copies of the weights (the eager model, its traced graph, the ONNX model, the session
# that checks it). Measured 2026-11-27 (peak RSS of export_command): 578, 781 and 2,159
# MiB for BERTs of 26, 87 and 415 MiB of weights alone, and MiniLM's 871 under the
# whole test suite (its RSS counts the shared libraries' pages it maps, which vary);
# this line lies 14-27% above all of them. With the fusions (onnx_fusion), 2026-11-29:
# 629, 774 and 2,148 MiB for 43, 87 and 418 MiB (the line 16-28% above them).
EXPORT_BASE_MB = 600.0
EXPORT_PER_WEIGHTS_MB = 4.5


class ExportNotMade(Exception):
    """A model that must run its ONNX export has none yet, and a daemon makes it."""

    def __init__(self, entry: Path, model_dir: Path) -> None:
        super().__init__(f"no ONNX export in {entry} yet: the daemon makes it")
        self.entry, self.model_dir = entry, model_dir


def export_peak_mb(weights_mb: float) -> float:
    """The memory an export of a model with this much weight is expected to peak at."""
    return EXPORT_BASE_MB + EXPORT_PER_WEIGHTS_MB * weights_mb


def cache_root() -> Path:
    """The exports' place in modelpool's cache directory (registry/content.py)."""
    return cache_dir() / "onnx"


def entry_key(spec: ModelSpec, model_dir: Path) -> str:
    digest = hashlib.sha256(f"modelpool-onnx {FORMAT}\n".encode())
    for name in VERSIONED:
        digest.update(f"{name} {_version(name)}\n".encode())
    options = {k: spec.options.get(k) for k in OUTPUT_OPTIONS[spec.capability]}
    digest.update(f"{spec.capability} ".encode() + msgspec.json.encode(options) + b"\n")
    digest.update(f"cpu {cpu_fingerprint()}\n".encode())
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.relative_to(model_dir)} {stat.st_size} "
                      f"{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


@functools.cache
def cpu_fingerprint() -> str:
    """The machine and its instruction-set flags: ONNX Runtime's prepacked layouts are
    made for the kernels this CPU runs, so a cache copied to another kind of CPU (a
    shared home, an image built elsewhere) must not be read there."""
    flags = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        flags = next((line.split(":", 1)[1].strip() for line in info
                      if line.startswith(("flags", "Features"))), "")
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:16]


def entry_dir(spec: ModelSpec, model_dir: Path) -> Path:
    return cache_root() / entry_key(spec, model_dir)


def read_manifest(entry: Path) -> Manifest | None:
    try:
        return msgspec.json.decode((entry / MANIFEST).read_bytes(), type=Manifest)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def cached_choice(spec: ModelSpec, model_dir: Path | None) -> str | None:
    """What a load of this model will run ("onnx" or "eager"), when that is known without
    loading anything; None when an export is still to be made (or could not be checked)."""
    if unsupported(spec) is not None:  # eager, whatever the cache holds
        return "eager"
    if model_dir is None:
        return None
    try:
        manifest = read_manifest(entry_dir(spec, model_dir))
    except OSError:
        return None
    if manifest is None:
        return None
    return "onnx" if spec.execution == "onnx" else manifest.choice


@contextlib.contextmanager
def exporting(entry: Path) -> Iterator[Path | None]:
    """Hold the entry's lock; yield a fresh directory to fill, or None when another
    process finished the entry while this one waited. What was filled becomes the entry
    at exit, unless an exception leaves."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f"{entry.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # workers loading together export once
        if read_manifest(entry) is not None:
            yield None
            return
        for left in entry.parent.glob(f".{entry.name}-*"):  # an export killed half-way
            shutil.rmtree(left, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
        try:
            yield work
            if entry.exists():  # an entry without a manifest: a crash left it
                shutil.rmtree(entry)
            os.rename(work, entry)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def unsupported(spec: ModelSpec) -> str | None:
    """Why this model cannot run an export, or None."""
    if spec.execution == "eager":
        return "execution = \"eager\""
    if spec.device not in ("auto", "cpu"):
        return f"device {spec.device}: ONNX runs on the CPU here"
    if spec.weights_holder == "on":
        return "weights_holder = \"on\" shares torch tensors"
    if spec.options.get("dtype", "float32") != "float32":
        return f"dtype {spec.options['dtype']}: the export is float32"
    return None


def export_payload(spec: ModelSpec, model_dir: Path, entry: Path) -> bytes:
    """What an export reads: [spec, model dir, entry dir] as msgpack."""
    return msgspec.msgpack.encode([spec, str(model_dir), str(entry)])


def export_command(spec: ModelSpec, model_dir: Path, entry: Path) -> tuple[list[str], bytes]:
    """The export's process (registry/loaders/onnx_export.py) and what it reads on stdin.
    -I: nothing from the working directory or the user's site; the package is found where
    this interpreter's site-packages says."""
    argv = [sys.executable, "-I", "-m", "modelpool.registry.loaders.onnx_export"]
    return argv, export_payload(spec, model_dir, entry)


def export_forked(payload: bytes, result: socket.socket, output: socket.socket) -> None:
    """The daemon's export, in a process forked from its forkserver, which has imported
    torch and the model's modules for its eager workers (a fresh interpreter took ~11 s
    more for MiniLM's). At idle CPU priority from its start, before any thread; named
    `onnx_export` (its comm, which ps -o comm and top show). What it prints and warns goes
    to `output`, the manifest (JSON) to `result`."""
    with contextlib.suppress(OSError):  # serving comes first
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    with contextlib.suppress(OSError, AttributeError):  # Linux only
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, b"onnx_export", 0, 0, 0)
    for fd in (1, 2):
        os.dup2(output.fileno(), fd)
    from modelpool.registry.loaders import onnx_export  # torch: imported in the fork

    result.sendall(onnx_export.export_from_payload(payload))


def export_failure(returncode: int, stderr: bytes) -> str:
    """A failed export process in words: its exit code and the last line it wrote."""
    tail = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
    return f"ONNX export exited with {returncode}: {tail[0]}"


@functools.cache  # fixed for the process; every entry key asks for five
def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"
