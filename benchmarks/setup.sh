#!/usr/bin/env bash
# The benchmark's virtual environments, under benchmarks/.venvs/:
#   torch/  torch (always pinned: a plain `pip install torch` pulls a multi-GB CUDA build) + matplotlib for the chart
#   fork/   the fork built from this checkout (`pip install <repo root> <repo root>/packaging/pytorch-lightning`)
#   stock/  stock `lightning==2.6.6` from the package index; the hand-written PyTorch loop runs here too
# fork/ and stock/ see torch/'s packages through a .pth file, so both load the very same torch files: the contenders
# differ only by their `lightning`, not by two copies of libtorch laid out differently in memory and page cache.
# Idempotent: torch and the stock package are installed once; the fork is rebuilt from the checkout on every call.
#
# Environment: PYTHON (interpreter that creates the venvs, default python3), TORCH (default torch==2.13.0),
#              BENCH_VENVS (default benchmarks/.venvs).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH="${TORCH:-torch==2.13.0}"
VENVS="${BENCH_VENVS:-$ROOT/benchmarks/.venvs}"
PIP_QUIET=(--quiet --disable-pip-version-check)
unset PYTHONPATH  # the dev tree (.tree/src) must not stand in for an installed lightning

purelib() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

fresh() {  # fresh DIR STAMP: true (and DIR recreated, empty) unless DIR/.bench-deps holds STAMP
  local dir="$1" stamp="$2"
  if [ -f "$dir/.bench-deps" ] && [ "$(cat "$dir/.bench-deps")" = "$stamp" ]; then
    return 1
  fi
  echo "bench setup: creating $dir"
  rm -rf "$dir"
  "$PYTHON" -m venv "$dir"
}

req_hash="$(cksum < "$ROOT/requirements/bench.txt" | cut -d' ' -f1)"
base_stamp="v2 $TORCH $req_hash"
if fresh "$VENVS/torch" "$base_stamp"; then
  "$VENVS/torch/bin/python" -m pip install "${PIP_QUIET[@]}" "$TORCH" -r "$ROOT/requirements/bench.txt"
  echo "$base_stamp" > "$VENVS/torch/.bench-deps"
fi
base_lib="$(purelib "$VENVS/torch")"

for venv in stock fork; do
  # a change of the base (another torch) recreates both
  if fresh "$VENVS/$venv" "v2 $base_stamp"; then
    echo "$base_lib" > "$(purelib "$VENVS/$venv")/_bench_torch.pth"
    if [ "$venv" = stock ]; then
      "$VENVS/stock/bin/python" -m pip install "${PIP_QUIET[@]}" "lightning==2.6.6"
    fi
    echo "v2 $base_stamp" > "$VENVS/$venv/.bench-deps"
  fi
done

# the fork, from this checkout, every time (the build takes seconds)
if "$VENVS/fork/bin/python" -m pip show --quiet lightning >/dev/null 2>&1; then
  "$VENVS/fork/bin/python" -m pip install "${PIP_QUIET[@]}" --force-reinstall --no-deps "$ROOT" "$ROOT/packaging/pytorch-lightning"
else
  "$VENVS/fork/bin/python" -m pip install "${PIP_QUIET[@]}" "$ROOT" "$ROOT/packaging/pytorch-lightning"
fi

for venv in stock fork; do
  "$VENVS/$venv/bin/python" -m pip check >/dev/null
  "$VENVS/$venv/bin/python" - "$venv" "$base_lib" <<'PY'
import os
import sys

import lightning
import torch

venv, base_lib = sys.argv[1], sys.argv[2]
fork = "+" in lightning.__version__
if (venv == "fork") != fork:
    sys.exit(f"bench setup: the {venv} venv has lightning {lightning.__version__}, which is the wrong one")
if not os.path.realpath(torch.__file__).startswith(os.path.realpath(base_lib)):
    sys.exit(f"bench setup: the {venv} venv loads torch from {torch.__file__}, not from {base_lib}")
print(f"bench setup: {venv:5s} lightning {lightning.__version__}, torch {torch.__version__} (shared)")
PY
done
