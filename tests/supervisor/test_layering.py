"""The design's layering rules, checked: the supervisor knows no model family, and
never imports the heavy libraries its workers use."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SUPERVISOR = Path(__file__).resolve().parents[2] / "supervisor"
FAMILIES = re.compile(r"bert|llama|clip|llava|minilm|qwen|diffusion|sentence.transformers|"
                      r"tokeni[sz]", re.IGNORECASE)


def test_no_model_family_is_named_in_the_supervisor() -> None:
    hits = [f"{path.name}:{n}: {line.strip()}"
            for path in sorted(SUPERVISOR.glob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if FAMILIES.search(line)]
    assert hits == []


def test_the_supervisor_imports_no_ml_library() -> None:
    code = ("import sys, modelpool.supervisor.server, modelpool.supervisor.cli; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'transformers', 'diffusers', 'PIL', 'numpy', 'scipy'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=SUPERVISOR.parent, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_no_file_of_the_supervisor_or_its_front_doors_knows_a_tokenizer() -> None:
    """The HTTP front door serves tokenize as an operation of the kinds table; the
    tokenizer itself is the worker's (workers/capabilities/tokens.py)."""
    hits = [f"{path.relative_to(SUPERVISOR)}:{n}"
            for path in sorted(SUPERVISOR.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if re.search("tokenizer", line, re.IGNORECASE)]
    assert hits == []
