# kvcoord server image.
#
#   docker build -t kvcoord .
#   docker run -p 50051:50051 -v kvcoord-data:/var/lib/kvcoord kvcoord   # embedded default config
#   docker run -v $PWD/kvcoord.toml:/etc/kvcoord/kvcoord.toml \
#              -e KVCOORD_CONFIG=/etc/kvcoord/kvcoord.toml -p 50051:50051 kvcoord
#
# Environment: KVCOORD_LISTEN, KVCOORD_METRICS_LISTEN, KVCOORD_LOG_LEVEL, KVCOORD_LOG_FORMAT
# (json here: one JSON object per line on stderr; text elsewhere), KVCOORD_CONFIG,
# KVCOORD_AUTH_TOKENS, KVCOORD_TLS_{CERT,KEY,CLIENT_CA}, KVCOORD_METRICS_TLS_{CERT,KEY,CLIENT_CA}
# (see the README). gRPC (50051) and /metrics (9400) both listen on every interface of
# the container, as exporters do, so `docker run -P` or a scraper on the container
# network reaches both; what reaches the container is decided where ports are published
# (-p 127.0.0.1:9400:9400 keeps /metrics on the host's loopback) or by
# KVCOORD_METRICS_LISTEN=127.0.0.1:9400 (the container's own loopback). With TLS on,
# override the health check so that it speaks TLS too (deploy/README.md, "TLS"). Where no registry is reachable,
# scripts/build_base_image.sh builds the base image locally under the same name.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
WORKDIR /src
RUN python3 -m venv /opt/kvcoord
COPY pyproject.toml README.md ./
COPY client ./client
COPY server ./server
# Two distributions: kvcoord-client (./client: engine, wire, messages, the `kvcoord`
# command) and the server (.), which depends on it; one pip command takes the client
# from here, with the `cluster` extra (etcd's asyncio client, aetcd) so that the same
# image runs a single node or a replica of a cluster (`[cluster] endpoints`,
# KVCOORD_CLUSTER_ENDPOINTS). Every dependency (grpcio, protobuf, prometheus-client,
# structlog, aetcd, ...) ships binary or pure-Python wheels: no compiler is needed, here
# or below. The checks run `serve` through the client's command, as the image's entry
# point does, and import the etcd client the cluster code uses.
RUN /opt/kvcoord/bin/pip install --no-cache-dir ./client '.[cluster]' \
 && /opt/kvcoord/bin/kvcoord serve --print-default-config > /dev/null \
 && /opt/kvcoord/bin/python -c 'import aetcd'

FROM ${BASE_IMAGE}
RUN echo 'kvcoord:x:10001:10001:kvcoord:/nonexistent:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'kvcoord:x:10001:' >> /etc/group \
 && mkdir -p /etc/kvcoord /var/lib/kvcoord \
 && chown 10001:10001 /var/lib/kvcoord
COPY --from=build /opt/kvcoord /opt/kvcoord
ENV PATH=/opt/kvcoord/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVCOORD_LISTEN=0.0.0.0:50051 \
    KVCOORD_METRICS_LISTEN=0.0.0.0:9400 \
    KVCOORD_DATA_DIR=/var/lib/kvcoord \
    KVCOORD_LOG_FORMAT=json
# The journal (and lease marker): mount a volume here so allocations survive the container.
# The path is absolute and overrides any config file's data_dir; a volume the kvcoord user
# (10001) cannot write makes `kvcoord serve` refuse to start (exit 3) rather than run
# without its journal.
VOLUME ["/var/lib/kvcoord"]
USER 10001:10001
EXPOSE 50051 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
  CMD ["kvcoord", "health", "--target", "127.0.0.1:50051"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvcoord"]
CMD ["serve"]
