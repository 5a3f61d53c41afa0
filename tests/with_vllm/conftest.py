"""tests/with_vllm run inside the vLLM venv (scripts/install_vllm.sh; scripts/test_vllm.sh runs them).

Under an interpreter without vLLM this directory is not collected (see tests/conftest.py).
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
