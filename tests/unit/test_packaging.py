"""Layering and packaging rules that keep the project honest."""

from __future__ import annotations

import ast
import filecmp
import subprocess
import sys
from pathlib import Path

import kvcoord.client
import kvcoord.engine
import kvcoord.wire

ROOT = Path(__file__).resolve().parents[2]


def test_client_imports_nothing_from_the_server_side() -> None:
    """With only client/ on the path, the client package and stubs import and work (the
    engine is the client's too: a predicting manager mirrors its pool with it)."""
    code = (
        "import sys, kvcoord.client, kvcoord.client.testing, kvcoord.v1.allocator_pb2_grpc\n"
        "from kvcoord.client import BlockHasher, none_hash\n"
        "assert BlockHasher('sha256_cbor', 4, none_hash('sha256_cbor', '0')).extend([1, 2, 3, 4])\n"
        "bad = [m for m in sys.modules if m.startswith(('kvcoord.service', 'kvcoord.conformance'))]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(ROOT / "client")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_engine_has_no_grpc_or_io() -> None:
    """The engine imports only the standard library's pure modules and itself."""
    allowed = {
        "__future__", "dataclasses", "enum", "math", "typing", "collections", "collections.abc",
        "functools", "itertools", "operator",
    }  # fmt: skip
    for path in (ROOT / "client" / "kvcoord" / "engine").rglob("*.py"):
        bad = {m for m in _imports(path) if m not in allowed and not m.startswith("kvcoord.engine")}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_wire_imports_only_the_engine_the_messages_protobuf_and_the_stdlib() -> None:
    """kvcoord.wire ships to every worker next to the engine: nothing else of ours, no
    grpc, no third-party package but protobuf."""
    for path in (ROOT / "client" / "kvcoord" / "wire").rglob("*.py"):
        bad = {
            m
            for m in _imports(path)
            if m.split(".")[0] not in sys.stdlib_module_names
            and not m.startswith(("kvcoord.engine", "kvcoord.v1", "kvcoord.wire", "google.protobuf"))
        }
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
        relative = [
            n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom) and n.level > 1
        ]
        assert not relative, f"{path.relative_to(ROOT)} imports from outside the package"


def test_prometheus_client_only_in_metrics() -> None:
    """prometheus-client lives in service/metrics.py alone."""
    for path in (ROOT / "server").rglob("*.py"):
        if path.name != "metrics.py":
            assert not any(m.startswith("prometheus_client") for m in _imports(path)), path


def test_generated_code_is_current(tmp_path: Path) -> None:
    """Regenerating from proto/ gives byte-identical modules (run scripts/gen_protos.py after edits)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_protos
    finally:
        sys.path.pop(0)
    gen_protos.generate(tmp_path)
    fresh = tmp_path / "kvcoord" / "v1"
    committed = ROOT / "client" / "kvcoord" / "v1"
    names = sorted(p.name for p in fresh.iterdir())
    assert names == ["allocator_pb2.py", "allocator_pb2.pyi", "allocator_pb2_grpc.py"]
    for name in names:
        assert filecmp.cmp(fresh / name, committed / name, shallow=False), (
            f"{name} is stale: run scripts/gen_protos.py"
        )


def test_public_exports_are_pinned() -> None:
    """API changes are deliberate: the export lists are written down here."""
    assert sorted(kvcoord.engine.__all__) == sorted([
        "AllBlocksCleared", "AllocationResult", "AttentionSpec", "BlockRemoved", "BlockStored", "CacheHit",
        "ChunkedLocalAttentionSpec", "ConfigError", "CrossAttentionSpec", "EngineError", "ErrorStatus",
        "FailedPreconditionError", "FullAttentionSpec", "HintMismatchError", "InvalidArgumentError", "KVCacheConfig",
            "KVCacheEvent",
        "KVCachePool", "LoRA", "LookupCounters", "MambaCacheMode", "MambaSpec", "PoolSnapshot", "PrefixCacheStats",
        "RequestCheckpoint", "RequestExistsError", "RequestNotFoundError", "RequestRewind", "SlidingWindowSpec",
        "StaleCacheHitError",
        "UncountedBlocksError", "HitBlockTakenError",
        "BytesHashes", "Counts", "HandedTokenIds", "TokenIds", "attention_groups", "hash_to_int64",
    ])  # fmt: skip
    assert sorted(kvcoord.client.__all__) == sorted([
        "DEFAULT_RETRY", "NO_RETRY", "AbortedError", "AlreadyExistsError", "AsyncKVCoordClient", "BlockHasher",
        "FailedPreconditionError", "HashMismatchError", "InternalError", "InvalidArgumentError", "KVCacheBlockIds",
        "OwnerChangingError", "OwnerGoneError",
        "KVCoordClient", "KVCoordError", "MultiModalItem", "NotFoundError", "NotOwnerError", "Pending", "PermissionDeniedError",
        "PredictingKVCacheManager", "PredictionMismatchError", "RandomSeedError", "RemoteKVCacheManager", "ResourceExhaustedError", "RetryPolicy", "StepBatcher",
        "TLSOptions", "UnavailableError", "WrongReplicaError", "none_hash",
        # remote safety: typed reasons, the session keeper
        "AnswerEvictedError", "FencedError", "GracePeriodError", "KeyReusedError", "LeaseExpiredError",
        "OutcomeUnknownError", "RequestUnknownError", "RequestsLostError", "SessionExpiredError",
        "SessionKeeper", "SyncMismatchError", "PoolBusyError",
        # semantics profiles: the handshake refusal
        "ProfileMismatchError",
        # a fence position the server never issued (FENCE_UNPROVEN)
        "FenceUnprovenError",
    ])  # fmt: skip
    assert sorted(kvcoord.wire.__all__) == sorted([
        "HASH_LENGTHS", "LEASE_MARGIN", "MAX_MODEL_LEN_UNLIMITED", "STATS_FIELDS", "ConfigFileError", "ReplicaState", "WireError",
        "add_events", "allocate_op", "block_ids_to_pb", "config_from_pb", "copies_from_pb", "copies_to_pb", "event_from_pb", "event_to_pb", "events_digest",
        "events_from_pb", "events_message_digest", "extra_key_sources_from_pb", "fill_event", "free_op", "group_kinds", "hit_from_pb", "hit_to_pb", "ids_from_pb",
        "lora_from_pb", "offloads_from_pb", "offloads_to_pb", "pool_config_from_table", "pool_state_from_pb", "score_rank", "spec_from_pb", "stats_from_pb",
        "stats_to_pb", "string_list", "tables", "uncomputed_from_pb", "write_extra_key_sources", "write_ids", "write_pool_state",
    ])  # fmt: skip
    for mod in (kvcoord.engine, kvcoord.client, kvcoord.wire):
        for name in mod.__all__:
            assert hasattr(mod, name), name


def test_strict_typing_and_lint() -> None:
    """mypy --strict (configured in pyproject.toml) and ruff pass on all hand-written code."""
    for args in (
        [sys.executable, "-m", "mypy", "client", "server"],
        [sys.executable, "-m", "ruff", "check", "."],
    ):
        proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
