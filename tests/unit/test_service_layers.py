"""The service's layers, checked on its sources: PoolService is the only door to a
pool's engine, and the rules modules know nothing of gRPC."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "server" / "kvcoord" / "service"

#: the one module that holds a pool's engine; every other reaches it through PoolService
ENGINE_DOOR = {"pool_service.py"}
#: PoolService's parts by role (each reads the engine through the PoolService that owns
#: it); only pool_service.py and the parts themselves import them
POOL_PARTS = {
    "pool_core.py",
    "pool_allocations.py",
    "pool_events.py",
    "pool_requests.py",
    "pool_reservations.py",
    "pool_scores.py",
    "pool_steps.py",
    "attach_rules.py",  # (whether an Attach may open a session: the pool's scheduler state)
}


def _engine_uses(path: Path) -> list[str]:
    """Where ``path`` reads or writes an attribute called ``engine``, or builds a pool's
    engine itself."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "engine":
            out.append(f"{path.name}:{node.lineno} .engine")
        elif isinstance(node, ast.Name) and node.id in {
            "KVCachePool",
            "check_pool",
            "export_state",
            "import_state",
        }:
            out.append(f"{path.name}:{node.lineno} {node.id}")
    return out


def test_pool_service_is_the_only_door_to_the_engine() -> None:
    """No service module but pool_service.py touches a pool's engine: resets,
    inspection, checks, state, stats, snapshots and metrics go through PoolService."""
    modules = sorted(SERVICE.glob("*.py"))
    assert len(modules) > 10 and any(p.name == "servicer.py" for p in modules)
    bad = [use for p in modules if p.name not in ENGINE_DOOR | POOL_PARTS for use in _engine_uses(p)]
    assert not bad, "engine reached around PoolService: " + ", ".join(bad)


def _imported_modules(path: Path) -> set[str]:
    """The service modules ``path`` imports (``from .x import ...``, ``from . import x``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            out |= {f"{n.split('.')[0]}.py" for n in names}
        elif isinstance(node, ast.ImportFrom) and (module := node.module or "").startswith(
            "kvcoord.service."
        ):
            out.add(f"{module.split('.')[2]}.py")
    return out


def test_pool_service_parts_are_reached_only_through_it() -> None:
    """PoolService's parts (POOL_PARTS) touch the engine, so no other service module
    imports them: they are reached through the PoolService that owns them."""
    modules = sorted(SERVICE.glob("*.py"))
    assert POOL_PARTS <= {p.name for p in modules}
    # pool_core.py is the parts' view of PoolService, which builds every other part
    assert POOL_PARTS - _imported_modules(SERVICE / "pool_service.py") == {"pool_core.py"}
    bad = [
        f"{p.name} imports {sorted(_imported_modules(p) & POOL_PARTS)}"
        for p in modules
        if p.name not in ENGINE_DOOR | POOL_PARTS and _imported_modules(p) & POOL_PARTS
    ]
    assert not bad, "PoolService's parts imported around it: " + ", ".join(bad)


def test_the_engine_check_sees_an_engine_access(tmp_path: Path) -> None:
    """The check above finds what it looks for (it cannot pass by reading nothing)."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f(service):\n    return service.engine.num_free_blocks\n")
    assert _engine_uses(sample) == ["sample.py:2 .engine"]


#: what only the mutation runner calls: the idempotency store's lookup and remember,
#: and the recorder's record of a keyed call
KEYED_STEPS = {"lookup", "remember", "called"}


def _calls(path: Path, names: set[str]) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names:
            out.append(f"{path.name}:{node.lineno} .{node.func.attr}()")
    return out


def test_idempotency_and_journaling_live_in_the_mutation_runner() -> None:
    """Key lookup, kept answers and call records happen in mutations.py alone (live
    calls and their replay), and the servicer never reaches the recorder: every
    mutating handler journals and waits for the commit through the runner."""
    modules = sorted(SERVICE.glob("*.py"))
    bad = [use for p in modules if p.name != "mutations.py" for use in _calls(p, KEYED_STEPS)]
    assert not bad, "idempotency or call journaling outside mutations.py: " + ", ".join(bad)
    reached = [
        f"{name}:{n.lineno}"
        for name, tree in _servicer_trees().items()
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr == "recorder"
    ]
    assert not reached, f"the servicer reaches the recorder at {reached}"


#: the servicer's modules: its class and add_servicer, what its parts share, the
#: handlers by role, the guard around them and the keyed calls they run
SERVICER_MODULES = ("servicer.py", "servicer_core.py", "rpc_guard.py", "mutating_calls.py")


