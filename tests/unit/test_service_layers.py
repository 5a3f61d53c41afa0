"""The service's layers, checked on its sources: PoolService is the only door to a
pool's engine, and the rules modules know nothing of gRPC."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "server" / "kvcoord" / "service"

#: the one module that holds a pool's engine; every other reaches it through PoolService
ENGINE_DOOR = {"pool_service.py"}


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
    bad = [use for p in modules if p.name not in ENGINE_DOOR for use in _engine_uses(p)]
    assert not bad, "engine reached around PoolService: " + ", ".join(bad)


def test_the_engine_check_sees_an_engine_access(tmp_path: Path) -> None:
    """The check above finds what it looks for (it cannot pass by reading nothing)."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f(service):\n    return service.engine.num_free_blocks\n")
    assert _engine_uses(sample) == ["sample.py:2 .engine"]
