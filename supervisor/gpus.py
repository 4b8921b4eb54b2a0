"""Which GPUs this machine has, asked of nvidia-smi so the supervisor never initialises
CUDA (a process that has cannot fork workers that use it)."""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass

log = logging.getLogger("modelpool.gpus")

QUERY = ["--query-gpu=index,memory.total,name", "--format=csv,noheader,nounits"]


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


def discover() -> list[Gpu]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, *QUERY], capture_output=True, text=True, timeout=10,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed (%s): serving on the CPU only", exc)
        return []
    return parse_nvidia_smi(out)


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
