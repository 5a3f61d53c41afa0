#!/usr/bin/env bash
# Run the whole test suite: unit, conformance, property and service tests, vLLM's real
# schedulers on kvcoord (tests/with_vllm, in the vLLM 0.16.0 and 0.33.0 venvs: scripts/test_vllm.sh), then the
# integration suite against the kvcoord Docker image, scraped by a real Prometheus.
#
#   scripts/test.sh                     everything
#   scripts/test.sh --fast              everything except the container suite (make test-fast)
#   scripts/test.sh --integration-only  only the container suite
#
# The Python suites run in parallel with pytest-xdist. CI's machine has 2 cores; run
# serially, `pytest tests` took 1,240 s of wall time for about 870 s of CPU (children
# included; measured under -n 4): about 0.7 of one core, the rest waiting on leases,
# restarts, SIGKILLs and timeouts, so 4 workers overlap the waits and fill both cores; the
# tests/with_vllm runs are vLLM's scheduler in Python and kvcoord's over gRPC: 2 workers for
# 0.16.0, 3 for 0.33.0 (below), the two releases side by side. Every fixture binds
# ephemeral ports (free_port(), port 0) and per-test temporary
# directories (tmp_path; etcd per module), so no test needs a group. `--dist worksteal`: the
# slow tests (SIGKILL/restart loops of minutes) sit next to each other in collection
# order; an idle worker takes tests queued on a busy one instead of waiting (tests
# marked `long` would start first on every worker: tests/long_first.py; none outside
# tests/cluster is marked: in the one run with them first, two tests/service/test_cli.py
# tests failed, cause not known). tests/cluster
# runs after the rest, alone: its replicas hold ownership leases of a few seconds
# in a real etcd, and beside 4 busy workers a pool being rebuilt by another replica
# outlasted a client's 5 s retry budget (test_failover.py failed once in two parallel
# runs). It waits more than it computes: on 2 workers (CI at fd659a57: 395 s) a third of
# the 2 cores stood idle (/proc/stat), so it runs on 4 workers of its own (its SIGSTOPs
# wait until every thread has stopped: tests/stopping.py), `--dist loadfile`: a module's
# tests stay on one worker, in order, with the module's etcd (one per module and worker,
# on ports of its own; each test names its own cluster in it, so none depends on
# another); `--no-loadscope-reorder`: the files holding a test marked `long` are handed
# out first (xdist would sort the files by their number of tests, and its 115 s file
# with 2 tests started late). Measured back to back on this machine beside other jobs
# (load averages 5-12): 2 workers as before 497 s (277 s of CPU), 4 workers 262 s (300 s of
# CPU; 305 s with the files in name order); every test passed in every run.
#
# Where the time goes (CI at fd659a57, 2,214 s): `pytest tests` 618 s, tests/cluster 395 s
# (on 2 workers), the vLLM runs 1,193 s (0.16.0 done after 896 s), the container suite
# 224 s beside 0.33.0's last part. /proc/stat gave the 2 cores idle 4.8 % of the first,
# 35 % of the second and 0.2-1.1 % of the vLLM runs: outside tests/cluster the suite is
# CPU-bound, its wall time about its CPU time (3,900 s) over 2 cores. (At 84d54c9,
# 1,946-1,977 s: 498 s, 242 s, 1,026 s, 131 s.) Measured here (user + system time,
# children included, 2 workers): 0.16.0's run is 550 s of CPU, 0.33.0's 1,114 s (1,079 s in its tests, 7 s per worker
# in imports and collection; no fixed cost per test worth sharing: a vLLM config takes
# 4 ms, a server process's start 0.35 s). In CI's 1,026 s the 2 cores gave 2,052 s for
# these 1,664 s: 388 s of cores stood idle while workers waited (servers SIGKILLed and
# restarted, sessions lost, leases, Steps' answers), most likely in 0.33.0's last 494 s,
# when only its 2 workers ran. So 0.33.0 runs on 3 workers (5 processes beside 0.16.0's
# 2 at first; every test passed that way here at load averages of 20-78, for 1,238 s of CPU against
# 1,114 s on 2 workers at 15-23), and the container suite (Docker, a server in
# a container, waits on restarts and Prometheus scrapes, bounds of 60-120 s; mostly
# waiting, it was the only phase on the machine while it ran) runs beside 0.33.0's last
# part, once 0.16.0's run has ended. tests/cluster does not (its 5 s retry budget:
# test_failover.py failed again beside a loaded machine). KVCOORD_VLLM_SERIAL=1 runs
# every phase one after the other.
#   KVCOORD_TEST_WORKERS          workers of `pytest tests` (default 4; 0 runs it serially)
#   KVCOORD_CLUSTER_TEST_WORKERS  workers of tests/cluster (default 4; 0 runs it serially)
#   KVCOORD_VLLM_TEST_WORKERS     workers of the tests/with_vllm run under vLLM 0.16.0 (default 2;
#                                 0: serially), and under 0.33.0 where the next is not set
#   KVCOORD_VLLM033_TEST_WORKERS  workers of the tests/with_vllm run under vLLM 0.33.0 (default 3)
# The vLLM 0.16.0 and 0.33.0 runs of tests/with_vllm go on side by side, each writing to
# a log that is printed when it has ended and what runs beside it has (0.16.0's before
# the container suite, 0.33.0's at the end; KVCOORD_VLLM_SERIAL=1: one after the other, straight
# to the terminal). The container suite's images (and dockerd, if none runs)
# are built in the background from the start, while the Python suites run (their output
# in $WORK/images.log, printed before the container suite, which waits for them).
#
# KVCOORD_WORK: the scratch directory (logs, certificates; default a new /tmp/kvcoord-ci.*);
# KVCOORD_IMAGE: the tag the image is built as (default kvcoord:test).
#
# KVCOORD_TARGET=host:port and KVCOORD_METRICS=host:port run the integration suite
# against an existing deployment instead of starting the container (add
# KVCOORD_CLIENT_TLS_CA/_CERT/_KEY and KVCOORD_METRICS_SCHEME=https for a TLS one).
#
# The container runs with mutual TLS on gRPC and on /metrics: certificates are generated
# into $WORK/tls by tests/certs.py, mounted read-only, named by KVCOORD_TLS_* and
# KVCOORD_METRICS_TLS_*; the health check, the suite's clients and Prometheus present the
# generated client certificate. Its data directory is a named volume and its host ports
# are fixed, so the suite can `docker kill` and `docker start` it (KVCOORD_CONTAINER) and
# find the journal and the addresses unchanged.
#
# The cluster stack (deploy/docker-compose.cluster.yml: three replicas of the same image,
# etcd and Prometheus, the latter two built from Debian's packages on the same base
# image, deploy/etcd/Dockerfile and deploy/prometheus/image/Dockerfile) runs beside it in
# plaintext, as compose project kvcoord-cluster-<pid> on the subnet KVCOORD_NET.0/24
# (default 172.29.23); tests/integration/test_cluster.py stops, kills and starts its
# replicas (the stack runs the store journal: a killed replica's pools fail over).
# KVCOORD_CLUSTER_TARGETS (and _CONTAINERS, _PROMETHEUS) given: an existing stack instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WORK="${KVCOORD_WORK:-$(mktemp -d /tmp/kvcoord-ci.XXXXXX)}"
IMAGE="${KVCOORD_IMAGE:-kvcoord:test}"
CONTAINER="kvcoord-test-$$"
VOLUME_NAME="kvcoord-test-data-$$"
CLUSTER_COMPOSE=(docker-compose -p "kvcoord-cluster-$$" -f deploy/docker-compose.cluster.yml)
status=0

