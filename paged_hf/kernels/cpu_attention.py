"""The production CPU paged attention: the decode and varlen prefill of ``paged_*_attention_ref``, same signatures,
batched in torch without a Python loop over blocks or sequences.

``attention_ref`` stays the float32 oracle the tests compare against; this file gives the same results (float
tolerance) by another road, in the compute dtype (the query's: a bfloat16 model attends in bfloat16):

- **gather only the blocks used**: each sequence's block-table columns from the first one its queries' window
  reaches to its last (``_columns``), read with one ``index_select`` on the pool's ``[num_blocks, ...]`` rows in the
  pool's dtype (float8's bytes as uint8); a quantized pool dequantizes just those blocks, straight into the compute
  dtype (no float32 copy of a pool, nor of a bfloat16 gather);
- **one fused CPU flash attention** over the padded batch: queries ``[S, heads, n, D]`` against the gathered
  ``[S, kv_heads, L, D]`` (GQA native: no repeated K/V) under an additive position mask ``[S, 1, n, L]`` built
  once per call from positions alone. torch's CPU flash kernel accumulates the softmax in float32 for bfloat16
  inputs. Sinks join the denominator through the kernel's log-sum-exp: ``out * sigmoid(lse - sink)``. Softcap
  (which the fused kernel lacks) goes through ``_explicit_attention``: scores in float32, softmax, one matmul;
- **prefill** packs nothing per sequence: the packed queries scatter into ``[S, max q_len, ...]`` by one index,
  and the padded output gathers back by the same index;
- **int4's own block** (``attention_ref``'s module docstring): decode overwrites the gathered block that holds
  each query with its tail row and the query's own K/V; prefill appends each sequence's tail row and its new K/V
  after the stored keys, with the oracle's visibility rule (stored keys below each query's own block, exact keys
  of its own block up to it).

A batch whose gathered K/V would pass ``GATHER_ELEMENTS_PER_CHUNK`` goes in consecutive groups of sequences (each
group one vectorized call, a loop over groups, not sequences), so a batch of long contexts never holds a dense copy
of all its K/V, and each group's copy is read back from cache. What depends on the
step alone (the sequence groups, the block ids to gather, the masks, a tail format's own-block indices) is built by
the first layer and reused by the others (``_StepPlans``: the kernels' signatures carry tensors, not the step's
metadata object, so the plans are found by the step tensors' memory).

Decode and prefill over unquantized pools (float32, bfloat16: the "auto" format) go to the C++ kernels of
``cpu_ext`` where they could be built, sliding windows and softcaps included: they read each sequence's blocks where
they lie (no gathered copy, no padding to the longest sequence). The torch path below serves every other call
(quantized and tail formats, float16) and both where no compiler is present; all equal the oracle.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import torch

from .cpu_ext import decode_kernel, prefill_kernel
from .kv_format import kv_format as _kv_format
from .kv_quant import dequantize_block_values_ref, dequantize_channels_ref, dequantize_kv_ref
from .pool_tensors import PoolTensors

# Upper bound on the gathered K (or V) elements of one vectorized call; a larger batch goes in groups of sequences.
# 2^20 (4 MiB of float32 per K): a group's gathered (and dequantized) K/V is still in cache when the attention reads
# it. Measured at 1 thread, decode of 128 sequences x 1024 tokens, SmolLM2's heads, against 2^23: float32 2.1x,
# bfloat16 1.3x, int8 2.6x, int4 2.7x faster; 2^18 and 2^16 were between the two.
GATHER_ELEMENTS_PER_CHUNK = 1 << 20

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@torch.compiler.assume_constant_result
def _flash_groups_heads() -> bool:
    """Whether ``_flash`` maps each KV head to its group of query heads (grouped-query attention). torch 2.6 to 2.8
    take fewer KV heads than query heads without an error and return garbage; then ``_attend`` repeats the KV heads.
    A constant to dynamo (``generate`` compiled over the paged attention): it runs the probe eagerly, never traces
    it (a generator cannot be made inside a graph)."""
    return _probe_flash_groups_heads()


@functools.cache
def _probe_flash_groups_heads() -> bool:
    """``_flash_groups_heads``, asked once of the kernel itself."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 2, 1, 8, generator=generator)
    key, value = torch.randn(1, 1, 3, 8, generator=generator), torch.randn(1, 1, 3, 8, generator=generator)
    grouped, _ = _flash(query, key, value, scale=1.0)
    repeated, _ = _flash(query, key.expand(1, 2, 3, 8), value.expand(1, 2, 3, 8), scale=1.0)
    return torch.allclose(grouped, repeated, atol=1e-5)


