"""Start-up compilation of every kernel variant a layer of the paged path will launch, so none compiles while
serving.

A variant is what triton compiles once and caches: the kernel, its constexprs, the launch options and the
specialization of the other arguments (dtypes, None pointers, integers equal to 1 or multiples of 16, pointer
alignment). The kernels keep every batch-dependent quantity out of that key: the prefill finds a tile's sequence
with a loop instead of a batch-sized constexpr, the integers that follow the batch (token and sequence counts, the
block-table width, the partition count) are not specialized, nor is the alignment of the per-sequence tensors
(block tables, ``seq_lens``, ``cu_query_lens``, slots), which a mixed step slices mid-tensor. What is left depends
on the layer alone (pool format and dtypes, head_dim, heads, window / softcap / sinks, the query dtype and the index
dtypes) plus one switch: a decode batch whose block tables span one partition writes its output directly, a wider
one goes through partials and a reduce.
``layer_launches`` prepares one launch of each; ``warmup_kernels`` compiles them on the current device.

Usage, once per distinct layer kind at engine/server start-up, after the pools exist and before serving::

    from paged_hf.kernels.warmup import warmup_kernels
    warmup_kernels(
        storage.pool_tensors(), num_heads=config.num_attention_heads, dtype=model.dtype,
        sliding_window=window, softcap=softcap, sinks=sinks,
        store_dtype=storage.store_dtype,  # what ``write`` hands the store
        copy_tensors=list(storage.tensors().values()) + list(storage.tail_tensors().values()),
    )

Cost: one compile per variant (about 1-5 s each on a GPU machine's CPU, cached on disk by triton afterwards);
nothing runs on the GPU and no pool is written (triton's ``warmup`` compiles without launching). Under triton's
interpreter nothing is compiled.
"""

from __future__ import annotations

import torch

from . import copy_blocks as _copy
from . import paged_decode_attention as _decode
from . import paged_prefill_attention as _prefill
from . import store_kv as _store
from ._common import Launch
from .fill_blocks import StorePlan
from .kv_format import kv_format as _kv_format
from .pool_tensors import PoolTensors

