"""Which GPUs this machine has, asked of nvidia-smi so the supervisor never initialises
CUDA (a process that has cannot fork workers that use it)."""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass

log = logging.getLogger("modelpool.gpus")

QUERY = ["--query-gpu=index,memory.total,name", "--format=csv,noheader,nounits"]
PROCESS_QUERY = ["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
_failed_queries: set[str] = set()


@dataclass(frozen=True)
class Gpu:
    index: int
    total_mb: float
    name: str

    @property
    def device(self) -> str:
        return f"cuda:{self.index}"


def parse_nvidia_smi(text: str) -> list[Gpu]:
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) == 3 and parts[0].isdigit():
            try:
                gpus.append(Gpu(int(parts[0]), float(parts[1]), parts[2]))
            except ValueError:
                continue
    return gpus


def parse_compute_apps(text: str) -> dict[int, float]:
    """pid -> MiB of VRAM, summed over GPUs; processes it cannot measure ("[N/A]" in a
    container without the host's pid namespace) are left out."""
    used: dict[int, float] = {}
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                used[int(parts[0])] = used.get(int(parts[0]), 0.0) + float(parts[1])
            except ValueError:
                continue
    return used


def _nvidia_smi(query: list[str]) -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        return subprocess.run([smi, *query], capture_output=True, text=True, timeout=10,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        # Asked every few seconds: a broken query is worth one warning, not one each time.
        level = logging.DEBUG if query[0] in _failed_queries else logging.WARNING
        _failed_queries.add(query[0])
        log.log(level, "nvidia-smi %s failed: %s", query[0], exc)
        return None


def discover() -> list[Gpu]:
    out = _nvidia_smi(QUERY)
    if out is None:
        return []  # serving on the CPU only
    return parse_nvidia_smi(out)


def process_vram_mb() -> dict[int, float]:
    """Each process's whole VRAM: what torch reserved plus its CUDA context (a few
    hundred MiB that torch cannot see). Blocks for tens of milliseconds: call it off
    the event loop."""
    out = _nvidia_smi(PROCESS_QUERY)
    return {} if out is None else parse_compute_apps(out)


def resolve_device(requested: str, gpus: list[Gpu]) -> str | None:
    """"cpu" or "cuda:N" for a model's device setting, or None when this machine has no
    such device."""
    if requested == "cpu":
        return "cpu"
    if requested == "auto":
        return gpus[0].device if gpus else "cpu"
    if requested == "cuda":
        return gpus[0].device if gpus else None
    if requested.startswith("cuda:") and requested[5:].isdigit():
        return requested if int(requested[5:]) < len(gpus) else None
    return None
