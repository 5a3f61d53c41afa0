"""deploy/ files checked with real tools, and against the metrics the server exports."""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml
from kvcoord.service.config import load_config, parse_config
from kvcoord.service.idempotency import IdempotencyStore
from kvcoord.service.metrics import Metrics
from kvcoord.service.registry import Limits, PoolRegistry
from kvcoord.service.servicer import AllocatorServicer
from kvcoord.service.sessions import SessionTable

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
#: etcd's flags for the store journal, whose every record is a revision (deploy/README.md)
ETCD_COMPACTION = {"--auto-compaction-mode": "periodic", "--auto-compaction-retention": "5m"}


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, (
        f"{name} is not installed: run `make install` (it installs Debian's prometheus / docker-compose)"
    )
    return path


def exported_metric_names() -> set[str]:
    """Names a server with one pool exports, read from a real prometheus-client registry."""
    from kvcoord.v1 import allocator_pb2 as pb

    m = Metrics()
    registry = PoolRegistry(
        Limits(), SessionTable(lambda: 0.0, 30, 60), IdempotencyStore(lambda: 0.0, 300, 1 << 20)
    )
    servicer = AllocatorServicer(registry, m)
    cfg = parse_config(
        '[[pools]]\nname = "p"\nnum_blocks = 8\nhash_block_size = 4\n[[pools.groups]]\ntype = "full"\nblock_size = 4\n'
    ).pools[0]
    service, _ = registry.create(cfg.name, cfg.config)
    m.pool_created(service)  # as the server tells it: the pool's labelled counters start at 0
    m.bind(servicer)
    m.started.labels("s", "m", "unary").inc()
    m.handled.labels("s", "m", "unary", "OK").inc()
    m.latency.labels("s", "m", "unary").observe(0.001)
    assert isinstance(pb.PoolConfig(), pb.PoolConfig)
    return {s.name for fam in m.registry.collect() for s in fam.samples}


