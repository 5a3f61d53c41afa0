#!/usr/bin/env bash
# Install everything kvcoord's tests need: both distributions (editable), the server's with its test extras,
# the cached vLLM 0.16.0 and 0.33.0 venvs for tests/with_vllm (scripts/install_vllm.sh), and, as root on Debian, docker.io, debootstrap, prometheus and docker-compose for the
# container suite and the deploy-file checks, and etcd-server for tests/cluster (a
# replicated store holding replicas' membership and pool ownership).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

# Both distributions in one pip command: the server's (.) depends on kvcoord-client
# (./client), which pip then takes from here rather than from the package index.
"$PYTHON" -m pip install --quiet -e ./client -e '.[test,zmq,cluster]'
echo "installed kvcoord-client and kvcoord (editable) with test, zmq and cluster extras"

./scripts/install_vllm.sh
KVCOORD_VLLM_VERSION=0.33.0 ./scripts/install_vllm.sh

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
if [ ${#need[@]} -eq 0 ]; then
  echo "docker, debootstrap, prometheus, docker-compose and etcd are present"
elif [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing ${need[*]} with apt-get"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
else
  echo "NOTE: ${need[*]} missing and cannot be installed here (needs root and apt-get);" \
       "the container suite (make integration) or tests/cluster (etcd) will not run" >&2
fi
