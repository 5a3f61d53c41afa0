"""The engine's rules fingerprint: whether two hosts' engines decide alike.

A mirror answers for the server only when both run the same rules on the same state.
:func:`rules_fingerprint` names them: the engine's state version and a digest of the
engine's sources (every ``.py`` file of ``kvcoord.engine``, by relative path), read
once per process. Another release, or a locally patched engine, gives another
fingerprint, and the client then runs without prediction (never a guess).

It lives outside the engine because it reads files (the engine does no I/O), in the
module both hosts share: the server's Attach sends it (``PoolState.engine_rules``), the
client's mirror compares it with its own.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import kvcoord.engine
from kvcoord.engine.state import STATE_VERSION

__all__ = ["rules_fingerprint"]


@functools.cache
def rules_fingerprint() -> str:
    """``state<STATE_VERSION>-<32 hex digits>`` for this process's engine."""
    root = Path(kvcoord.engine.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        name = path.relative_to(root).as_posix().encode()
        body = path.read_bytes()
        digest.update(len(name).to_bytes(4, "big") + name + len(body).to_bytes(8, "big") + body)
    return f"state{STATE_VERSION}-{digest.hexdigest()[:32]}"