# The suites start Python processes by the thousand (servers SIGKILLed and restarted,
# worker processes, pytest-xdist workers), each importing the same sources. Where
# PYTHONDONTWRITEBYTECODE is set, none of them writes a .pyc and every one compiled
# kvcoord again: 0.2-0.45 s of each server start, a third to a half of the SIGKILL
# tests' time. Compiled once here (ignored by git; where .pyc files are written anyway,
# this only does first what the first import would).
"$PYTHON" -m compileall -q client server tests || true  # (a file that does not compile: pytest says which)

# Steps 1-2 of the container suite (a Docker engine, the images), started in the
# background before the Python suites: they wait on the network, apt and pip more than
# they compute (74-105 s on a loaded machine with the kvcoord image's pip layer rebuilt),
# and built after the suites they were on the critical path. They do not see what the
# suites write (.dockerignore leaves out tests/, __pycache__ and *.pyc).
build_images() {
  if [ -z "${KVCOORD_TARGET:-}" ]; then
    # 1. a Docker engine
    if ! docker info >/dev/null 2>&1; then
      if ! command -v dockerd >/dev/null 2>&1; then
        echo "docker is not installed: run 'make install' as root" >&2
        exit 1
      fi
      # A dockerd that was killed leaves its containerd's pid file behind; once that pid
      # is reused by another process, a new dockerd takes it for a running containerd,
      # waits for its socket and gives up ("timeout waiting for containerd to start").
      # With no daemon answering, a pid file whose process is not a containerd is stale.
      pidfile=/var/run/docker/containerd/containerd.pid
      if [ -f "$pidfile" ] && ! grep -qa containerd "/proc/$(cat "$pidfile")/cmdline" 2>/dev/null; then
        echo "removing the stale $pidfile (pid $(cat "$pidfile") is not a containerd)"
        rm -f "$pidfile"
      fi
      echo "starting dockerd"
      (dockerd >"$WORK/dockerd.log" 2>&1 &)
      for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
      docker info >/dev/null 2>&1 || { tail -n 30 "$WORK/dockerd.log" >&2; exit 1; }
    fi
    # 2. the base image (pulled where a registry is reachable, else built locally) and ours
    base="$(sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)"
    if ! docker image inspect "$base" >/dev/null 2>&1; then
      docker pull "$base" >/dev/null 2>&1 || ./scripts/build_base_image.sh "$base"
    fi
    echo "building $IMAGE"
    docker build -q -t "$IMAGE" . >/dev/null
  fi
  # the cluster stack's etcd and Prometheus images, from Debian's packages (no registry
  # needed) on the same base image (see 4b below)
  if [ -z "${KVCOORD_CLUSTER_TARGETS:-}" ] && { [ -z "${KVCOORD_TARGET:-}" ] || [ -n "${KVCOORD_IMAGE:-}" ]; }; then
    base="$(sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)"
    docker build -q --build-arg BASE_IMAGE="$base" -t kvcoord-etcd:test deploy/etcd >/dev/null
    docker build -q --build-arg BASE_IMAGE="$base" -t kvcoord-prometheus:test deploy/prometheus/image >/dev/null
  fi
}

