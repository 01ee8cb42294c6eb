"""Random paged pools in any ``kv_format`` for the attention tests, and a plain per-sequence reading of them.

``random_pools`` quantizes random K/V with the reference quantizers as the format lays them out (``KVFormat``):
per-token codes and scales, or (int4) keys per channel over each block and values per token on the block's maximum
(``kv_quant``'s block quantizers), plus, for a format with
a full-precision tail, random tail rows in the compute dtype. The codes of a sequence's partial last block are left
random too: an attention that read them instead of the tail row would differ.

``random_block_tables`` gives sequences distinct random blocks. ``dense_kv`` reads one sequence's K/V position by position (float32), as an oracle independent of
``attention_ref``'s batched gathers.
"""

from __future__ import annotations

import torch

from paged_hf.kernels.kv_format import kv_format as get_format
from paged_hf.kernels.kv_quant import (
    dequantize_block_values_ref, dequantize_channels_ref, dequantize_kv_ref, quantize_block_values_ref,
    quantize_channels_ref, quantize_kv_ref,
)
from paged_hf.kernels.pool_tensors import PoolTensors

QUANTIZERS = {"channel": quantize_channels_ref, "token_code": quantize_block_values_ref}
BLOCK_DEQUANTIZERS = {"channel": dequantize_channels_ref, "token_code": dequantize_block_values_ref}


def random_pools(kv_format: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype=torch.float32, seed: int = 0, num_rows: int = 0, device="cpu", key_offset: float = 0.0) -> dict:
    """The fields of ``storage.pool_tensors()`` as a dict (``kernel_args`` makes them one argument), filled with
    random K/V (keys shifted by ``key_offset``, a channel bias as real keys have); ``num_rows`` tail rows for a tail
    format."""
    fmt = get_format(kv_format)
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key = torch.randn(shape, generator=gen) + key_offset * torch.randn(head_dim, generator=gen)
    value = torch.randn(shape, generator=gen)
    if not fmt.quantized:
        return {"key_cache": key.to(dtype).to(device), "value_cache": value.to(dtype).to(device)}
    ops = {}
    for which, x, side in (("key", key, fmt.key_side), ("value", value, fmt.value_side)):
        data, scale, zero = QUANTIZERS[side](x) if side in QUANTIZERS else quantize_kv_ref(x, kv_format)
        ops.update({f"{which}_cache": data, f"{which}_scale": scale, f"{which}_zero": zero})
    if fmt.tail:
        tail_shape = (num_rows, block_size, num_kv_heads, head_dim)
        ops["key_tail"] = (torch.randn(tail_shape, generator=gen)
                           + key_offset * torch.randn(head_dim, generator=gen)).to(dtype)
        ops["value_tail"] = torch.randn(tail_shape, generator=gen).to(dtype)
    return {**{k: None if v is None else v.to(device) for k, v in ops.items()}, "kv_format": kv_format}


def dense_kv(pools: dict, table: torch.Tensor, seq_len: int, tail_row: int | None = None) -> tuple[torch.Tensor,
                                                                                                      torch.Tensor]:
    """K and V ``[seq_len, num_kv_heads, head_dim]`` (float32) of the sequence with block table ``table``: position
    by position, from its block (dequantized) or, past its last full block, from tail row ``tail_row``."""
    fmt = get_format(pools.get("kv_format", "auto"))
    block_size = pools["key_cache"].shape[1]
    full_end = seq_len // block_size * block_size if fmt.tail else seq_len
    out = []
    for which, side in (("key", fmt.key_side), ("value", fmt.value_side)):
        cache = pools[f"{which}_cache"]
        rows = []
        for pos in range(seq_len):
            block, offset = int(table[pos // block_size]), pos % block_size
            if pos >= full_end:
                rows.append(pools[f"{which}_tail"][tail_row, offset].float())
            elif not fmt.quantized:
                rows.append(cache[block, offset].float())
            elif side in BLOCK_DEQUANTIZERS:
                whole = BLOCK_DEQUANTIZERS[side](cache[block].cpu(), pools[f"{which}_scale"][block].cpu(),
                                                 pools[f"{which}_zero"][block].cpu())
                rows.append(whole[offset].to(cache.device))
            else:
                raw = cache.view(torch.uint8)[block, offset].view(cache.dtype) if cache.element_size() == 1 \
                    and cache.dtype.is_floating_point else cache[block, offset]
                zero = pools.get(f"{which}_zero")
                rows.append(dequantize_kv_ref(raw, pools[f"{which}_scale"][block, offset],
                                              None if zero is None else zero[block, offset], fmt.name))
        out.append(torch.stack(rows) if rows else torch.zeros(0))
    return out[0], out[1]


def random_block_tables(lengths, block_size: int, num_blocks: int, generator: torch.Generator,
                        spare_columns: int = 1) -> torch.Tensor:
    """``[len(lengths), max blocks + spare_columns]`` int64 block tables: distinct random blocks for each sequence's
    tokens, then random (valid, possibly shared) ids in the columns past them, so no entry is out of range."""
    needed = [-(-n // block_size) for n in lengths]
    assert sum(needed) <= num_blocks, "not enough blocks for the test's sequences"
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.randint(0, num_blocks, (len(lengths), max(needed, default=0) + spare_columns), generator=generator)
    used = 0
    for s, n in enumerate(needed):
        tables[s, :n] = order[used : used + n]
        used += n
    return tables


def kernel_args(operands: dict) -> dict:
    """``operands`` (``random_pools``' dict, perhaps with ``tail_rows`` / ``fresh_*`` added) as keyword arguments of
    the kernels and oracles: the pool fields as one ``pools=PoolTensors(...)``, the others as they are."""
    fields = {name: t for name, t in operands.items() if name in PoolTensors._fields}
    return {"pools": PoolTensors(**fields), **{name: t for name, t in operands.items() if name not in fields}}
