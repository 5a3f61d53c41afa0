"""Replaying a trace and comparing every expectation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kvcoord.client.hashing import BlockHasher, BlockHasher033, block_hasher, none_hash
from kvcoord.engine import LoRA

from .target import ReplayTarget
from .trace import FORMAT_PROFILES, Trace

__all__ = ["Mismatch", "ReplayResult", "replay"]

FREE_QUEUE_HEAD_LIMIT = 256
#: ops between a lookup and the allocation adopting its hit (the others end the hit):
#: vLLM 0.33's scheduler sizes reserved_blocks with get_num_blocks_to_allocate, read-only
_KEEPS_LAST_HIT = frozenset({"get_computed_blocks", "step", "get_num_blocks_to_allocate"})


@dataclasses.dataclass(frozen=True, slots=True)
class Mismatch:
    """The first difference between a trace and the target."""

    line: int
    op: str
    request: str | None
    field: str
    expected: Any
    got: Any

    def __str__(self) -> str:
        req = f" req {self.request}" if self.request else ""
        return (
            f"line {self.line} op {self.op}{req}: {self.field}: expected {_short(self.expected)}, "
            f"got {_short(self.got)}"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayResult:
    """How one trace went: ``mismatch`` is ``None`` when every expectation held."""

    name: str
    ops: int
    mismatch: Mismatch | None

    @property
    def passed(self) -> bool:
        return self.mismatch is None


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Failed(Exception):
    def __init__(self, mismatch: Mismatch) -> None:
        self.mismatch = mismatch


@dataclasses.dataclass(slots=True)
class _ReqState:
    hasher: BlockHasher | BlockHasher033 | None
    tokens: list[int]
    hashes: list[bytes]
    num_computed_tokens: int = 0
    num_preemptions: int = 0


class _Replayer:
    def __init__(self, trace: Trace, target: ReplayTarget) -> None:
        self.trace = trace
        self.target = target
        cfg = trace.config
        self.algo = cfg.get("hash_algo") if cfg.get("enable_caching") else None
        self.hash_block_size = cfg["hash_block_size"]
        self.profile = FORMAT_PROFILES[trace.format_version]
        self.none = b""
        if self.algo:
            self.none = none_hash(self.algo, cfg["hash_seed"], profile=self.profile)
            if cfg.get("none_hash") and self.none.hex() != cfg["none_hash"]:
                raise _Failed(Mismatch(1, "config", None, "none_hash", cfg["none_hash"], self.none.hex()))
        self.reqs: dict[str, _ReqState] = {}
        self.last_hit: tuple[str, list[list[int]], int] | None = None
        self.line = 0
        self.op: dict[str, Any] = {}
        self.handlers: dict[str, Callable[[dict[str, Any]], None]] = {
            "step": lambda op: None,
            "add_request": self.add_request,
            "advance": self.advance,
            "get_computed_blocks": self.get_computed_blocks,
            "allocate_slots": self.allocate_slots,
            "free": self.free,
            "preempt": self.preempt,
            "reset_prefix_cache": self.reset_prefix_cache,
            "take_events": self.take_events,
            "make_prefix_cache_stats": self.make_prefix_cache_stats,
            "get_num_common_prefix_blocks": self.common_prefix,
            "check": self.check,
            "get_block_ids": self.get_block_ids,
            "cache_blocks": self.cache_blocks,
            "remove_skipped_blocks": self.remove_skipped_blocks,
            "evict_blocks": self.evict_blocks,
        }
        if trace.format_version == 2:
            # vLLM 0.33's calls (format 2); get_num_common_prefix_blocks is not recorded
            self.handlers.update(
                new_step_starts=self.new_step_starts,
                record_prefix_cache_stats=self.record_prefix_cache_stats,
                estimate_cached_tokens=self.estimate_cached_tokens,
                get_num_blocks_to_allocate=self.get_num_blocks_to_allocate,
                get_block_ids_for_computed_tokens=self.get_block_ids_for_computed_tokens,
                take_new_block_ids=self.take_new_block_ids,
                take_boundary_state_offloads=self.take_boundary_state_offloads,
                take_kv_cache_block_copies=self.take_kv_cache_block_copies,
            )

    def expect(self, field: str, expected: Any, got: Any) -> None:
        if expected != got:
            raise _Failed(
                Mismatch(self.line, self.op.get("op", "?"), self.op.get("req"), field, expected, got)
            )

    def run(self) -> None:
        for index, op in enumerate(self.trace.ops):
            self.line = index + 2
            self.op = op
            handler = self.handlers.get(op.get("op", ""))
            if handler is None:
                self.expect("op", "a known operation", op.get("op"))
                continue
            try:
                handler(op)
            except _Failed:
                raise
            except Exception as exc:  # the target refused or crashed: report, do not hide
                raise _Failed(
                    Mismatch(
                        self.line,
                        op["op"],
                        op.get("req"),
                        "exception",
                        "no error",
                        f"{type(exc).__name__}: {exc}",
                    )
                ) from exc
            if op["op"] not in _KEEPS_LAST_HIT:
                self.last_hit = None

    # -- ops --------------------------------------------------------------------
    def add_request(self, op: dict[str, Any]) -> None:
        rid = op["req"]
        lora_obj = op.get("lora")
        lora = LoRA(lora_obj["id"], lora_obj["name"]) if lora_obj else None
        hasher = None
        hashes: list[bytes] = []
        if self.algo:
            hasher = block_hasher(
                self.profile,
                self.algo,
                self.hash_block_size,
                self.none,
                lora_name=lora.name if lora else None,
                lora_path=lora_obj.get("path") if lora_obj else None,
                cache_salt=op.get("cache_salt"),
                num_hash_lookahead_tokens=self.trace.config.get("num_hash_lookahead_tokens", 0),
            )
            hashes = hasher.extend(op["prompt"])
        self.expect("block_hashes", op["expect"]["block_hashes"], [h.hex() for h in hashes])
        self.reqs[rid] = _ReqState(hasher, list(op["prompt"]), list(hashes))
        self.target.add_request(
            rid,
            list(op["prompt"]),
            hashes,
            lora,
            bool(op.get("skip_reading_prefix_cache")),
            op.get("cache_salt"),
        )

    def advance(self, op: dict[str, Any]) -> None:
        st = self.reqs[op["req"]]
        tokens = list(op["append_token_ids"])
        new = st.hasher.extend(tokens) if st.hasher else []
        self.expect("new_block_hashes", op["expect"]["new_block_hashes"], [h.hex() for h in new])
        st.num_computed_tokens = op["num_computed_tokens"]
        st.tokens.extend(tokens)
        st.hashes.extend(new)
        self.target.update_request(op["req"], op["num_computed_tokens"], tokens, new)

    def get_computed_blocks(self, op: dict[str, Any]) -> None:
        rid = op["req"]
        st = self.reqs[rid]
        state = op.get("state", {})
        self.expect("state.num_tokens", state.get("num_tokens", len(st.tokens)), len(st.tokens))
        self.expect(
            "state.num_preemptions", state.get("num_preemptions", st.num_preemptions), st.num_preemptions
        )
        ids, tokens = self.target.get_computed_blocks(rid)
        self.expect("block_ids", op["expect"]["block_ids"], ids)
        self.expect("num_computed_tokens", op["expect"]["num_computed_tokens"], tokens)
        if "shared_prefix_boundary" in op["expect"]:  # format 2: vLLM 0.33's third result
            self.expect(
                "shared_prefix_boundary",
                op["expect"]["shared_prefix_boundary"],
                self.target.shared_prefix_boundary(rid),
            )
        self.last_hit = (rid, ids, tokens)

    def allocate_slots(self, op: dict[str, Any]) -> None:
        rid = op["req"]
        hit = None
        if op.get("use_computed_blocks"):
            if self.last_hit is None or self.last_hit[0] != rid:
                self.expect("use_computed_blocks", "a lookup of this request just before", None)
            assert self.last_hit is not None
            hit = self.last_hit[1]
        got = self.target.allocate_slots(
            rid,
            op["num_new_tokens"],
            op.get("num_new_computed_tokens", 0),
            hit,
            op.get("num_lookahead_tokens", 0),
            op.get("num_external_computed_tokens", 0),
            bool(op.get("delay_cache_blocks", False)),
            op.get("num_encoder_tokens", 0),
            # Format 2's other inputs: has_scheduled_reqs and status only matter with a
            # watermark (the trace's config must have none) and skip_zeroing_group_ids
            # only for the worker's zeroing (no recorded trace both zeroes and skips),
            # so they change no answer.
            **(
                {
                    "full_sequence_must_fit": bool(op.get("full_sequence_must_fit", False)),
                    "reserved_blocks": op.get("reserved_blocks", 0),
                }
                if self.trace.format_version == 2
                else {}
            ),
        )
        self.expect("new_block_ids", op["expect"]["new_block_ids"], got)
        self.expect_free(op)

    def expect_free(self, op: dict[str, Any]) -> None:
        if "num_free_blocks" in op["expect"]:
            self.expect("num_free_blocks", op["expect"]["num_free_blocks"], self.target.num_free_blocks())

    def free(self, op: dict[str, Any]) -> None:
        self.target.free(op["req"])
        self.reqs.pop(op["req"], None)
        self.expect_free(op)

    def preempt(self, op: dict[str, Any]) -> None:
        self.target.preempt(op["req"])
        st = self.reqs[op["req"]]
        st.num_computed_tokens = 0
        st.num_preemptions += 1
        self.expect_free(op)

    def reset_prefix_cache(self, op: dict[str, Any]) -> None:
        self.expect("result", op["expect"]["result"], self.target.reset_prefix_cache())
        self.expect_free(op)

    def take_events(self, op: dict[str, Any]) -> None:
        self.expect("events", op["expect"]["events"], self.target.take_events())

    def make_prefix_cache_stats(self, op: dict[str, Any]) -> None:
        self.expect("stats", op["expect"]["stats"], self.target.make_prefix_cache_stats())

    def common_prefix(self, op: dict[str, Any]) -> None:
        self.expect(
            "num_blocks", op["expect"]["num_blocks"], self.target.get_num_common_prefix_blocks(op["req"])
        )

    def check(self, op: dict[str, Any]) -> None:
        exp = op["expect"]
        self.expect("num_free_blocks", exp["num_free_blocks"], self.target.num_free_blocks())
        head = exp["free_queue_head"]
        self.expect("free_queue_head", head, self.target.free_queue_head(FREE_QUEUE_HEAD_LIMIT))
        self.expect("usage", float(exp["usage"]), self.target.usage())
        for rid, want in exp["requests"].items():
            st = self.reqs.get(rid)
            self.expect(f"requests.{rid}.known", True, st is not None)
            assert st is not None
            self.expect(f"requests.{rid}.block_ids", want["block_ids"], self.target.get_block_ids(rid))
            self.expect(
                f"requests.{rid}.num_computed_tokens", want["num_computed_tokens"], st.num_computed_tokens
            )
            self.expect(f"requests.{rid}.num_tokens", want["num_tokens"], len(st.tokens))
        if "prefix_cache_stats" in exp:
            self.expect(
                "prefix_cache_stats", exp["prefix_cache_stats"], self.target.peek_prefix_cache_stats()
            )

    def get_block_ids(self, op: dict[str, Any]) -> None:
        self.expect("block_ids", op["expect"]["block_ids"], self.target.get_block_ids(op["req"]))

    def cache_blocks(self, op: dict[str, Any]) -> None:
        self.target.cache_blocks(op["req"], op["num_computed_tokens"])
        self.expect_free(op)

    def remove_skipped_blocks(self, op: dict[str, Any]) -> None:
        if "processed_computed_tokens" in op:  # format 2 (the prompt length only serves R-SWA)
            self.target.remove_skipped_blocks(op["req"], op["processed_computed_tokens"])
        else:
            self.target.remove_skipped_blocks(op["req"], op["total_computed_tokens"])
        self.expect_free(op)

    # -- format 2 (vLLM 0.33) ---------------------------------------------------------
    def new_step_starts(self, op: dict[str, Any]) -> None:
        self.target.new_step_starts()

    def record_prefix_cache_stats(self, op: dict[str, Any]) -> None:
        self.target.record_prefix_cache_stats(op["req"], op["num_hits"])

    def estimate_cached_tokens(self, op: dict[str, Any]) -> None:
        self.expect("num_tokens", op["expect"]["num_tokens"], self.target.estimate_cached_tokens(op["req"]))

    def get_num_blocks_to_allocate(self, op: dict[str, Any]) -> None:
        # num_local_computed_tokens and prefill_end only matter for mamba (not taken)
        got = self.target.get_num_blocks_to_allocate(
            op["req"],
            op["num_tokens"],
            op["total_computed_tokens"],
            op["num_tokens_main_model"],
            bool(op.get("apply_admission_cap", False)),
        )
        self.expect("num_blocks", op["expect"]["num_blocks"], got)

    def get_block_ids_for_computed_tokens(self, op: dict[str, Any]) -> None:
        got = self.target.get_block_ids_for_computed_tokens(op["req"], op["num_computed_tokens"])
        self.expect("block_ids", op["expect"]["block_ids"], got)

    def take_new_block_ids(self, op: dict[str, Any]) -> None:
        self.expect("block_ids", op["expect"]["block_ids"], self.target.take_new_block_ids())

    def take_boundary_state_offloads(self, op: dict[str, Any]) -> None:
        self.expect("offloads", op["expect"]["offloads"], self.target.take_boundary_state_offloads())

    def take_kv_cache_block_copies(self, op: dict[str, Any]) -> None:
        copies, retained = self.target.take_kv_cache_block_copies()
        self.expect("copies", op["expect"]["copies"], copies)
        self.expect("retained_block_ids", op["expect"]["retained_block_ids"], retained)

    def evict_blocks(self, op: dict[str, Any]) -> None:
        self.target.evict_blocks(list(op["block_ids"]))
        self.expect_free(op)


def replay(trace: Trace, target: ReplayTarget) -> ReplayResult:
    """Replay ``trace`` against a fresh pool on ``target``; stop at the first mismatch."""
    try:
        target.open(trace.config)
    except Exception as exc:
        return ReplayResult(
            trace.name,
            0,
            Mismatch(1, "config", None, "exception", "pool created", f"{type(exc).__name__}: {exc}"),
        )
    try:
        replayer = _Replayer(trace, target)
        replayer.run()
    except _Failed as failed:
        return ReplayResult(trace.name, len(trace.ops), failed.mismatch)
    finally:
        target.close()
    return ReplayResult(trace.name, len(trace.ops), None)