def paged_decode_attention_cpu(query, pools: PoolTensors, block_tables, seq_lens, scale, sliding_window=None,
                               softcap=None, sinks=None, tail_rows=None, fresh_key=None, fresh_value=None):
    """``paged_decode_attention_ref``'s contract (``query [S, heads, D]`` at position ``seq_lens - 1``), batched."""
    kernel = _in_place_decode(query, pools, tail_rows)
    if kernel is not None:
        return kernel(query, pools.key_cache, pools.value_cache, block_tables, seq_lens, scale,
                      sliding_window or 0, softcap or 0.0, sinks)
    pools = _Pools(*pools)
    out = torch.empty_like(query)
    for a, b in _groups(seq_lens, pools):
        rows = None if tail_rows is None else tail_rows[a:b]
        fresh = None if fresh_key is None else (fresh_key[a:b], fresh_value[a:b])
        out[a:b] = _decode(query[a:b], pools, block_tables[a:b], seq_lens[a:b], scale, sliding_window, softcap,
                           sinks, rows, fresh)
    return out


def paged_prefill_attention_cpu(query, pools: PoolTensors, block_tables, seq_lens, cu_query_lens, scale,
                                sliding_window=None, softcap=None, sinks=None, tail_rows=None, fresh_key=None,
                                fresh_value=None):
    """``paged_prefill_attention_ref``'s contract (packed queries ``[T, heads, D]``, rows ``cu_query_lens[s] :
    cu_query_lens[s + 1]`` the last positions of sequence ``s``), batched."""
    kernel = _in_place_prefill(query, pools, tail_rows)
    if kernel is not None:
        return kernel(query, pools.key_cache, pools.value_cache, block_tables, seq_lens, cu_query_lens, scale, sinks,
                      sliding_window or 0, softcap or 0.0)
    pools = _Pools(*pools)
    out = torch.empty_like(query)
    for a, b in _groups(seq_lens, pools):
        first, last = int(cu_query_lens[a]), int(cu_query_lens[b])
        if last == first:
            continue
        rows = None if tail_rows is None else tail_rows[a:b]
        fresh = None if fresh_key is None else (fresh_key[first:last], fresh_value[first:last])
        out[first:last] = _prefill(query[first:last], pools, block_tables[a:b], seq_lens[a:b],
                                   cu_query_lens[a : b + 1] - first, scale, sliding_window, softcap, sinks, rows, fresh)
    return out


def _in_place_decode(query, pools: PoolTensors, tail_rows):
    """The C++ decode kernel (``cpu_ext``) where it serves this call: pools in the query's dtype (float32 or
    bfloat16, no codes, no tail), built on this machine; else None (the torch path below). Never while dynamo
    traces (``generate`` compiled over the paged attention): the torch path traces, and a graph must not depend on
    whether the library was built yet."""
    if (torch.compiler.is_compiling() or tail_rows is not None or pools.kv_format != "auto"
            or query.dtype not in _IN_PLACE_DTYPES or pools.key_cache.dtype != query.dtype or query.stride(-1) != 1
            or not (pools.key_cache.is_contiguous() and pools.value_cache.is_contiguous())):
        return None
    return decode_kernel()


def _in_place_prefill(query, pools: PoolTensors, tail_rows):
    """The C++ prefill (``cpu_ext``) where it serves this call (sliding windows and softcaps included): the decode
    kernel's conditions; else None."""
    return None if _in_place_decode(query, pools, tail_rows) is None else prefill_kernel()


_IN_PLACE_DTYPES = (torch.float32, torch.bfloat16)


