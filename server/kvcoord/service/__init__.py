"""kvcoord's server side: gRPC servicer, pool registry, metrics and the CLI."""

from __future__ import annotations

import os
import sys

# Snapshots fork the process (durability.py: the child writes a copy-on-write image of
# the state). gRPC's own fork handlers, on by default, can crash such a child, so they
# are turned off unless the environment says otherwise; gRPC reads the setting when it
# is first imported, so forking is used only when that happened after this line.
_set = os.environ.get("GRPC_ENABLE_FORK_SUPPORT")
if _set is None and "grpc" not in sys.modules:
    os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "0"
    _set = "0"
#: True when gRPC's fork handlers are off in this process (snapshots may fork)
FORK_SAFE = _set is not None and _set.strip().lower() in ("0", "false")
