#!/usr/bin/env bash
# Keep a reference build on main: copy its small files (config, fp16 weights ~20 MB, training/eval/gate json, card)
# to reference/builds/<name>/ and commit them, so a new machine (which has lost out/ and every cache) continues it:
#   --stage train --init reference/builds/<name> ...
# Only what lands on main survives a machine change (a side branch did not, session 23). Older builds leave the
# tree (git history keeps them: git show <commit>:reference/builds/<old>/...).
# Usage: scripts/save_build.sh out/reference/<build-folder>
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1%/}"; name="$(basename "$dir")"
[[ -f "$dir/config.json" && -f "$dir/pytorch_model.bin" ]] || { echo "$dir: not a build folder" >&2; exit 2; }
keep="reference/builds/$name"
for old in reference/builds/*/; do
  [[ -d "$old" && "${old%/}" != "$keep" ]] && git rm -rq --ignore-unmatch "${old%/}" && rm -rf "${old%/}"
done
mkdir -p "$keep"
for f in config.json pytorch_model.bin training.json eval.json gate.json README.md; do
  [[ -f "$dir/$f" ]] && cp "$dir/$f" "$keep/$f"
done
git add "$keep"
git commit -qm "reference build $name ($(date -u +%F))" -- reference/builds
git log --oneline -1