# the vLLM 0.33.0 run started in the background (see below): waited for, its log printed
wait_vllm033() {
  if [ -n "${pid033:-}" ]; then
    local rc033=0
    wait "$pid033" || rc033=$?
    pid033=
    echo "######## tests/with_vllm under vLLM 0.33.0 (exit $rc033)"
    cat "$WORK/vllm-0.33.0.log"
    [ "$rc033" -eq 0 ] || status=$rc033
  fi
}

cleanup() {
  # (a vLLM run still going when this script ends early: scripts/test_vllm.sh execs its pytest)
  if [ -n "${pid016:-}" ]; then kill "$pid016" 2>/dev/null || true; fi
  if [ -n "${pid033:-}" ]; then
    echo "the vLLM 0.33.0 run was ended with this script (its log so far: $WORK/vllm-0.33.0.log)" >&2
    kill "$pid033" 2>/dev/null || true
  fi
  if [ -n "${IMAGES_PID:-}" ]; then kill "$IMAGES_PID" 2>/dev/null || true; fi
  if [ -n "${PROM_PID:-}" ]; then kill "$PROM_PID" 2>/dev/null || true; fi
  docker rm -f "$CONTAINER" >/dev/null 2>&1 || true
  docker volume rm "$VOLUME_NAME" >/dev/null 2>&1 || true
  if [ -n "${CLUSTER_UP:-}" ]; then "${CLUSTER_COMPOSE[@]}" down -v >/dev/null 2>&1 || true; fi
}

if [ "${1:-}" != "--fast" ]; then
  mkdir -p "$WORK"
  trap cleanup EXIT
  build_images >"$WORK/images.log" 2>&1 &
  IMAGES_PID=$!
fi