def _servicer_trees() -> dict[str, ast.AST]:
    names = [*SERVICER_MODULES, *sorted(p.name for p in SERVICE.glob("*_calls.py"))]
    assert {"session_calls.py", "pool_calls.py", "observing_calls.py", "routing_calls.py"} <= set(names)
    return {name: ast.parse((SERVICE / name).read_text()) for name in dict.fromkeys(names)}


def test_every_keyed_rpc_is_a_mutation() -> None:
    """Each RPC whose request carries an idempotency key is run by the mutation runner,
    live (its handler) and on replay (the same Mutation); but ScorePools, whose key
    (kept only with reserve_seconds) belongs to a tenant, not a session, and whose
    kept answers are not journaled (a restart releases every reservation): its
    handler keeps them through the runner's kept_unjournaled / keep_unjournaled."""
    from kvcoord.service import mutating_calls
    from kvcoord.v1 import allocator_pb2 as pb

    keyed = {
        m.name
        for m in pb.DESCRIPTOR.services_by_name["Allocator"].methods
        if "idempotency_key" in m.input_type.fields_by_name
        and not m.client_streaming  # StepStream: each message run as a Step (step_stream.py)
    }
    assert keyed - {"ScorePools"} == {"Allocate", "Free", "Step"}
    keyed -= {"ScorePools"}
    trees = list(_servicer_trees().values())
    (score,) = (
        n
        for t in trees
        for n in ast.walk(t)
        if isinstance(n, ast.AsyncFunctionDef) and n.name == "ScorePools"
    )
    assert {"kept_unjournaled", "keep_unjournaled"} <= set(_calls_in(score))
    assert set(mutating_calls.MUTATIONS) == keyed
    handlers = {
        n.name: n
        for t in trees
        for n in ast.walk(t)
        if isinstance(n, ast.AsyncFunctionDef) and n.name in keyed
    }
    for name, fn in handlers.items():
        runs = [c for c in _calls_in(fn) if c == "run"]
        assert runs == ["run"], f"{name} does not go through MutationRunner.run"
    assert set(handlers) == keyed


def _calls_in(fn: ast.AST) -> list[str]:
    return [
        n.func.attr for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    ]


#: the service modules that speak gRPC: the servicer (its handlers by role and the guard
#: around them) and the server around it, their
#: interceptors and credentials, the wire conversion, errors.py, whose one table
#: turns a rules Status into a gRPC code, and cluster.py, which dials other replicas and
#: serves their AdoptPool calls (its rules are ownership.py's), handover_parts.py, which
#: sends and takes a pool's state in parts (AdoptPoolParts), and score_peers.py, which
#: asks them for their pools' scores (ScorePools in a cluster). Every other module is
#: plain Python.
GRPC_MODULES = {
    "errors.py",
    "servicer.py",
    "pool_calls.py",
    "session_calls.py",
    "observing_calls.py",
    "routing_calls.py",
    "rpc_guard.py",
    "step_stream.py",
    "server.py",
    "server_cluster.py",
    "intercept.py",
    "logs.py",
    "metrics.py",
    "tls.py",
    "convert.py",
    "cluster.py",
    "cluster_placement.py",
    "handover_parts.py",
    "score_peers.py",
}


def _imports_grpc(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "grpc" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "grpc":
            return True
    return False


def test_rules_modules_import_no_grpc() -> None:
    """pool_service, sessions, idempotency, registry, mutations, scoring, ... say what
    went wrong with errors.Status; only the modules that speak gRPC import it."""
    modules = sorted(SERVICE.glob("*.py"))
    rules = [p.name for p in modules if p.name not in GRPC_MODULES]
    assert {"pool_service.py", "sessions.py", "idempotency.py", "registry.py", "mutations.py"} <= set(rules)
    bad = [name for name in rules if _imports_grpc(SERVICE / name)]
    assert not bad, f"rules modules importing grpc: {bad}"


def test_every_status_has_its_own_grpc_code() -> None:
    """errors.py's table maps each Status to one gRPC code, and a ServiceError made with
    a gRPC code (the old way) is refused loudly instead of being answered wrongly."""
    import grpc
    import pytest
    from kvcoord.service.errors import ServiceError, Status, grpc_code

    codes = {status: grpc_code(ServiceError(status, "m"))[0] for status in Status}
    assert len(set(codes.values())) == len(Status)
    assert all(isinstance(c, grpc.StatusCode) and c is not grpc.StatusCode.OK for c in codes.values())
    assert codes[Status.INVALID] is grpc.StatusCode.INVALID_ARGUMENT
    assert codes[Status.PRECONDITION] is grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(TypeError, match="takes a Status"):
        ServiceError(grpc.StatusCode.NOT_FOUND, "m")
