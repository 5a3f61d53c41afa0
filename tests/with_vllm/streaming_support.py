"""What the vLLM 0.33 streaming-input tests (test_streaming_input033.py,
test_streaming_input_layouts033.py) and test_vllm033.py share: a per-test pool named
in the environment, and a scheduler driven one step at a time by a fake model that
samples one fixed token."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from harness import make_scheduler, summarize
from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer


def pool_env_fixture(prefix: str) -> Callable[..., Iterator[str]]:
    """A ``pool_env`` fixture: ``KVCOORD_TARGET`` names the session's server and
    ``KVCOORD_POOL`` a pool named after ``prefix`` and the test (what a pool name may not
    hold turned to '-', at most 60 characters), deleted after the test if created."""

    @pytest.fixture
    def pool_env(
        server: InProcessServer, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
    ) -> Iterator[str]:
        name = re.sub(r"[^A-Za-z0-9._-]", "-", f"{prefix}-{request.node.name}")[:60]
        monkeypatch.setenv("KVCOORD_TARGET", server.address)
        monkeypatch.setenv("KVCOORD_POOL", name)
        yield name
        with KVCoordClient(server.address) as c:
            if name in {p.name for p in c.list_pools().pools}:
                c.delete_pool(name, force=True)  # (teardown: an engine a failed test left attached too)

    return pool_env


class SteppedScheduler:
    """A ``cls`` scheduler (vLLM's or kvcoord's) built on ``config`` / ``kv_config``, with
    vLLM's block hasher for the requests it is given; each :meth:`step` schedules once and
    answers as a model that samples ``sampled`` for every request past its prefill."""

    def __init__(self, cls: type, config: Any, kv_config: Any, sampled: int) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        self.sched = make_scheduler(cls, config, kv_config)
        self.sampled = sampled
        hash_fn = get_hash_fn_by_name(self.sched.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(int(self.sched.hash_block_size), hash_fn)

    def request(self, rid: str, prompt: list[int], resumable: bool = False) -> Any:
        """A one-token request (a resumable one is a streaming session's, or its next chunk)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=1, ignore_eos=True)
        return Request(
            rid, list(prompt), params, None, block_hasher=self.hasher, resumable=resumable
        )  # (vLLM extends it)

    def add(self, rid: str, prompt: list[int], resumable: bool = False) -> None:
        self.sched.add_request(self.request(rid, prompt, resumable))

    def step(self) -> Any:
        """One step: the scheduler's decisions, :func:`harness.summarize`'d."""
        from vllm.v1.outputs import ModelRunnerOutput

        sched = self.sched
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = [[] if sched.requests[r].is_prefill_chunk else [self.sampled] for r in ids]
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
        ))  # fmt: skip
        return summarize(out)