def layer_launches(
    pools: PoolTensors,
    num_heads: int,
    dtype: torch.dtype,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    store_dtype: torch.dtype | None = None,
    copy_tensors: list[torch.Tensor] | None = None,
    index_dtype: torch.dtype = torch.int64,
    block_table_dtype: torch.dtype = torch.int32,
) -> list[Launch]:
    """One prepared launch of every variant a layer runs (nothing is launched).

    Args:
        pools: the layer's ``storage.pool_tensors()`` (pools, scales, zeros, tails, ``kv_format``).
        num_heads: query heads (a multiple of the pools' KV heads); ``dtype``: the query dtype the attention
            receives (the model dtype).
        sliding_window, softcap, sinks: the layer's attention options, as the attention passes them.
        store_dtype: dtype of the K/V the store receives (default ``dtype``; ``storage.store_dtype``).
        copy_tensors: the tensors a block copy moves (``storage.tensors().values()`` and the tail pools, which
            forks copy by row; default: the block and tail tensors of ``pools``).
        index_dtype: dtype of ``seq_lens``, ``cu_query_lens``, slots and copy ids (int64 in ``metadata``);
            ``block_table_dtype``: of the block tables (``block_table_rows.TABLE_DTYPE``, int32).

    Returns the launches: decode (one partition, written directly), decode over partitions and its reduce,
    prefill, store (a tail format: the block fill, and the tail write after the attention), and one block copy per
    pool tensor.
    """
    device = pools.key_cache.device
    block_size, num_kv_heads = pools.block_size, pools.num_kv_heads
    fmt = pools.format
    head_dim = pools.key_cache.shape[3] * fmt.values_per_code
    tail_rows = torch.zeros(1, dtype=index_dtype, device=device) if fmt.tail else None
    fresh = (None, None)  # a tail format's new K/V of the forward, as the store returns them (``storage.FreshKV``)
    if fmt.tail:
        fresh = tuple(torch.zeros(1, num_kv_heads, head_dim, dtype=pools.key_tail.dtype, device=device)
                      for _ in range(2))
    scale = head_dim ** -0.5
    query = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    seq_lens = torch.ones(1, dtype=index_dtype, device=device)
    launches = []
    # decode: a table within one partition (direct), and one wider than a partition (partials + reduce)
    for blocks in (1, -(-(_decode.PARTITION_SIZE + 1) // block_size)):
        tables = torch.zeros(1, blocks, dtype=block_table_dtype, device=device)
        launches += _decode._decode_launches(query, pools, tables, seq_lens, scale, sliding_window, softcap, sinks,
                                             torch.empty_like(query), None, tail_rows, *fresh)
    tables = torch.zeros(1, 1, dtype=block_table_dtype, device=device)
    cu_query_lens = torch.tensor([0, 1], dtype=index_dtype, device=device)
    launches += _prefill._prefill_launches(query, pools, tables, seq_lens, cu_query_lens, scale, sliding_window,
                                           softcap, sinks, torch.empty_like(query), tail_rows, *fresh)
    states = torch.zeros(1, num_kv_heads, head_dim, dtype=store_dtype or dtype, device=device)
    slots = torch.zeros(1, dtype=index_dtype, device=device)
    plan = None
    if fmt.tail:  # one token into the tail, one block filled
        ids = torch.zeros(1, dtype=index_dtype, device=device)
        plan = StorePlan(slots, ids, ids, ids, ids)
    launches += _store._store_launches(states, states, slots, pools, plan)
    if fmt.tail:
        launches.append(_store._tail_launch(*fresh, pools.key_tail, pools.value_tail, plan))
    if copy_tensors is None:
        copy_tensors = pools.block_tensors() + pools.tail_tensors()
    ids = torch.zeros(1, dtype=index_dtype, device=device)
    launches += _copy._copy_launches(ids, ids, copy_tensors)
    return launches


def warmup_kernels(pools: PoolTensors, num_heads: int, dtype: torch.dtype, **options) -> list[Launch]:
    """Compiles every variant of ``layer_launches(pools, num_heads, dtype, **options)`` for the current device
    without running it (triton's ``warmup``; a no-op under the interpreter). Returns the launches, whose
    ``aot.variant_key`` is what was compiled. Call it after the pools exist (their dtypes and strides are part of
    each variant) and before serving."""
    launches = layer_launches(pools, num_heads, dtype, **options)
    for launch in launches:
        launch.compile()
    return launches


def example_pools(kv_format: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device="cpu", num_tail_rows: int = 4) -> PoolTensors:
    """Zero-filled pools laid out like ``make_storage(...).pool_tensors()`` (the ``KVFormat``'s codes, side data
    and, for a tail format, ``num_tail_rows`` tail rows in ``dtype``): for compile reports and tests that need a
    layer's shapes and dtypes, not its data."""
    fmt = _kv_format(kv_format)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if not fmt.quantized:
        return PoolTensors(*(torch.zeros(shape, dtype=dtype, device=device) for _ in range(2)))
    code_shape = (*shape[:3], fmt.code_dim(head_dim))
    codes = [torch.zeros(code_shape, dtype=fmt.code_dtype(), device=device) for _ in range(2)]
    layout = fmt.side_shapes(num_blocks, block_size, num_kv_heads, head_dim)
    side = [torch.zeros(layout[name][0], dtype=layout[name][1], device=device) if name in layout else None
            for name in PoolTensors._fields[2:6]]
    tails = [torch.zeros((num_tail_rows, *shape[1:]), dtype=dtype, device=device) if fmt.tail else None
             for _ in range(2)]
    return PoolTensors(*codes, *side, kv_format, *tails)
