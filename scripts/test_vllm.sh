#!/usr/bin/env bash
# Run tests/with_vllm (vLLM 0.16.0's real schedulers, in-process vs kvcoord) inside the vLLM
# venv made by scripts/install_vllm.sh, with kvcoord from this source tree.
#
# Without the venv the suite is skipped with a loud message, unless KVCOORD_REQUIRE_VLLM
# is set (CI sets it): then a missing venv is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(./scripts/install_vllm.sh --print-venv)"

if ! "$VENV/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("vllm") != "0.16.0")' 2>/dev/null; then
  if [ -n "${KVCOORD_REQUIRE_VLLM:-}" ]; then
    echo "ERROR: KVCOORD_REQUIRE_VLLM is set but $VENV has no vLLM 0.16.0: run scripts/install_vllm.sh" >&2
    exit 1
  fi
  cat >&2 <<MSG
########################################################################################
#  SKIPPED tests/with_vllm: no vLLM 0.16.0 venv at $VENV.
#  vLLM's real Scheduler / AsyncScheduler on kvcoord is NOT tested in this run.
#  Run scripts/install_vllm.sh (or make install) to test it; CI requires it.
########################################################################################
MSG
  exit 0
fi

# vLLM and torch emit DeprecationWarnings at import; the suite's other warnings stay errors.
PYTHONPATH=client:server:tests PYTHONHASHSEED="${PYTHONHASHSEED:-0}" \
  "$VENV/bin/python" -m pytest tests/with_vllm -p no:cacheprovider -W ignore::DeprecationWarning "$@"
