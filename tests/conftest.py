"""Suite-wide collection rule: the integration suite needs a running deployment.

`make test` (scripts/test.sh) starts the container and Prometheus and sets
KVCOORD_TARGET; without it, tests/integration is not collected (run `make integration`).
"""

from __future__ import annotations

import os

collect_ignore = [] if os.environ.get("KVCOORD_TARGET") else ["integration"]