if [ "${1:-}" != "--integration-only" ]; then
  # -p no:benchmark: pytest-benchmark, where installed, warns that xdist disables it, and
  # the suite's filterwarnings = error makes that an internal error (no test here uses it)
  # --durations: each run ends with its slowest tests, to see where CI's time goes
  "$PYTHON" -m pytest tests --ignore=tests/integration --ignore=tests/cluster -p no:benchmark \
    -n "${KVCOORD_TEST_WORKERS:-4}" --dist worksteal --durations=15 || status=$?
  # the replica-cluster tests after the rest, alone, on workers of their own (their
  # ownership leases are seconds long: see above)
  "$PYTHON" -m pytest tests/cluster -p no:benchmark \
    -n "${KVCOORD_CLUSTER_TEST_WORKERS:-4}" --dist loadfile --no-loadscope-reorder --durations=10 || status=$?
  vllm_workers=(-n "${KVCOORD_VLLM_TEST_WORKERS:-2}" --dist worksteal --durations=15)
  # (0.33.0's run is the longer one and waits as long as it computes: 3 workers, see above)
  vllm033_workers=(-n "${KVCOORD_VLLM033_TEST_WORKERS:-${KVCOORD_VLLM_TEST_WORKERS:-3}}" --dist worksteal
    --durations=15)
  if [ -n "${KVCOORD_VLLM_SERIAL:-}" ]; then
    ./scripts/test_vllm.sh "${vllm_workers[@]}" || status=$?
    KVCOORD_VLLM_VERSION=0.33.0 ./scripts/test_vllm.sh "${vllm033_workers[@]}" || status=$?
  else
    mkdir -p "$WORK"
    ./scripts/test_vllm.sh "${vllm_workers[@]}" >"$WORK/vllm-0.16.0.log" 2>&1 &
    pid016=$!
    KVCOORD_VLLM_VERSION=0.33.0 ./scripts/test_vllm.sh "${vllm033_workers[@]}" >"$WORK/vllm-0.33.0.log" 2>&1 &
    pid033=$!
    rc016=0
    wait "$pid016" || rc016=$?
    pid016=
    echo "######## tests/with_vllm under vLLM 0.16.0 (exit $rc016)"
    cat "$WORK/vllm-0.16.0.log"
    [ "$rc016" -eq 0 ] || status=$rc016
    # 0.33.0's run goes on (the longer one: see above); the container suite below runs
    # beside its last part, and its log is printed once the container suite has ended
  fi
  if [ "${1:-}" = "--fast" ]; then
    wait_vllm033
    exit $status
  fi
fi

# 1-2. (a Docker engine, the images: build_images above, started before the Python suites)
images_rc=0
wait "$IMAGES_PID" || images_rc=$?
IMAGES_PID=
cat "$WORK/images.log"
[ "$images_rc" -eq 0 ] || { echo "building the container suite's images failed (exit $images_rc)" >&2; wait_vllm033; exit 1; }

