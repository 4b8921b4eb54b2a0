# Shared by scripts/serve and scripts/test: create .venv once, (re)install when the
# project's dependency files change. Sourced, not run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON="${PYTHON:-python3}"

ensure_venv() {
    local extras="$1"   # "" or "[dev]"
    local stamp="$VENV/.modelpool-installed$extras"
    local want
    want="$(cat "$ROOT/pyproject.toml" "$ROOT/constraints/cpu.txt" | sha256sum | cut -d' ' -f1)"
    if [[ ! -x "$VENV/bin/python" ]]; then
        "$PYTHON" -m venv "$VENV"
    fi
    if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
        "$VENV/bin/python" -m pip install --quiet --upgrade pip
        # Without a GPU, pin the CPU torch build; with one, let pip pick from pyproject's range.
        local constraints=(-c "$ROOT/constraints/cpu.txt")
        if command -v nvidia-smi >/dev/null 2>&1 && [[ "${MODELPOOL_CPU_ONLY:-0}" != 1 ]]; then
            constraints=()
        fi
        "$VENV/bin/python" -m pip install --quiet "${constraints[@]}" -e "$ROOT$extras"
        echo "$want" > "$stamp"
    fi
}
