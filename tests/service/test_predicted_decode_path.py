"""The predicted manager's decode path (issue 21 item 6): a running request's step
whose only change is one token, read in place from vLLM's token list
(``RequestTracker.next_token``) and answered by one engine check
(``KVCachePool.decode_token``), answers as the general paths, call for call, and the
server confirms every Step: the workload of ``test_predicted_fast_paths`` on requests
whose tokens are a read-only view of their list, as vLLM's ``Request`` gives them."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from kvcoord.client import KVCoordClient, predicting
from kvcoord.client.mirror import Mirror
from service import test_predicted_fast_paths as general
from unit.test_client_fast_paths import _View  # vLLM's ConstantList


@dataclasses.dataclass
class _ViewReq(general._Req):
    """A request whose ``all_token_ids`` is a view of its token list, as vLLM's."""

    def __post_init__(self) -> None:
        self.all_token_ids = _View(self.all_token_ids)  # type: ignore[assignment]

    def append(self, token: int) -> None:
        self.all_token_ids._x.append(token)  # type: ignore[attr-defined]
        self.hasher.extend([token])


def _request(rid: str, tokens: list[int]) -> _ViewReq:
    r = _ViewReq(rid, list(tokens))
    r.hasher.extend(tokens)
    return r


@pytest.mark.parametrize("layout", sorted(general._GROUPS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_decode_path_answers_as_the_general_paths(
    client: KVCoordClient, layout: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every answer, table, usage, event and statistic of the fast side (the decode
    path taken for most running steps) equals the general side's, and the server
    confirms both sides' Steps."""
    answered: list[bool] = []
    stepped: list[bool] = []  # (decode_step: a block taken or cached, for a pool of one group)

    class Counted(Mirror):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            inner = self.decode_token

            def decode_token(*a: Any) -> Any:
                out = inner(*a)
                answered.append(out is not None)
                return out

            self.decode_token = decode_token  # type: ignore[method-assign]

        def decode_step(self, *a: Any) -> Any:
            out = super().decode_step(*a)
            stepped.append(out is not None)
            return out

    monkeypatch.setattr(predicting, "Mirror", Counted)
    monkeypatch.setattr(general, "_request", _request)
    general.test_the_fast_paths_answer_as_the_general_paths(client, layout, seed)
    # (the decode path answered; a sliding window of 2 blocks leaves one every 4 tokens)
    assert sum(answered) > (100 if layout == "full" else 20), (sum(answered), len(answered))
    assert not all(answered)  # (and handed the steps taking a block to decode_step)
    if layout == "full":
        assert sum(stepped) > 100, (sum(stepped), len(stepped))  # (taken and cached blocks)
    else:
        assert not any(stepped)  # (two groups: the general path's)
