"""A KV-content oracle for vLLM's scheduler (vLLM's own manager or kvcoord's plug-in).

It keeps, per (KV cache group, block id), what each slot holds: ``(writer request id,
position)``; the KV at a position depends on the writer's token prefix up to it. Slots
are written

- when the (fake) model runs a scheduled step: positions [num_computed_tokens,
  +num_scheduled) of each scheduled request, into its block table as SchedulerOutput
  tells the worker (new requests' block_ids; cached requests' new block ids appended,
  or, when resumed, the whole table replaced);
- when a KV connector load finishes: positions [local hit, local hit + external) into
  the blocks the connector was given in ``update_state_after_alloc`` (asynchronous
  loads: when the worker reports ``finished_recving``; synchronous ones: with the step
  that schedules the request, as vLLM's storage connectors build their metadata from
  the SchedulerOutput).

vLLM 0.33's worker zeroes the blocks a step names (``new_block_ids_to_zero``) and applies
its copy-on-write copies (``kv_cache_block_copies``) first: a zeroed slot holds nothing.

On every schedule(), for each scheduled request, every position below its
num_computed_tokens (prefix hits and loaded tokens included) must be held, in the block
its table names, by a slot whose writer had the same token prefix at that position
(the same request, or another with equal tokens [0..p]). Full attention: every position;
sliding window (a SlidingWindowSpec group): only positions inside the window
(>= num_computed_tokens - sliding_window + 1); chunked local attention (a
ChunkedLocalAttentionSpec group): only positions of the chunk num_computed_tokens is in.
A mamba group (MambaSpec, "none" or "align" mode; prefill checkpoint blocks not
modelled: such a group is skipped) holds a state per block: ``(writer, p)`` is the
state after the writer's first p tokens. As vLLM's model runner does (0.33's
``mamba_utils.preprocess_mamba``; "none" mode has one block of the model's length, so
index 0), a step of n tokens from num_computed_tokens nc reads the state in the block
the request's last step wrote (a new or resumed request: index (nc-1) // block_size;
with speculative blocks, also the next ones: the accepted draft's state) and writes the
state after nc + n tokens into index cdiv(nc + n, block_size) - 1, with drafts d the
states after nc + n - d .. nc + n into that index and the d next. The read is checked
before the step's writes. Other group kinds are not checked (``skipped_groups``).

Usage::

    oracle = KVOracle(scheduler)   # wraps schedule() and the connector (if any)
    run_workload(scheduler, ...)
    oracle.assert_clean()
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

_V033 = importlib.metadata.version("vllm").startswith("0.33.")

#: a slot's content: (writer request id, position)
Slot = tuple[str, int]


class KVOracleError(AssertionError):
    pass


class KVOracle:
    def __init__(
        self, scheduler: Any, *, raise_at_once: bool = False, max_violations: int = 50,
        shared: KVOracle | None = None, tag: str = "",
    ) -> None:  # fmt: skip
        """``shared``: another engine's oracle whose KV memory this engine shares (block
        ids name the same slots: two schedulers on one shared pool); ``tag`` tells this
        engine's request ids from the other's (the same ids, other requests)."""
        self.sched = scheduler
        self.tag = tag
        self.raise_at_once = raise_at_once
        self.max_violations = max_violations
        cfg = scheduler.kv_cache_config
        self.groups: list[tuple[str, int, int | None]] = []  # (kind, block size, window)
        self._align: set[int] = set()  # mamba groups in "align" mode
        # (the async scheduler's num_computed_tokens with drafts in flight counts them
        # accepted, the worker corrects it: the states' positions are not known here)
        async_drafts = bool(
            getattr(scheduler.scheduler_config, "async_scheduling", False)
            and getattr(scheduler, "num_spec_tokens", 0)
        )
        self.skipped_groups: list[int] = []
        for g, group in enumerate(cfg.kv_cache_groups):
            spec = group.kv_cache_spec
            name = type(spec).__name__
            window = getattr(spec, "sliding_window", None)
            if name in ("FullAttentionSpec", "MLAAttentionSpec"):
                self.groups.append(("full", spec.block_size, None))
            elif name == "SlidingWindowSpec":
                self.groups.append(("swa", spec.block_size, int(window)))
            elif name == "ChunkedLocalAttentionSpec":
                self.groups.append(("chunked", spec.block_size, int(spec.attention_chunk_size)))
            elif (
                name == "MambaSpec"
                and not getattr(spec, "num_prefill_checkpoint_blocks", 0)
                and not async_drafts
            ):
                self.groups.append(("mamba", spec.block_size, int(spec.num_speculative_blocks)))
                if spec.mamba_cache_mode == "align":
                    self._align.add(g)
            else:
                self.groups.append(("skip", spec.block_size, None))
                self.skipped_groups.append(g)
        self.content: list[dict[int, dict[int, Slot]]] = [{} for _ in self.groups]
        if shared is not None:
            assert [k for k, _, _ in shared.groups] == [k for k, _, _ in self.groups]
            self.content = shared.content
        self.tables: dict[str, list[list[int]]] = {}
        # every request seen (finished ones kept), by tagged id (the engines' shared)
        self.requests: dict[str, Any] = shared.requests if shared is not None else {}
        self.violations: list[tuple[Any, ...]] = []
        self.unverifiable = 0
        self.checked_positions = 0
        self.checked_steps = 0
        self.step = -1
        self.loads_written = 0
        self.mamba_reads = 0
        self.blocks_zeroed = self.blocks_copied = 0
        self.foreign_reads = 0  # positions read of KV another engine wrote (a shared oracle)
        #: (rid, group) -> the mamba block index the request's last step wrote its state to
        self._state_idx: dict[tuple[str, int], int] = {}
        # connector loads
        self._local: dict[str, int] = {}
        self._sync_pending: dict[str, tuple[int, int]] = {}  # rid -> (local, external)
        self._async_pending: dict[str, tuple[list[list[int]], int, int]] = {}
        #: per SchedulerOutput (id): the drafted mamba steps in "align" mode, whose
        #: accepted state the runner copies to a block boundary once sampled
        self._post: dict[int, list[tuple[str, int, list[int], int, int]]] = {}
        self._wrap_schedule()
        if getattr(scheduler, "connector", None) is not None:
            self._wrap_connector(scheduler.connector)

    # -- wiring ----------------------------------------------------------------------
    def _wrap_schedule(self) -> None:
        schedule = self.sched.schedule

        def checked_schedule() -> Any:
            out = schedule()
            self.on_schedule(out)
            return out

        self.sched.schedule = checked_schedule
        update = self.sched.update_from_output

        def checked_update(out: Any, mro: Any) -> Any:
            self._postprocess(self._post.pop(id(out), ()), mro)
            return update(out, mro)

        self.sched.update_from_output = checked_update

    def _postprocess(self, post: Any, mro: Any) -> None:
        """vLLM 0.33's ``postprocess_mamba`` ("align" mode, drafts): once a step's drafts
        are accepted or not, the state at the last block boundary they reached (if past
        the state the step kept) is copied to that boundary's block, which the manager
        then caches."""
        for rid, g, ids, _curr, running in post:
            i = mro.req_id_to_index.get(rid)
            if i is None or not mro.sampled_token_ids[i]:
                continue
            new = running + len(mro.sampled_token_ids[i]) - 1
            bs = self.groups[g][1]
            aligned = new // bs * bs
            if aligned >= running and aligned > 0:
                self._write_state(rid, g, ids, aligned // bs - 1, [aligned])

    def _wrap_connector(self, connector: Any) -> None:
        matched, after_alloc, output = (
            connector.get_num_new_matched_tokens, connector.update_state_after_alloc, connector.worker_output,
        )  # fmt: skip
        is_async_load = getattr(connector, "loading", None)

        def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> Any:
            self._local[request.request_id] = num_computed_tokens
            return matched(request, num_computed_tokens)

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
            after_alloc(request, blocks, num_external_tokens)
            rid = request.request_id
            self.requests[self.tag + rid] = request
            if not num_external_tokens:
                return
            local = self._local.get(rid, 0)
            if is_async_load is not None and rid in connector.loading:
                table = [list(g) for g in blocks.get_block_ids()]
                self._async_pending[rid] = (table, local, num_external_tokens)
            else:
                self._sync_pending[rid] = (local, num_external_tokens)

        def worker_output() -> Any:
            out = output()
            if out is not None:
                for rid in out.finished_recving or ():
                    pending = self._async_pending.pop(rid, None)
                    if pending is None:
                        continue
                    table, local, ext = pending
                    if rid in set(getattr(out, "failed_recving", None) or ()):
                        continue
                    # vLLM 0.16 takes a finished asynchronous load to fill every block it
                    # was given (num_computed_tokens = blocks x block size, below
                    # num_tokens); 0.33 the tokens the connector named
                    req = self.requests.get(self.tag + rid)
                    hi = (
                        len(table[0]) * self.groups[0][1] if table and table[0] and not _V033 else local + ext
                    )
                    if req is not None:
                        hi = min(hi, req.num_tokens)
                    self._write(rid, table, local, max(hi, local + ext), load=True)
                    self.loads_written += 1
            return out

        connector.get_num_new_matched_tokens = get_num_new_matched_tokens
        connector.update_state_after_alloc = update_state_after_alloc
        connector.worker_output = worker_output

    # -- the model ------------------------------------------------------------------------
    def _write(self, rid: str, table: list[list[int]], lo: int, hi: int, load: bool = False) -> None:
        for g, (kind, bs, _w) in enumerate(self.groups):
            if kind == "skip" or g >= len(table):
                continue
            ids = table[g]
            if kind == "mamba":  # (a load: the state after hi tokens, where a step would put it)
                if load and hi > lo:
                    self._write_state(rid, g, ids, (hi - 1) // bs, [hi])
                continue
            content = self.content[g]
            for p in range(lo, hi):
                i = p // bs
                if i >= len(ids):
                    self._violate("write past the table", rid, g, p, len(ids))
                    break
                b = ids[i]
                if b == 0:
                    continue  # the null block (a sliding window's skipped position)
                content.setdefault(b, {})[p % bs] = (self.tag + rid, p)

    def _write_state(self, rid: str, g: int, ids: list[int], at: int, states: list[int]) -> None:
        for j, p in enumerate(states):
            if at + j >= len(ids):
                self._violate("mamba state written past the table", rid, g, p, len(ids))
                return
            b = ids[at + j]
            if b == 0:
                self._violate("mamba state written into the null block", rid, g, p, at + j)
                return
            self.content[g][b] = {0: (self.tag + rid, p)}

    def _mamba_step(self, out: Any, computed: dict[str, int], resumed: set[str]) -> None:
        """Every scheduled request's mamba reads (checked), then the step's state writes."""
        mamba = [(g, bs, spec) for g, (kind, bs, spec) in enumerate(self.groups) if kind == "mamba"]
        if not mamba:
            return
        gone = set(out.finished_req_ids) | set(out.preempted_req_ids or ()) | resumed
        for key in [key for key in self._state_idx if key[0] in gone]:
            del self._state_idx[key]
        drafts = out.scheduled_spec_decode_tokens
        writes = []
        for rid, n in out.num_scheduled_tokens.items():
            table = self.tables.get(rid)
            if rid not in computed or table is None:
                continue
            nc = computed[rid]
            d = len(drafts.get(rid, ()))
            for g, bs, nspec in mamba:
                ids = table[g] if g < len(table) else []
                prev = self._state_idx.get((rid, g), (nc - 1) // bs)
                if nc > 0:
                    self._check_state(rid, g, ids, prev, nspec, nc)
                curr = -(-(nc + n) // bs) - 1
                self._state_idx[(rid, g)] = curr
                writes.append((rid, g, ids, curr, [nc + n - d + j for j in range(d + 1)]))
                if d and g in self._align:
                    self._post.setdefault(id(out), []).append((rid, g, ids, curr, nc + n - d))
        for w in writes:
            self._write_state(*w)

    def _check_state(self, rid: str, g: int, ids: list[int], prev: int, nspec: int, nc: int) -> None:
        self.mamba_reads += 1
        self.checked_positions += 1
        seen = []
        for i in range(prev, prev + nspec + 1):
            if i < 0 or i >= len(ids) or ids[i] == 0:
                seen.append((i, None))
                continue
            slot = self.content[g].get(ids[i], {}).get(0)
            seen.append((i, ids[i], slot))
            if slot is None or slot[1] != nc:
                continue
            if slot[0] == self.tag + rid:
                return
            same = self._same_prefix(slot[0], self.tag + rid, nc - 1)
            if same is None:
                self.unverifiable += 1
                return
            if same:
                return
        self._violate("mamba state not the request's", rid, g, nc, seen)

    def _same_prefix(self, writer: str, holder: str, p: int) -> bool | None:
        a, b = self.requests.get(writer), self.requests.get(holder)
        if a is None or b is None:
            return None
        if getattr(a, "cache_salt", None) != getattr(b, "cache_salt", None):
            return False
        la, lb = getattr(a, "lora_request", None), getattr(b, "lora_request", None)
        if (la and la.lora_int_id) != (lb and lb.lora_int_id):
            return False
        ta, tb = a.all_token_ids, b.all_token_ids
        if len(ta) <= p or len(tb) <= p:
            return None
        return list(ta[: p + 1]) == list(tb[: p + 1])

    def _violate(self, *what: Any) -> None:
        v = (self.step, *what)
        if len(self.violations) < self.max_violations:
            self.violations.append(v)
        if self.raise_at_once:
            raise KVOracleError(f"KV oracle: {v}")

    def on_schedule(self, out: Any) -> None:
        self.step += 1
        for rid, r in self.sched.requests.items():
            self.requests.setdefault(self.tag + rid, r)
        for rid in out.finished_req_ids:
            self.tables.pop(rid, None)
        for rid in out.preempted_req_ids or ():
            self.tables.pop(rid, None)
        computed: dict[str, int] = {}
        for r in out.scheduled_new_reqs:
            self.tables[r.req_id] = [list(g) for g in r.block_ids]
            computed[r.req_id] = r.num_computed_tokens
        c = out.scheduled_cached_reqs
        for rid, new, n in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens, strict=True):
            computed[rid] = n
            if rid in c.resumed_req_ids:
                self.tables[rid] = [list(g) for g in new] if new is not None else [[] for _ in self.groups]
            elif new is not None:
                cur = self.tables.get(rid)
                if cur is None:
                    self._violate("cached request with no known table", rid)
                    cur = self.tables[rid] = [[] for _ in new]
                for g, ids in enumerate(new):
                    cur[g].extend(ids)
        # (vLLM 0.33) the worker zeroes new blocks, then applies copy-on-write copies,
        # before the step's forward: in every group's cache
        self.blocks_zeroed += len(getattr(out, "new_block_ids_to_zero", None) or ())
        for b in getattr(out, "new_block_ids_to_zero", None) or ():
            for content in self.content:
                content.pop(b, None)
        for copy in getattr(out, "kv_cache_block_copies", None) or ():
            self.blocks_copied += 1
            for content in self.content:
                if copy.src_block_id in content:
                    content[copy.dst_block_id] = dict(content[copy.src_block_id])
                else:
                    content.pop(copy.dst_block_id, None)
        # mamba: the states each request starts from, then what the step writes
        resumed = set(c.resumed_req_ids)
        # synchronous loads: done by the worker before this step's forward
        for rid in list(self._sync_pending):
            if rid in computed:
                local, ext = self._sync_pending.pop(rid)
                self._write(rid, self.tables[rid], local, local + ext, load=True)
                self.loads_written += 1
        self._mamba_step(out, computed, resumed)
        # the step runs: every layer writes the scheduled positions' KV before its
        # attention reads (a request may hit on blocks another computes in the same step)
        for rid, n in out.num_scheduled_tokens.items():
            if rid in computed and rid in self.tables:
                self._write(rid, self.tables[rid], computed[rid], computed[rid] + n)
        # the check: what each scheduled request reads
        for rid in out.num_scheduled_tokens:
            if rid not in computed:
                self._violate("scheduled request not in new/cached", rid)
                continue
            self._check(rid, computed[rid])
        self.checked_steps += 1
        for rid in out.finished_req_ids:
            self._sync_pending.pop(rid, None)

    def _check(self, rid: str, nc: int) -> None:
        table = self.tables.get(rid)
        if table is None:
            self._violate("no table", rid)
            return
        for g, (kind, bs, window) in enumerate(self.groups):
            if kind in ("skip", "mamba"):
                continue
            ids = table[g] if g < len(table) else []
            if kind == "chunked":
                lo = nc - nc % window  # (window: the chunk size)
            else:
                lo = 0 if kind == "full" else max(0, nc - window + 1)
            content = self.content[g]
            for p in range(lo, nc):
                i = p // bs
                if i >= len(ids):
                    self._violate("computed position past the table", rid, g, p, len(ids))
                    break
                b = ids[i]
                if b == 0:
                    self._violate("computed position in the null block", rid, g, p)
                    break
                slot = content.get(b, {}).get(p % bs)
                self.checked_positions += 1
                if slot is None:
                    self._violate("never written", rid, g, p, b)
                    break
                writer, wp = slot
                if wp != p:
                    self._violate("slot holds another position", rid, g, p, b, slot)
                    break
                if writer == self.tag + rid:
                    continue
                same = self._same_prefix(writer, self.tag + rid, p)
                self.foreign_reads += not writer.startswith(self.tag) if self.tag else 0
                if same is None:
                    self.unverifiable += 1
                elif not same:
                    self._violate("slot holds another prefix's KV", rid, g, p, b, slot)
                    break

    # -- verdict ----------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        return {
            "steps": self.checked_steps, "positions": self.checked_positions, "loads": self.loads_written,
            "unverifiable": self.unverifiable, "violations": len(self.violations), "mamba_reads": self.mamba_reads,
            "foreign_reads": self.foreign_reads, "zeroed": self.blocks_zeroed, "copied": self.blocks_copied,
            "skipped_groups": self.skipped_groups,
        }  # fmt: skip

    def assert_clean(self) -> None:
        assert not self.violations, f"KV oracle: {self.summary()} first: {self.violations[:6]}"
        assert self.checked_positions > 0, self.summary()