def test_promtool_accepts_config_and_rules() -> None:
    """`promtool check config` (with the rules it names) and `check rules` succeed."""
    promtool = _tool("promtool")
    for args in (["check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                 ["check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")]):  # fmt: skip
        proc = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "SUCCESS" in proc.stdout


def test_compose_file_is_valid() -> None:
    """`docker-compose config` accepts the stack; it runs kvcoord, Prometheus and Grafana."""
    compose = _tool("docker-compose")
    proc = subprocess.run([compose, "-f", str(DEPLOY / "docker-compose.yml"), "config"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    assert set(services) == {"kvcoord", "prometheus", "grafana"}
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """target -> source of a compose service's volumes (short or long syntax)."""
    out = {}
    for v in service.get("volumes", []):
        source, target = (v["source"], v["target"]) if isinstance(v, dict) else v.split(":")[:2]
        out[target] = source
    return out


def test_cluster_compose_file_runs_three_replicas_on_etcd() -> None:
    """`docker-compose config` accepts the cluster stack: etcd, three kvcoord replicas of
    one image and Prometheus (scraping each, `promtool check config` accepts it). Each
    replica's environment, loaded as `kvcoord serve` loads it, joins the cluster at etcd
    under its own id, keeps its pools' journal in etcd (a killed replica's pools fail
    over) and advertises its fixed address on the stack's network; etcd compacts the
    revisions that journal makes."""
    compose = _tool("docker-compose")
    path = DEPLOY / "docker-compose.cluster.yml"
    proc = subprocess.run([compose, "-f", str(path), "config"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    stack = yaml.safe_load(proc.stdout)
    services = stack["services"]
    replicas = sorted(s for s in services if s.startswith("kvcoord-"))
    assert replicas == ["kvcoord-0", "kvcoord-1", "kvcoord-2"]
    assert set(services) == {"etcd", "prometheus", "grafana", *replicas}
    etcd = services["etcd"]
    assert etcd["build"]["context"] == str(DEPLOY / "etcd")
    assert "HEALTHCHECK" in (DEPLOY / "etcd" / "Dockerfile").read_text()
    assert "--advertise-client-urls=http://etcd:2379" in etcd["command"]
    assert ETCD_COMPACTION.items() <= dict(a.split("=", 1) for a in etcd["command"]).items()
    (subnet,) = (c["subnet"] for c in stack["networks"]["kvcoord"]["ipam"]["config"])
    network = ipaddress.ip_network(subnet)
    advertised = set()
    for name in replicas:
        svc = services[name]
        assert svc["image"] == services["kvcoord-0"]["image"] and svc["build"]["context"] == str(ROOT)
        assert svc["depends_on"]["etcd"] == {"condition": "service_healthy"}
        cfg = load_config(env={**dockerfile_env(), **svc["environment"]})
        assert cfg.cluster.enabled and cfg.cluster.endpoints == ("etcd:2379",)
        assert cfg.cluster.replica_id == name
        assert cfg.cluster.journal == "store" and cfg.server.journaled
        host, port = cfg.cluster.advertise_address.rsplit(":", 1)
        assert host == svc["networks"]["kvcoord"]["ipv4_address"] and ipaddress.ip_address(host) in network
        assert port == "50051" and cfg.server.listen == ("0.0.0.0:50051",)
        assert cfg.server.metrics_listen == "0.0.0.0:9400"
        assert cfg.server.data_dir in _mounts(svc)
        advertised.add(cfg.cluster.advertise_address)
    assert len(advertised) == 3
    # a stop hands the pools over after grace_seconds: compose must wait longer before SIGKILL
    grace = load_config(env=dockerfile_env()).server.grace_seconds
    assert all(int(services[n]["stop_grace_period"].rstrip("s")) > grace + 10 for n in replicas)
    prom = services["prometheus"]
    config = Path(_mounts(prom)["/etc/prometheus/prometheus.yml"])
    assert config == DEPLOY / "prometheus" / "prometheus-cluster.yml"
    scraped = yaml.safe_load(config.read_text())["scrape_configs"][0]["static_configs"][0]["targets"]
    assert scraped == [f"{n}:9400" for n in replicas]
    check = subprocess.run([_tool("promtool"), "check", "config", str(config)], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr


def _names_in(expr: str) -> set[str]:
    """Exported metric names an expression reads (not the recording rules' level:name:op)."""
    names = set(re.findall(r"(?<![\w:])(kvcoord_[a-z_]+|grpc_server_[a-z_]+|process_[a-z_]+)(?![\w:])", expr))
    return names


def _recorded_in(expr: str) -> set[str]:
    return set(re.findall(r"\b([a-z_]+:[a-z_]+:[a-z0-9_]+)\b", expr))


def test_promtool_unit_tests_of_the_alert_rules() -> None:
    """`promtool test rules deploy/prometheus/alerts_test.yml`: every alert fires when
    its condition has held for its `for` (not before, and not for the series beside it
    that stay under the threshold), with its labels and annotations; the recording
    rules compute what the dashboard reads."""
    promtool = _tool("promtool")
    tests = DEPLOY / "prometheus" / "alerts_test.yml"
    proc = subprocess.run(
        [promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    unit = tests.read_text()
    untested = {a for a in alerts if f"alertname: {a}" not in unit}
    assert not untested, f"alerts without a promtool unit test: {sorted(untested)}"


def test_dashboard_and_alerts_name_only_exported_metrics() -> None:
    """Every metric a Grafana query or an alert names is one the server exports."""
    exported = exported_metric_names()
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "kvcoord.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [dash["templating"]["list"][0]["definition"]]
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    used = set().union(*(_names_in(e) for e in exprs))
    assert used, "no metric names found"
    missing = used - exported
    assert not missing, f"not exported: {sorted(missing)}"
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    read = set().union(*(_recorded_in(e) for e in exprs))
    assert read - recorded == set(), f"recording rules read but not defined: {sorted(read - recorded)}"
    titles = {p["title"] for p in dash["panels"]}
    assert {"KV cache usage", "Prefix cache hit rate", "RPC rate by method", "RPC latency p50 / p99",
            "Allocation refusals", "KV events published"} <= titles  # fmt: skip


KUBERNETES_VERSION = "1.30.0"  # a Kubernetes release the manifests must fit (its schemas)


def kubernetes_docs() -> dict[tuple[str, str], dict[str, Any]]:
    """deploy/kubernetes/kvcoord.yaml's objects by (kind, name)."""
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "kvcoord.yaml").read_text()))
    by_key = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(by_key) == len(docs), "two objects of one kind share a name"
    return by_key


def _pod_env(container: dict[str, Any], pod: str, namespace: str) -> dict[str, str]:
    """The container's environment as the kubelet gives it to the pod ``pod``: the
    downward API's fields and `$(VAR)` references to variables defined before."""
    fields = {"metadata.name": pod, "metadata.namespace": namespace, "status.podIP": "10.0.0.7"}
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "valueFrom" in e:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
    return env


def test_kubernetes_manifests_fit_the_kubernetes_schemas() -> None:
    """Every object of deploy/kubernetes validates (strictly: no unknown field) against
    the OpenAPI schemas of a real Kubernetes release (kubernetes-validate)."""
    import kubernetes_validate

    docs = kubernetes_docs()
    assert {kind for kind, _ in docs} == {"ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget"}
    for (kind, name), doc in docs.items():
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{kind}/{name}: {exc.message} at {list(exc.path)}") from None


def test_kubernetes_kvcoord_replicas_form_a_cluster_on_etcd() -> None:
    """The kvcoord StatefulSet runs N replicas (a volume each) behind a headless Service,
    each loading the ConfigMap's one file with [cluster] pointed at every member of the
    3-member etcd StatefulSet; the pod's environment makes its replica_id the pod's name
    and its advertise_address the name the headless Service gives the pod. The replicas
    keep their pools' journal in etcd (failover) and every etcd member compacts."""
    docs = kubernetes_docs()
    sts, svc = docs["StatefulSet", "kvcoord"], docs["Service", "kvcoord"]
    etcd, etcd_svc = docs["StatefulSet", "etcd"], docs["Service", "etcd"]
    assert sts["spec"]["replicas"] >= 2 and etcd["spec"]["replicas"] == 3
    for s, service in ((sts, svc), (etcd, etcd_svc)):
        assert s["spec"]["serviceName"] == service["metadata"]["name"]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"].items() <= s["spec"]["template"]["metadata"]["labels"].items()
        assert [t["metadata"]["name"] for t in s["spec"]["volumeClaimTemplates"]] == ["data"]
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert {p["containerPort"] for p in container["ports"]} == {50051, 9400}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["grpc"]["port"] == 50051
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (config_file,) = docs["ConfigMap", "kvcoord-config"]["data"]
    args = container["args"]
    assert args[:2] == ["serve", "--config"] and args[2] == f"{mounts['config']}/{config_file}"
    cfg_text = docs["ConfigMap", "kvcoord-config"]["data"][config_file]

    # etcd's members, as they name themselves and each other
    etcd_container = etcd["spec"]["template"]["spec"]["containers"][0]
    flags = dict(a.split("=", 1) for a in etcd_container["command"][1:])
    members = [f"etcd-{i}" for i in range(etcd["spec"]["replicas"])]
    peer = next(p["containerPort"] for p in etcd_container["ports"] if p["name"] == "peer")
    client = next(p["containerPort"] for p in etcd_container["ports"] if p["name"] == "client")
    assert flags["--initial-cluster"] == ",".join(f"{m}=http://{m}.etcd:{peer}" for m in members)
    assert flags["--data-dir"] in {m["mountPath"] for m in etcd_container["volumeMounts"]}
    assert ETCD_COMPACTION.items() <= flags.items()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / config_file
        path.write_text(cfg_text)
        for i in range(sts["spec"]["replicas"]):
            name = f"kvcoord-{i}"
            cfg = load_config(path, env=_pod_env(container, name, "infer"))
            assert cfg.cluster.enabled
            assert cfg.cluster.endpoints == tuple(
                f"{m}.{etcd_svc['metadata']['name']}:{client}" for m in members
            )
            assert cfg.cluster.replica_id == name
            assert cfg.cluster.journal == "store" and cfg.server.journaled
            assert cfg.cluster.advertise_address == f"{name}.{svc['metadata']['name']}.infer.svc:50051"
            assert cfg.server.data_dir == mounts["data"]
            assert cfg.server.metrics_listen == "10.0.0.7:9400"
    # a SIGTERM hands the pools over after in-flight calls finish: the pod must get the time
    assert pod["terminationGracePeriodSeconds"] >= cfg.server.grace_seconds + 10 * len(cfg.pools)
    scrape = yaml.safe_load((DEPLOY / "kubernetes" / "prometheus-scrape.yml").read_text())["scrape_configs"][
        0
    ]
    assert scrape["kubernetes_sd_configs"] == [{"role": "pod"}]
    assert any(r.get("regex") == "kvcoord" and r["action"] == "keep" for r in scrape["relabel_configs"])
    assert sts["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "kvcoord"
    assert sts["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9400"


def test_kubernetes_disruption_budgets() -> None:
    """A drain takes one kvcoord replica at a time (it hands its pools over) and never
    etcd's quorum."""
    docs = kubernetes_docs()
    for name, limit in (("kvcoord", {"maxUnavailable": 1}), ("etcd", {"minAvailable": 2})):
        pdb = docs["PodDisruptionBudget", name]
        labels = docs["StatefulSet", name]["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert {k: v for k, v in pdb["spec"].items() if k != "selector"} == limit
    assert docs["StatefulSet", "etcd"]["spec"]["replicas"] // 2 + 1 == 2  # quorum of 3


def test_metrics_doc_lists_every_exported_metric() -> None:
    """docs/metrics.md documents each exported kvcoord/gRPC metric."""
    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_]+)`", doc, flags=re.M))
    exported = {re.sub(r"_(total|created|bucket|sum|count)$", "", n) for n in exported_metric_names()}
    exported = {n for n in exported if n.startswith(("kvcoord_", "grpc_server_"))}
    documented_bases = {re.sub(r"_total$", "", n) for n in documented}
    assert exported <= documented_bases, sorted(exported - documented_bases)


def dockerfile_env() -> dict[str, str]:
    """The environment the image's ENV instructions set (what `kvcoord serve` reads in it)."""
    text = (ROOT / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    env: dict[str, str] = {}
    for instruction in "\n".join(lines).replace("\\\n", " ").splitlines():
        if instruction.startswith("ENV "):
            env.update(item.split("=", 1) for item in shlex.split(instruction[4:]))  # type: ignore[misc]
    return env


def test_the_image_serves_grpc_and_metrics_on_every_interface() -> None:
    """Issue 26: the image exposed 9400 but served /metrics on the container's loopback
    (`docker run -P` gave Prometheus nothing to scrape). The configuration `kvcoord
    serve` loads from the image's environment listens for gRPC on 0.0.0.0:50051 and for
    /metrics on 0.0.0.0:9400, the two ports the image exposes; outside the image the
    embedded default keeps both on loopback. README and deploy/README say so together."""
    env = dockerfile_env()
    served = load_config(env=env).server
    assert served.listen == ("0.0.0.0:50051",)
    assert served.metrics_listen == "0.0.0.0:9400"
    exposed = re.findall(r"^EXPOSE (.+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert exposed == ["50051 9400"]
    default = load_config(env={}).server
    assert default.listen == ("127.0.0.1:50051",) and default.metrics_listen == "127.0.0.1:9400"
    for doc in (ROOT / "README.md", DEPLOY / "README.md"):
        text = " ".join(doc.read_text().split())
        assert "| gRPC | `127.0.0.1:50051` | `0.0.0.0:50051` |" in text, doc
        assert "| `/metrics` | `127.0.0.1:9400` | `0.0.0.0:9400` |" in text, doc


def test_metrics_listen_explicitly_in_compose_and_kubernetes() -> None:
    """Compose opens /metrics on its own network and publishes it on the host's loopback
    only; Kubernetes binds the pod's own IP, not every interface."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["kvcoord"]
    assert compose["environment"]["KVCOORD_METRICS_LISTEN"] == "0.0.0.0:9400"
    assert [p for p in compose["ports"] if p.endswith(":9400")] == ["127.0.0.1:9400:9400"]
    docs = kubernetes_docs()
    for text in docs["ConfigMap", "kvcoord-config"]["data"].values():
        assert parse_config(text).server.metrics_listen.startswith("127.0.0.1:")
    env = {
        e["name"]: e
        for e in docs["StatefulSet", "kvcoord"]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["KVCOORD_METRICS_LISTEN"]["value"] == "$(POD_IP):9400"
