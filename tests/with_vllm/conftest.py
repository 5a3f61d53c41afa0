"""tests/with_vllm run inside a vLLM venv (scripts/install_vllm.sh; scripts/test_vllm.sh runs them),
of vLLM 0.16.0 or 0.33.0 (KVCOORD_VLLM_VERSION picks the venv).

Under an interpreter without vLLM this directory is not collected (see tests/conftest.py).
Under vLLM 0.33 every file runs: test_lost_sessions.py and test_failures.py drive the
0.33 plug-in's loss recovery and outage loop as they drive 0.16's (see
docs/vllm-integration.md). test_kv_events.py runs under both: the pool follows the
installed release's profile and its events are decoded by that release's classes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import write_model_dir
from kvcoord.service.testing import InProcessServer

os.environ.setdefault("PYTHONHASHSEED", "0")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def server() -> Iterator[InProcessServer]:
    srv = InProcessServer().start()
    yield srv
    srv.stop()