if [ -z "${KVCOORD_TARGET:-}" ]; then
  # 3. test certificates (a CA, server and client certificates; test-only keys)
  TLS_DIR="$WORK/tls"
  "$PYTHON" tests/certs.py "$TLS_DIR" >/dev/null
  C=/etc/kvcoord/tls
  # 4. the container, with mutual TLS, on host ports of the loopback interface chosen
  # here (fixed, so that `docker kill` + `docker start` keeps them: Docker may publish a
  # container's ephemeral ports on new host ports when it starts again); its /metrics
  # listens on the container network (published on the host's loopback only); its data
  # directory (the journal) is a named volume, kept across restarts of the container
  read -r grpc_port metrics_port < <("$PYTHON" -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
  docker volume create "$VOLUME_NAME" >/dev/null
  docker run -d --name "$CONTAINER" -p "127.0.0.1:$grpc_port:50051" -p "127.0.0.1:$metrics_port:9400" \
    -v "$TLS_DIR:$C:ro" -v "$VOLUME_NAME:/var/lib/kvcoord" \
    -e KVCOORD_METRICS_LISTEN=0.0.0.0:9400 \
    -e KVCOORD_TLS_CERT="$C/server.pem" -e KVCOORD_TLS_KEY="$C/server.key" -e KVCOORD_TLS_CLIENT_CA="$C/ca.pem" \
    -e KVCOORD_METRICS_TLS_CERT="$C/server.pem" -e KVCOORD_METRICS_TLS_KEY="$C/server.key" \
    -e KVCOORD_METRICS_TLS_CLIENT_CA="$C/ca.pem" \
    --health-cmd "kvcoord health --target 127.0.0.1:50051 --tls-ca $C/ca.pem --tls-cert $C/client.pem --tls-key $C/client.key" \
    "$IMAGE" >/dev/null
  export KVCOORD_CLIENT_TLS_CA="$TLS_DIR/ca.pem" KVCOORD_CLIENT_TLS_CERT="$TLS_DIR/client.pem" \
    KVCOORD_CLIENT_TLS_KEY="$TLS_DIR/client.key" KVCOORD_METRICS_SCHEME=https
  export KVCOORD_TARGET="127.0.0.1:$grpc_port" KVCOORD_METRICS="127.0.0.1:$metrics_port"
  export KVCOORD_CONTAINER="$CONTAINER" KVCOORD_IMAGE="$IMAGE"
  for _ in $(seq 1 60); do
    [ "$(docker inspect -f '{{.State.Health.Status}}' "$CONTAINER")" = healthy ] && break
    sleep 1
  done
  echo "container $CONTAINER: $(docker inspect -f '{{.State.Health.Status}}' "$CONTAINER"), gRPC $KVCOORD_TARGET (mutual TLS), metrics https://$KVCOORD_METRICS"
fi

# 4b. the cluster stack: etcd and Prometheus images from Debian's packages (built by
# build_images), the replicas from the image above; `up` waits for etcd to be healthy
if [ -z "${KVCOORD_CLUSTER_TARGETS:-}" ] && [ -n "${KVCOORD_IMAGE:-}" ]; then
  net="${KVCOORD_NET:-172.29.23}"
  cluster_prom_port="$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  export KVCOORD_IMAGE KVCOORD_NET="$net" KVCOORD_ETCD_IMAGE=kvcoord-etcd:test \
    KVCOORD_PROMETHEUS_IMAGE=kvcoord-prometheus:test KVCOORD_PROMETHEUS_PORT="$cluster_prom_port"
  CLUSTER_UP=1
  echo "starting the cluster stack (3 replicas, etcd, Prometheus) on $net.0/24"
  "${CLUSTER_COMPOSE[@]}" up -d --no-build etcd kvcoord-0 kvcoord-1 kvcoord-2 prometheus >"$WORK/cluster-up.log" 2>&1 \
    || { cat "$WORK/cluster-up.log" >&2; wait_vllm033; exit 1; }
  containers=""
  for i in 0 1 2; do
    containers="$containers${containers:+,}kvcoord-$i=$("${CLUSTER_COMPOSE[@]}" ps -q "kvcoord-$i")"
  done
  export KVCOORD_CLUSTER_TARGETS="$net.10:50051,$net.11:50051,$net.12:50051" \
    KVCOORD_CLUSTER_CONTAINERS="$containers" KVCOORD_CLUSTER_PROMETHEUS="127.0.0.1:$cluster_prom_port"
fi

# 5. a real Prometheus scraping the metrics port (over HTTPS with a client certificate
# when the suite is configured for TLS)
if [ -z "${KVCOORD_PROMETHEUS:-}" ] && command -v prometheus >/dev/null 2>&1; then
  prom_port="$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  scheme="${KVCOORD_METRICS_SCHEME:-http}"
  tls_config=""
  if [ "$scheme" = https ]; then
    tls_config="    tls_config: {ca_file: \"${KVCOORD_CLIENT_TLS_CA:-}\""
    if [ -n "${KVCOORD_CLIENT_TLS_CERT:-}" ]; then
      tls_config="$tls_config, cert_file: \"$KVCOORD_CLIENT_TLS_CERT\", key_file: \"$KVCOORD_CLIENT_TLS_KEY\""
    fi
    tls_config="$tls_config}"
  fi
  cat >"$WORK/prometheus.yml" <<YAML
global: {scrape_interval: 1s, evaluation_interval: 1s}
rule_files: ["$PWD/deploy/prometheus/alerts.yml"]
scrape_configs:
  - job_name: kvcoord
    scheme: $scheme
$tls_config
    static_configs: [{targets: ["$KVCOORD_METRICS"]}]
YAML
  prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/prom-data" \
    --web.listen-address="127.0.0.1:$prom_port" >"$WORK/prometheus.log" 2>&1 &
  PROM_PID=$!
  export KVCOORD_PROMETHEUS="127.0.0.1:$prom_port"
fi

"$PYTHON" -m pytest tests/integration || status=$?
wait_vllm033
exit $status
