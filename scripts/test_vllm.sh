#!/usr/bin/env bash
# Run tests/with_vllm (vLLM's real schedulers, in-process vs kvcoord) inside the vLLM venv
# made by scripts/install_vllm.sh, with kvcoord from this source tree.
#
#   KVCOORD_VLLM_VERSION  the vLLM release to test against: 0.16.0 (default) or 0.33.0
#                         (each has its own cached venv; CI runs both)
#
# Without the venv the suite is skipped with a loud message, unless KVCOORD_REQUIRE_VLLM
# is set (CI sets it): then a missing venv is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${KVCOORD_VLLM_VERSION:-0.16.0}"
export KVCOORD_VLLM_VERSION="$VERSION"
VENV="$(./scripts/install_vllm.sh --print-venv)"

if ! "$VENV/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("vllm") != sys.argv[1])' "$VERSION" 2>/dev/null; then
  if [ -n "${KVCOORD_REQUIRE_VLLM:-}" ]; then
    echo "ERROR: KVCOORD_REQUIRE_VLLM is set but $VENV has no vLLM $VERSION: run KVCOORD_VLLM_VERSION=$VERSION scripts/install_vllm.sh" >&2
    exit 1
  fi
  cat >&2 <<MSG
########################################################################################
#  SKIPPED tests/with_vllm: no vLLM $VERSION venv at $VENV.
#  vLLM $VERSION's real Scheduler / AsyncScheduler on kvcoord is NOT tested in this run.
#  Run KVCOORD_VLLM_VERSION=$VERSION scripts/install_vllm.sh (or make install) to test
#  it; CI requires it.
########################################################################################
MSG
  exit 0
fi

# vLLM inspects each model architecture a config names (MistralForCausalLM, the EAGLE
# and MTP draft heads, DeepSeek V3) in a subprocess that imports torch and the model's
# module, 7-15 s of CPU each, and caches the answer in $VLLM_CACHE_ROOT/modelinfos under
# the architecture's name, stamped with a hash of the module's source. Both releases
# share that name and not that source: sharing one directory, each run found the other
# release's entries stale and paid every inspection again in each worker (22 s of CPU per
# worker under 0.16.0, 45 s under 0.33.0). One directory per release, kept with its venv
# (in the home directory's cache where the venv is not writable):
VLLM_CACHE_ROOT="$VENV/vllm-cache"
[ -w "$VENV" ] || VLLM_CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/kvcoord/vllm-$VERSION"
export VLLM_CACHE_ROOT
# kvcoord's sources compiled once for this interpreter, as scripts/test.sh does (where
# PYTHONDONTWRITEBYTECODE is set, every process would compile them again)
"$VENV/bin/python" -m compileall -q client server tests || true
# vLLM and torch emit DeprecationWarnings at import; the suite's other warnings stay errors.
# (exec: scripts/test.sh, which runs this in the background, can end the run by this pid)
PYTHONPATH=client:server:tests PYTHONHASHSEED="${PYTHONHASHSEED:-0}" \
  exec "$VENV/bin/python" -m pytest tests/with_vllm -p no:cacheprovider -W ignore::DeprecationWarning "$@"