class _Pools:
    """The pool operands of one call (a ``PoolTensors``' fields, in order) and ``gather``: blocks of K and V in the
    compute dtype."""

    def __init__(self, key_cache, value_cache, key_scale, value_scale, key_zero, value_zero, kv_format, key_tail,
                 value_tail) -> None:
        self.fmt = _kv_format(kv_format)
        self.key = (key_cache, key_scale, key_zero, self.fmt.key_side)
        self.value = (value_cache, value_scale, value_zero, self.fmt.value_side)
        self.tails = (key_tail, value_tail)
        self.block_size, self.num_kv_heads, self.head_dim = key_cache.shape[1], key_cache.shape[2], value_cache.shape[3]
        if self.fmt.tail and (key_tail is None or value_tail is None):
            raise ValueError(f"kv_format={kv_format!r} keeps a full-precision tail: pass key_tail, value_tail, "
                             f"tail_rows, fresh_key and fresh_value")

    def gather(self, flat: torch.Tensor, num_columns: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks ``flat`` (``[S * n]`` int64, ``n = num_columns`` per sequence) of K and V as
        ``[S, n * block_size, kv_heads, head_dim]`` in ``dtype``."""
        num_seqs = flat.shape[0] // num_columns
        out = []
        for cache, scale, zero, side in (self.key, self.value):
            if not self.fmt.quantized:
                blocks = cache.index_select(0, flat).to(dtype)
            else:
                raw = cache.view(torch.uint8) if cache.element_size() == 1 and cache.dtype.is_floating_point else cache
                codes = raw.index_select(0, flat).view(cache.dtype)
                side_scale = scale.index_select(0, flat)
                side_zero = None if zero is None else zero.index_select(0, flat)
                if side == "channel":
                    blocks = dequantize_channels_ref(codes, side_scale, side_zero, dtype)
                elif side == "token_code":
                    blocks = dequantize_block_values_ref(codes, side_scale, side_zero, dtype)
                else:
                    blocks = dequantize_kv_ref(codes, side_scale, side_zero, self.fmt.name, dtype)
            out.append(blocks.view(num_seqs, -1, *blocks.shape[2:]))
        return out[0], out[1]


class _StepPlans(threading.local):
    """The plans (``_DecodePlan``, ``_PrefillPlan``, the sequence groups) of the step running on this thread, so
    that every layer reuses what depends on the step's small tensors alone (block ids, masks) instead of building
    it again. A plan is a pure function of its key (kind, window, dtype, ...) and of the values of those tensors
    (block tables, lengths, offsets): it is found by comparing values with a copy taken when it was built, so an
    in-place change, a new step or a per-layer copy of the same values all find the right plan. Up to
    ``MAX_ENTRIES`` value sets (a mixed step's decode and prefill parts, the groups of a long batch) and
    ``MAX_BYTES`` of plans (a long prefill chunk's mask is large); past either, a new set clears them all. The
    newest are compared first (a layer finds its step's plan at once; a new step compares each held set once).
    Never while compiling (fake tensors)."""

    MAX_ENTRIES = 8
    MAX_BYTES = 64 << 20

    def __init__(self) -> None:
        self.entries: list[tuple[tuple, dict]] = []  # (copies of the tensors, {key: plan})
        self.nbytes = 0

    def get(self, key: tuple, tensors: tuple, build):
        if torch.compiler.is_compiling():
            return build()
        plans = next((plans for held, plans in reversed(self.entries) if _same_values(held, tensors)), None)
        if plans is None:
            if len(self.entries) >= self.MAX_ENTRIES or self.nbytes > self.MAX_BYTES:
                self.entries, self.nbytes = [], 0
            plans = {}
            self.entries.append((tuple(None if t is None else t.clone() for t in tensors), plans))
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = build()
            self.nbytes += sum(t.nbytes for t in (plan if isinstance(plan, tuple) else ())
                               if isinstance(t, torch.Tensor))
        return plan


def _same_values(held: tuple, tensors: tuple) -> bool:
    return len(held) == len(tensors) and all(
        (a is None and b is None) or (a is not None and b is not None and a.dtype == b.dtype and a.shape == b.shape
                                      and a.device == b.device and torch.equal(a, b))
        for a, b in zip(held, tensors))


_STEP = _StepPlans()


def _groups(seq_lens, pools) -> list[tuple[int, int]]:
    """Consecutive sequence ranges whose gathered keys fit ``GATHER_ELEMENTS_PER_CHUNK`` (one range when compiling:
    no host sync); once per step."""
    return _STEP.get(("groups", pools.num_kv_heads * pools.head_dim, pools.block_size, GATHER_ELEMENTS_PER_CHUNK),
                     (seq_lens,),
                     lambda: _sequence_groups(seq_lens, pools))


def _sequence_groups(seq_lens, pools) -> list[tuple[int, int]]:
    count = seq_lens.shape[0]
    if count == 0:
        return []
    per_token = pools.num_kv_heads * pools.head_dim
    if torch.compiler.is_compiling() or int(seq_lens.max()) * count * per_token <= GATHER_ELEMENTS_PER_CHUNK:
        return [(0, count)]
    lengths = seq_lens.tolist()
    groups, start, longest = [], 0, 0
    for s, n in enumerate(lengths):
        longest_with = max(longest, n + pools.block_size)
        if s > start and (s + 1 - start) * longest_with * per_token > GATHER_ELEMENTS_PER_CHUNK:
            groups.append((start, s))
            start, longest_with = s, n + pools.block_size
        longest = longest_with
    return groups + [(start, count)]


def _columns(block_tables, first_positions, last_positions, block_size, window) -> tuple[torch.Tensor, torch.Tensor]:
    """The block ids ``[S, n]`` each sequence reads and their first key positions ``[S]``: its table columns from the
    block of the oldest key its queries' window reaches (0 without a window) through its last query's block, padded
    to the longest span with valid ids (their keys are masked). Without a host sync when compiling: all columns."""
    num_columns = block_tables.shape[1]
    start = torch.zeros_like(first_positions)
    if window is not None:
        start = (first_positions - window + 1).clamp_min(0) // block_size
    if torch.compiler.is_compiling():
        start = torch.zeros_like(start)
        width = num_columns
    else:
        width = min(num_columns, int((last_positions // block_size - start).max()) + 1)
    columns = (start[:, None] + torch.arange(width, device=start.device)[None, :]).clamp_max(num_columns - 1)
    return block_tables.gather(1, columns.to(block_tables.device)), start * block_size


class _DecodePlan(NamedTuple):
    """What a group of decode queries needs that depends on the step alone (built once, read by every layer)."""

    ids: torch.Tensor  # [S * n] int64: the blocks to gather
    num_columns: int  # n
    mask: torch.Tensor  # [S, 1, 1, n * block_size] additive, in the compute dtype
    positions: torch.Tensor  # [S]
    own_column: torch.Tensor | None  # [S]: the gathered column of each query's own block (tail formats)
    rows: torch.Tensor | None  # [S]: the tail rows (tail formats)


def _decode_plan(block_tables, seq_lens, bs, window, dtype, device, tail_rows) -> _DecodePlan:
    positions = seq_lens.long().to(device) - 1
    ids, key_start = _columns(block_tables, positions, positions, bs, window)
    key_positions = key_start[:, None] + torch.arange(ids.shape[1] * bs, device=device)[None, :]  # [S, L]
    visible = key_positions <= positions[:, None]
    if window is not None:
        visible &= key_positions > positions[:, None] - window
    own_column = None if tail_rows is None else positions // bs - key_start // bs
    return _DecodePlan(ids.reshape(-1).long(), ids.shape[1], _additive(visible[:, None, None, :], dtype), positions,
                       own_column, None if tail_rows is None else tail_rows.long())


def _decode(query, pools, block_tables, seq_lens, scale, window, softcap, sinks, tail_rows, fresh):
    """One group of decode queries ``[S, heads, D]``."""
    num_seqs, dtype, bs = query.shape[0], query.dtype, pools.block_size
    plan = _STEP.get(("decode", window, dtype, bs), (block_tables, seq_lens, tail_rows), lambda: _decode_plan(
        block_tables, seq_lens, bs, window, dtype, query.device, tail_rows))
    k, v = pools.gather(plan.ids, plan.num_columns, dtype)
    if pools.fmt.tail:  # the query's own block, exact: its tail row with the query's own K/V at its offset
        batch = torch.arange(num_seqs, device=query.device)
        for gathered, tail, new in zip((k, v), pools.tails, fresh):
            exact = tail.index_select(0, plan.rows).to(dtype)
            exact[batch, plan.positions % bs] = new.to(dtype)
            gathered.view(num_seqs, -1, bs, *gathered.shape[2:])[batch, plan.own_column] = exact
    out = _attend(query.unsqueeze(2), k, v, plan.mask, scale, softcap, sinks)
    return out.squeeze(2)


class _PrefillPlan(NamedTuple):
    """What a group of prefill chunks needs that depends on the step alone (built once, read by every layer)."""

    ids: torch.Tensor  # [S * n] int64: the blocks to gather
    num_columns: int
    width: int  # the longest chunk
    same_lengths: bool  # every chunk as long: the packed rows are the padded ones
    seq_of: torch.Tensor  # [T]: the chunk of each packed query
    offset: torch.Tensor  # [T]: its row in its chunk
    mask: torch.Tensor | None  # [S, 1, W, L (+ bs + W with a tail)] additive, in the compute dtype; None: causal
    tail_rows: torch.Tensor | None  # [S] int64 (tail formats)


def _prefill_plan(block_tables, seq_lens, cu_query_lens, num_queries, bs, window, dtype, device, tail_rows,
                  softcap: bool) -> _PrefillPlan:
    """``softcap``: the call softcaps its scores (``_explicit_attention`` takes a mask: no causal plan)."""
    num_seqs = seq_lens.shape[0]
    seq_lens = seq_lens.long().to(device)
    query_lens = (cu_query_lens[1:] - cu_query_lens[:-1]).long().to(device)
    width = int(query_lens.max())
    seq_of = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens, output_size=num_queries)
    offset = torch.arange(num_queries, device=device) - cu_query_lens.long().to(device)[seq_of]
    ctx = seq_lens - query_lens  # the first new position of each sequence
    if not softcap and tail_rows is None and not bool(ctx.any()) and (window is None or int(seq_lens.max()) <= window):
        # every chunk is its sequence's first and no window cuts it: gathered key j is position j, so the kernel's
        # own causal rule (query row i sees keys 0..i) is the mask, and it skips the key tiles above the diagonal
        ids, _ = _columns(block_tables, ctx, seq_lens - 1, bs, None)
        return _PrefillPlan(ids.reshape(-1).long(), ids.shape[1], width, num_queries == num_seqs * width, seq_of,
                            offset, None, None)
    columns = torch.arange(width, device=device)
    positions = ctx[:, None] + columns[None, :]  # [S, W]; columns >= query_lens are padding rows
    ids, key_start = _columns(block_tables, ctx, seq_lens - 1, bs, window)
    key_positions = key_start[:, None] + torch.arange(ids.shape[1] * bs, device=device)[None, :]  # [S, L]
    rows = positions[:, :, None]  # [S, W, 1]
    visible = key_positions[:, None, :] <= rows
    if tail_rows is not None:  # stored keys below each query's own block; then its own block exact, appended
        first = ctx // bs * bs  # where the tail row starts
        visible &= key_positions[:, None, :] < torch.maximum(rows // bs * bs, first[:, None, None])
        offsets = torch.arange(bs, device=device)
        own_positions = torch.cat([first[:, None] + offsets[None, :], positions], dim=1)  # [S, bs + W]
        own_valid = torch.cat([first[:, None] + offsets[None, :] < ctx[:, None],
                               columns[None, :] < query_lens[:, None]], dim=1)
        own_visible = own_valid[:, None, :] & (own_positions[:, None, :] <= rows)
        own_visible &= own_positions[:, None, :] // bs == rows // bs
        key_positions = torch.cat([key_positions, own_positions], dim=1)
        visible = torch.cat([visible, own_visible], dim=2)
    if window is not None:
        visible &= key_positions[:, None, :] > rows - window
    return _PrefillPlan(ids.reshape(-1).long(), ids.shape[1], width, num_queries == num_seqs * width, seq_of, offset,
                        _additive(visible[:, None], dtype), None if tail_rows is None else tail_rows.long())


def _prefill(query, pools, block_tables, seq_lens, cu_query_lens, scale, window, softcap, sinks, tail_rows, fresh):
    """One group of prefill chunks: packed ``query [T, heads, D]`` of sequences ``cu_query_lens`` (from 0)."""
    num_seqs, dtype, bs = seq_lens.shape[0], query.dtype, pools.block_size
    capped = softcap is not None
    plan = _STEP.get(("prefill", window, dtype, bs, query.shape[0], capped),
                     (block_tables, seq_lens, cu_query_lens, tail_rows),
                     lambda: _prefill_plan(block_tables, seq_lens, cu_query_lens, query.shape[0], bs, window, dtype,
                                           query.device, tail_rows, capped))
    width, seq_of, offset = plan.width, plan.seq_of, plan.offset
    if plan.same_lengths:
        padded = query.view(num_seqs, width, *query.shape[1:])
    else:
        padded = query.new_zeros(num_seqs, width, *query.shape[1:])
        padded[seq_of, offset] = query
    k, v = pools.gather(plan.ids, plan.num_columns, dtype)
    if pools.fmt.tail:  # each sequence's tail row and its new K/V after the stored keys (the plan's mask)
        if plan.same_lengths:
            new_k, new_v = (x.view(num_seqs, width, *x.shape[1:]) for x in fresh)
        else:
            new_k, new_v = (x.new_zeros(num_seqs, width, *x.shape[1:]) for x in fresh)
            new_k[seq_of, offset], new_v[seq_of, offset] = fresh
        k = torch.cat([k, pools.tails[0].index_select(0, plan.tail_rows).to(dtype), new_k.to(dtype)], dim=1)
        v = torch.cat([v, pools.tails[1].index_select(0, plan.tail_rows).to(dtype), new_v.to(dtype)], dim=1)
    out = _attend(padded.transpose(1, 2), k, v, plan.mask, scale, softcap, sinks)  # [S, heads, W, D]
    out = out.transpose(1, 2)
    return out.reshape(query.shape) if plan.same_lengths else out[seq_of, offset]


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean ``visible`` as the fused kernel's additive mask (0 / -inf), in the query's dtype (the kernel's)."""
    return torch.where(visible, 0.0, float("-inf")).to(dtype)


def _attend(query, k, v, mask, scale, softcap, sinks) -> torch.Tensor:
    """``query [S, heads, n, D]`` over ``k``, ``v`` ``[S, L, kv_heads, D]`` under the additive ``mask [S, 1, n, L]``
    (``_additive``; None: causal from the top left, query row i sees keys 0..i, never with ``softcap``); returns
    ``[S, heads, n, D]`` in the query's dtype (rows that see no key: 0)."""
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    if softcap is not None:
        return _explicit_attention(query, k, v, mask == 0, scale, softcap, sinks)
    if k.shape[1] != query.shape[1] and not _flash_groups_heads():
        group = query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if mask is None:
        out, lse = _flash(query, k, v, is_causal=True, scale=scale)
    else:
        out, lse = _flash(query, k, v, attn_mask=mask, scale=scale)
    if sinks is not None:  # the sink joins the denominator: exp(lse) / (exp(lse) + exp(sink))
        weight = torch.sigmoid(lse - sinks.float().view(1, -1, 1))
        out = (out.float() * weight.unsqueeze(-1)).to(query.dtype)
    return out


def _explicit_attention(query, k, v, visible, scale, softcap, sinks) -> torch.Tensor:
    """Softcapped attention (the fused kernel has no softcap): scores ``[S, kv_heads, group * n, L]`` in float32."""
    num_seqs, num_heads, num_queries, head_dim = query.shape
    num_kv_heads = k.shape[1]
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads * num_queries, head_dim)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    rows_visible = visible.expand(-1, num_heads, -1, -1).reshape(num_seqs, num_kv_heads, -1, visible.shape[-1])
    scores = scores.masked_fill_(~rows_visible, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, num_kv_heads, -1, 1, 1).expand(num_seqs, -1, -1, num_queries, 1)
        scores = torch.cat([scores, sink.reshape(num_seqs, num_kv_heads, -1, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    if sinks is not None:
        probs = probs[..., :-1]
    out = torch.matmul(probs.to(v.dtype), v)
    return out.view(num_seqs, num_heads, num_queries, head_dim)
