"""The engine's shape that lets mypyc compile it (bench/compile_engine.py) while the pure
source stays the one that runs by default: nothing of mypy_extensions at runtime, the
pool's roles one chain (a compiled class has one base) in the order the facade had."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kvcoord.engine
from kvcoord.engine import KVCachePool, TokenIds, _mypyc
from kvcoord.engine.managers.partial import CopyOnWrite, PartialFullAttentionManager, PartialMambaManager


def test_the_engine_runs_without_mypy_extensions() -> None:
    code = (
        "import sys; sys.modules['mypy_extensions'] = None\n"  # any import of it fails
        "import kvcoord.engine, kvcoord.engine.managers.partial\n"
        "print('ok')\n"
    )
    # the child imports this very engine (the checkout's client/, installed or not)
    client = str(Path(kvcoord.engine.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([client, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60, env=env
    )
    assert out.stdout.strip() == "ok"


def test_the_decorators_return_the_class() -> None:
    class C:
        pass

    assert _mypyc.trait(C) is C
    assert _mypyc.mypyc_attr(native_class=False)(C) is C
    assert TokenIds.__mro__[1:] == (list, object)


def test_the_pool_roles_resolve_as_before() -> None:
    """One chain of bases, the same method resolution order as the facade's three bases had."""
    assert [c.__name__ for c in KVCachePool.__mro__] == [
        "KVCachePool", "FastPaths", "PoolLookups", "Pool033Calls", "PoolInspection", "PoolRequests",
        "PoolParts", "object",
    ]  # fmt: skip
    assert all(len(c.__bases__) == 1 for c in KVCachePool.__mro__[:-1])


def test_the_partial_managers_mark_their_hits_themselves() -> None:
    """The copy-on-write trait comes after the manager, so each manager's own adoption
    (which marks a hit ending inside a block) must be the one that runs."""
    for cls in (PartialFullAttentionManager, PartialMambaManager):
        assert issubclass(cls, CopyOnWrite) and cls.__bases__[1] is CopyOnWrite
        assert "add_local_computed_blocks" in vars(cls) and "__init__" in vars(cls)
