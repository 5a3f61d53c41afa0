#!/usr/bin/env bash
# A cached virtualenv with vLLM 0.16.0 (CPU torch, no GPU kernels) for tests/with_vllm.
#
# vLLM is installed with --no-deps; then only the modules its scheduler, configs and
# output types import (found by trial: import, install what is missing, repeat), with
# vLLM's own version constraints where it states them, plus kvcoord's runtime deps and
# pytest. kvcoord itself is not installed: the tests run it from the source tree
# (PYTHONPATH=client:server:tests).
#
#   KVCOORD_VLLM_VENV   venv path (default /var/cache/kvcoord/vllm-venv, or
#                       ~/.cache/kvcoord/vllm-venv when /var/cache is not writable)
#   PYTHON              interpreter that creates the venv (default python3)
#
#   scripts/install_vllm.sh              create or reuse the venv
#   scripts/install_vllm.sh --print-venv print the venv path and exit (scripts/test_vllm.sh)
#
# Idempotent: a venv whose stamp matches this script's package list is reused as is.
set -euo pipefail
if [ -n "${KVCOORD_VLLM_VENV:-}" ]; then
  VENV="$KVCOORD_VLLM_VENV"
elif [ -d /var/cache/kvcoord/vllm-venv ] || { mkdir -p /var/cache/kvcoord 2>/dev/null && [ -w /var/cache/kvcoord ]; }; then
  VENV=/var/cache/kvcoord/vllm-venv
else
  VENV="${XDG_CACHE_HOME:-$HOME/.cache}/kvcoord/vllm-venv"
fi
if [ "${1:-}" = "--print-venv" ]; then
  echo "$VENV"
  exit 0
fi
PYTHON="${PYTHON:-python3}"

TORCH="torch==2.13.0"
VLLM="vllm==0.16.0"
# What `import vllm.v1.core.sched.scheduler` / `async_scheduler`, `vllm.config`,
# `vllm.v1.outputs`, `vllm.v1.engine`, `vllm.v1.serial_utils` and `vllm.distributed.kv_events`
# need, and what ModelConfig needs to inspect a config.json-only model directory.
VLLM_MODULES=(
  numpy packaging "pydantic>=2.12.0" regex psutil cbor2 "huggingface_hub<1" "transformers>=4.56.0,<5"
  "gguf>=0.17.0" "aiohttp>=3.13.3" "pyzmq>=25.0.0" msgspec pillow pybase64 cachetools cloudpickle
  py-cpuinfo "prometheus_client>=0.18.0" "openai-harmony>=0.0.3" "openai>=1.99.1"
  "llguidance>=1.3.0,<1.4.0" "mistral_common>=1.9.0" "diskcache==5.6.3" einops
)
# Imported by vllm.v1.structured_output; --no-deps leaves out triton (1 GB, no GPU here):
# its other requirements are above.
NO_DEPS_MODULES=("xgrammar==0.1.29")
# kvcoord's runtime dependencies (pyproject.toml) and what its tests need.
KVCOORD_MODULES=(
  "grpcio>=1.85.1" "protobuf>=6.31.1" "grpcio-health-checking>=1.85.1" "grpcio-reflection>=1.85.1"
  "prometheus-client>=0.20" "structlog>=24.1" "click>=8.1" "cbor2>=5.6" "xxhash>=3.4" "pytest>=8.3" "pytest-timeout>=2.3"
)

stamp="$VENV/.kvcoord-stamp"
want="$(printf '%s\n' "$TORCH" "$VLLM" "${VLLM_MODULES[@]}" "${NO_DEPS_MODULES[@]}" "${KVCOORD_MODULES[@]}")"

if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
  && "$VENV/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("vllm") != "0.16.0")' 2>/dev/null; then
  echo "vLLM venv: reusing $VENV (vllm 0.16.0, torch $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))'))"
  exit 0
fi

pip_q() {
  # pip warns about every file:// index location and about vLLM's unmet pins (we leave
  # out torch 2.9.1, flashinfer, ray, ... on purpose): show only the rest.
  local log rc=0
  log="$(mktemp)"
  "$VENV/bin/python" -m pip install --quiet "$@" >"$log" 2>&1 || rc=$?
  grep -v -e "^WARNING: Location 'file://" -e "which is not installed" -e "but you have" \
    -e "dependency resolver does not currently" -e "^ERROR: pip's dependency resolver" "$log" >&2 || true
  rm -f "$log"
  return "$rc"
}

mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || { "$PYTHON" -m venv "$VENV"; echo "vLLM venv: created $VENV"; }
pip_q "$TORCH"
echo "vLLM venv: installed $TORCH"
pip_q --no-deps "$VLLM"
echo "vLLM venv: installed $VLLM (--no-deps)"
pip_q "${VLLM_MODULES[@]}"
pip_q --no-deps "${NO_DEPS_MODULES[@]}"
echo "vLLM venv: installed the $(( ${#VLLM_MODULES[@]} + ${#NO_DEPS_MODULES[@]} )) modules vLLM's scheduler imports"
pip_q "${KVCOORD_MODULES[@]}"
echo "vLLM venv: installed kvcoord's runtime deps and pytest"
"$VENV/bin/python" -c 'import vllm.v1.core.sched.async_scheduler, vllm.config, vllm.v1.serial_utils' >/dev/null 2>&1 \
  || { echo "vLLM venv: vllm does not import in $VENV" >&2; "$VENV/bin/python" -c 'import vllm.v1.core.sched.async_scheduler'; exit 1; }
printf '%s\n' "$want" >"$stamp"
echo "vLLM venv: ready at $VENV"
