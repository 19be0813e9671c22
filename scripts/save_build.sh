#!/usr/bin/env bash
# Commit a reference build's small files (config, weights, training/eval/gate json, card) to branch `builds`, so a
# machine change (which loses out/ and every cache) keeps it; main's work tree and index are not touched.
# Usage: scripts/save_build.sh out/reference/<build-folder>   (next session: git show builds:<name>/<file>)
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1%/}"; name="$(basename "$dir")"
# a clone may hold the branch only as origin/builds: continue that one
git rev-parse -q --verify builds >/dev/null || git branch builds origin/builds 2>/dev/null || true
export GIT_INDEX_FILE="$(mktemp)"
rm -f "$GIT_INDEX_FILE"
git read-tree builds 2>/dev/null || true  # a first build starts the branch
for f in config.json pytorch_model.bin training.json eval.json gate.json README.md; do
  [[ -f "$dir/$f" ]] || continue
  blob=$(git hash-object -w "$dir/$f")
  git update-index --add --cacheinfo 100644 "$blob" "$name/$f"
done
tree=$(git write-tree)
parent=$(git rev-parse -q --verify builds >/dev/null && echo "-p builds" || true)
commit=$(git commit-tree "$tree" $parent -m "build $name ($(date -u +%F))")
git update-ref refs/heads/builds "$commit"
rm -f "$GIT_INDEX_FILE"
git log --oneline -1 builds
