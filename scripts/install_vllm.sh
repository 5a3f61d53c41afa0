#!/usr/bin/env bash
# A cached virtualenv with one vLLM version (CPU torch, no GPU kernels) for tests/with_vllm.
# One venv per version: 0.16.0 (kvcoord's `vllm-0.16` profile, the default) and 0.33.0
# (the `vllm-0.33` profile).
#
# vLLM is installed with --no-deps; then only the modules its scheduler, engine core,
# configs and output types import (found by trial: import, install what is missing,
# repeat), with vLLM's own version constraints where it states them, plus kvcoord's
# runtime deps and pytest. kvcoord itself is not installed: the tests run it from the
# source tree (PYTHONPATH=client:server:tests).
#
#   KVCOORD_VLLM_VERSION  0.16.0 (default) or 0.33.0
#   KVCOORD_VLLM_VENV     venv path (default /var/cache/kvcoord/vllm-venv for 0.16.0 and
#                         /var/cache/kvcoord/vllm033-venv for 0.33.0, or the same names
#                         under ~/.cache/kvcoord when /var/cache is not writable)
#   PYTHON                interpreter that creates the venv (default python3)
#
#   scripts/install_vllm.sh              create or reuse the venv
#   scripts/install_vllm.sh --print-venv print the venv path and exit (scripts/test_vllm.sh)
#
# Idempotent: a venv whose stamp matches this script's package list is reused as is.
set -euo pipefail
VERSION="${KVCOORD_VLLM_VERSION:-0.16.0}"
case "$VERSION" in
  0.16.0) NAME=vllm-venv ;;
  0.33.0) NAME=vllm033-venv ;;
  *) echo "KVCOORD_VLLM_VERSION=$VERSION: kvcoord supports vLLM 0.16.0 and 0.33.0" >&2; exit 2 ;;
esac
if [ -n "${KVCOORD_VLLM_VENV:-}" ]; then
  VENV="$KVCOORD_VLLM_VENV"
elif [ -d "/var/cache/kvcoord/$NAME" ] || { mkdir -p /var/cache/kvcoord 2>/dev/null && [ -w /var/cache/kvcoord ]; }; then
  VENV="/var/cache/kvcoord/$NAME"
else
  VENV="${XDG_CACHE_HOME:-$HOME/.cache}/kvcoord/$NAME"
fi
if [ "${1:-}" = "--print-venv" ]; then
  echo "$VENV"
  exit 0
fi
PYTHON="${PYTHON:-python3}"

TORCH="torch==2.13.0"
if [ "$VERSION" = 0.16.0 ]; then
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
else
  VLLM="vllm==0.33.0"
  # The same imports for 0.33.0 (it pins torch 2.14.0; its scheduler runs on the CPU
  # torch 2.13.0 the machine has on disk), plus vllm.v1.engine.core for EngineCore.
  VLLM_MODULES=(
    numpy packaging "pydantic>=2.12.0" regex psutil cbor2 "huggingface_hub>=1.31.0" "transformers>=5.16.1,<5.21.0"
    "tokenizers>=0.23.2" "aiohttp>=3.14.4" "pyzmq>=25.0.0" msgspec "pillow>=13.0.0" pybase64 cachetools
    cloudpickle py-cpuinfo blake3 "prometheus_client>=0.18.0" "openai>=2.25.0" "llguidance>=1.7.0,<1.8.0"
    "mistral_common>=1.11.6" einops "oss-harmony>=0.0.11" uvloop "fastapi>=0.133.0,<0.137.0"
    partial-json-parser "apache-tvm-ffi==0.1.11"
  )
  NO_DEPS_MODULES=("xgrammar==0.2.8")
fi
# kvcoord's runtime dependencies (pyproject.toml) and what its tests need.
KVCOORD_MODULES=(
  "grpcio>=1.85.1" "protobuf>=6.31.1" "grpcio-health-checking>=1.85.1" "grpcio-reflection>=1.85.1"
  "prometheus-client>=0.20" "structlog>=24.1" "click>=8.1" "cbor2>=5.6" "xxhash>=3.4" "pytest>=8.3" "pytest-timeout>=2.3"
  "pytest-xdist>=3.6"
)

stamp="$VENV/.kvcoord-stamp"
want="$(printf '%s\n' "$TORCH" "$VLLM" "${VLLM_MODULES[@]}" "${NO_DEPS_MODULES[@]}" "${KVCOORD_MODULES[@]}")"

if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
  && "$VENV/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("vllm") != sys.argv[1])' "$VERSION" 2>/dev/null; then
  echo "vLLM venv: reusing $VENV (vllm $VERSION, torch $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))'))"
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
IMPORTS='import vllm.v1.core.sched.async_scheduler, vllm.config, vllm.v1.serial_utils, vllm.distributed.kv_events'
[ "$VERSION" = 0.16.0 ] || IMPORTS="$IMPORTS, vllm.v1.engine.core"
"$VENV/bin/python" -c "$IMPORTS" >/dev/null 2>&1 \
  || { echo "vLLM venv: vllm does not import in $VENV" >&2; "$VENV/bin/python" -c "$IMPORTS"; exit 1; }
printf '%s\n' "$want" >"$stamp"
echo "vLLM venv: ready at $VENV"
