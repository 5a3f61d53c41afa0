"""The plug-in picks the pool's semantics profile from the installed vLLM release."""

from __future__ import annotations

import pytest
from kvcoord.client.vllm033 import UnsupportedVLLMError, vllm_profile


@pytest.mark.parametrize(
    ("version", "profile"),
    [("0.16.0", "vllm-0.16"), ("0.16.1", "vllm-0.16"), ("0.33.0", "vllm-0.33"), ("0.33.1rc1", "vllm-0.33")],
)
def test_a_supported_release_names_its_profile(version: str, profile: str) -> None:
    assert vllm_profile(version) == profile


@pytest.mark.parametrize("version", ["0.15.1", "0.20.2", "0.32.0", "0.34.0", "1.0.0"])
def test_another_release_is_refused_with_the_supported_ones_named(version: str) -> None:
    with pytest.raises(UnsupportedVLLMError, match=r"vLLM 0\.16\.x .* and 0\.33\.x"):
        vllm_profile(version)
