"""Host-side code shared by the kernel launchers: prepared launches, operand checks against the ``KVFormat``, the
dot mode, and the decoration of kernels on first launch.

Every launcher builds ``Launch`` objects (kernel, grid, arguments, constexprs, options) instead of launching at
once, so tests and ``aot`` can compile or key a launch without running it. Nothing here imports triton at module
level: ``import paged_hf`` works without it, and ``TRITON_INTERPRET`` takes effect whenever it was set before the
first launch.
"""

from __future__ import annotations

import os

import torch

from .kv_format import KVFormat, kv_format
from .pool_tensors import PoolTensors

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Launch:
    """One kernel launch, prepared: ``kernel[grid](*args, **meta)`` (kept apart so tests can compile it AOT)."""

    def __init__(self, kernel, grid: tuple, args: tuple, meta: dict, options: dict | None = None) -> None:
        self.kernel, self.grid, self.args, self.meta, self.options = kernel, grid, args, meta, options or {}

    def __call__(self) -> None:
        if all(self.grid):
            self.kernel[self.grid](*self.args, **self.meta, **self.options)

    def compile(self) -> None:
        """Compiles this launch's variant for the current device without running it (triton's ``warmup``; the
        interpreter compiles nothing; Triton 3.4's interpreted kernels have no ``warmup`` at all)."""
        if not hasattr(self.kernel, "warmup") and triton_interpreting():
            return
        self.kernel.warmup(*self.args, grid=self.grid, **self.meta, **self.options)


class PoolOperands:
    """Validated pools of one launch.

    ``data``: K and V codes (float8 as uint8 views; the compute dtype for "auto"); ``side``: key scale, value scale,
    key zero, value zero (None where the format has none); ``side_strides``: three strides of the key side data then
    three of the value side data: per-token scales ``[block, token, head]``; int4 keys (side "channel") the grid's
    ``[block, head, base/step]`` (the range codes sit at ``head_dim`` times the grid's offset, plus the channel);
    int4 values (side "token_code") ``vmax``'s block stride, the scale codes' byte stride, ``vmax``'s head stride
    (``[block, token pair, head]``: a token's scale-code byte sits at ``block_size // 2`` times ``vmax``'s offset
    plus its pair); ``tails``: the K and V tail pools (None without a tail) and ``tail_strides`` their four strides;
    ``meta``: the format's kernel constexprs.
    """

    def __init__(self, fmt: KVFormat, data, side, side_strides, tails, tail_strides, block_size: int,
                 num_kv_heads: int) -> None:
        self.fmt, self.data, self.side, self.side_strides = fmt, data, side, side_strides
        self.tails, self.tail_strides = tails, tail_strides
        self.block_size, self.num_kv_heads = block_size, num_kv_heads
        self.data_strides = data[0].stride()
        self.meta = fmt.kernel_meta()


def check_pools(query, pools: PoolTensors, head_dim: int) -> PoolOperands:
    """Checks ``pools`` against their ``KVFormat`` and ``head_dim`` (shapes, dtypes, strides, device) and unpacks them
    for a launch; ValueError naming the first mismatch."""
    if not isinstance(pools, PoolTensors):
        raise ValueError(f"pools must be a PoolTensors (KVStorage.pool_tensors()), got {type(pools).__name__}")
    key_cache, value_cache, key_scale, value_scale, key_zero, value_zero, kv_format_name, key_tail, value_tail = pools
    fmt = kv_format(kv_format_name)
    device = query.device
    for name, pool in (("key_cache", key_cache), ("value_cache", value_cache)):
        if pool.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, dim], got {tuple(pool.shape)}")
        if pool.device != device:
            raise ValueError(f"{name} is on {pool.device}, query on {device}")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} {key_cache.dtype} and value_cache {tuple(value_cache.shape)} "
            f"{value_cache.dtype} differ"
        )
    if key_cache.stride() != value_cache.stride():
        raise ValueError(f"key_cache strides {key_cache.stride()} != value_cache strides {value_cache.stride()}")
    num_blocks, block_size, num_kv_heads, dim = key_cache.shape
    if not fmt.quantized:
        if key_cache.dtype not in FLOAT_DTYPES:
            raise ValueError(f"kv_format='auto' needs a float32/float16/bfloat16 pool, got {key_cache.dtype}")
        expected_dim = head_dim
    else:
        if key_cache.dtype != fmt.code_dtype():
            raise ValueError(f"kv_format={fmt.name!r} stores {fmt.code_dtype()}, got {key_cache.dtype}")
        expected_dim = fmt.code_dim(head_dim)
    if dim != expected_dim:
        raise ValueError(f"pools have last dim {dim}; kv_format={fmt.name!r} with head_dim={head_dim} needs "
                         f"{expected_dim}")
    data = (key_cache, value_cache)
    if key_cache.dtype.is_floating_point and key_cache.element_size() == 1:  # float8: the kernels decode bits
        data = (key_cache.view(torch.uint8), value_cache.view(torch.uint8))

    layout = fmt.side_shapes(num_blocks, block_size, num_kv_heads, head_dim)
    side = {"key_scale": key_scale, "value_scale": value_scale, "key_zero": key_zero, "value_zero": value_zero}
    for name, t in side.items():
        if name in layout and t is None:
            raise ValueError(f"kv_format={fmt.name!r} needs {name}")
        if name not in layout and t is not None:
            raise ValueError(f"kv_format={fmt.name!r} takes no {name}")
        if t is None:
            continue
        shape, side_dtype = layout[name]
        if tuple(t.shape) != shape or t.dtype != side_dtype or t.device != device:
            raise ValueError(f"{name} must be {side_dtype} {shape} on {device}, got {t.dtype} {tuple(t.shape)} "
                             f"on {t.device}")
    side_strides = []
    for which, kind in (("key", fmt.key_side), ("value", fmt.value_side)):
        scale, zero = side[f"{which}_scale"], side[f"{which}_zero"]
        if kind == "channel":  # int4 keys: range codes [nb, H, 2, D] at head_dim x the grid [nb, H, 2]'s offset
            _check_nested_strides(f"{which}_scale", scale, f"{which}_zero", zero, head_dim, "head_dim")
            side_strides += list(zero.stride())
        elif kind == "token_code":  # int4 values: scale codes [nb, H, B // 2] at B // 2 x vmax [nb, H]'s offset
            _check_nested_strides(f"{which}_scale", scale, f"{which}_zero", zero, block_size // 2, "block_size // 2")
            side_strides += [zero.stride(0), scale.stride(2), zero.stride(1)]
        else:
            if zero is not None and zero.stride() != scale.stride():
                raise ValueError(f"{which}_zero strides {zero.stride()} != {which}_scale strides {scale.stride()}")
            side_strides += list(scale.stride()) if scale is not None else [0, 0, 0]

    tails = (key_tail, value_tail)
    if fmt.tail:
        for name, t in (("key_tail", key_tail), ("value_tail", value_tail)):
            if t is None:
                raise ValueError(f"kv_format={fmt.name!r} keeps a full-precision tail: it needs {name}")
            if t.dim() != 4 or tuple(t.shape[1:]) != (block_size, num_kv_heads, head_dim) or t.device != device \
                    or t.dtype not in FLOAT_DTYPES:
                raise ValueError(f"{name} must be float [rows, {block_size}, {num_kv_heads}, {head_dim}] on "
                                 f"{device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        if key_tail.stride() != value_tail.stride() or key_tail.dtype != value_tail.dtype:
            raise ValueError("key_tail and value_tail must share dtype and strides")
        tail_strides = key_tail.stride()
    else:
        if key_tail is not None or value_tail is not None:
            raise ValueError(f"kv_format={fmt.name!r} keeps no tail: it takes no key_tail / value_tail")
        tail_strides = (0, 0, 0, 0)
    return PoolOperands(fmt, data, (key_scale, value_scale, key_zero, value_zero), tuple(side_strides), tails,
                        tuple(tail_strides), block_size, num_kv_heads)


def _check_nested_strides(name, codes, grid_name, grid, factor: int, factor_name: str) -> None:
    """int4 side pools: ``codes`` (one more dimension than ``grid``, its last of stride 1) must sit at ``factor``
    times ``grid``'s element offsets, so the kernels reach both with ``grid``'s strides (contiguous pools do; the
    stride of a dimension of size 1 is never used)."""
    expected = [factor * s for s in grid.stride()] + [1]
    for dim, (size, stride) in enumerate(zip(codes.shape, codes.stride())):
        if size > 1 and stride != expected[dim]:
            raise ValueError(f"{name} strides {codes.stride()} must be {tuple(expected)} ({grid_name} strides "
                             f"{grid.stride()} times {factor_name}, then 1): keep both contiguous")


def check_tail_rows(tail_rows, pools: PoolOperands, num_seqs: int, device):
    """``tail_rows`` ``[S]`` (the tail pool row of each sequence) for a tail format, None otherwise."""
    if not pools.fmt.tail:
        if tail_rows is not None:
            raise ValueError(f"kv_format={pools.fmt.name!r} keeps no tail: it takes no tail_rows")
        return None
    if tail_rows is None:
        raise ValueError(f"kv_format={pools.fmt.name!r} keeps a full-precision tail: it needs tail_rows")
    check_index(tail_rows, "tail_rows", 1, device)
    if tail_rows.shape[0] != num_seqs:
        raise ValueError(f"tail_rows has {tail_rows.shape[0]} entries for {num_seqs} sequences")
    return tail_rows.contiguous()


def check_fresh(fresh_key, fresh_value, pools: PoolOperands, num_tokens: int, head_dim: int, device):
    """``(fresh_key, fresh_value, their 3 strides)`` for the kernels: a tail format's new K/V of the forward,
    ``[num_tokens, num_kv_heads, head_dim]`` in the tail pools' dtype, packed like the queries (``storage.FreshKV``);
    other formats take none (their kernels get placeholders they never read)."""
    if not pools.fmt.tail:
        if fresh_key is not None or fresh_value is not None:
            raise ValueError(f"kv_format={pools.fmt.name!r} keeps no tail: it takes no fresh_key / fresh_value")
        placeholder = pools.data[0]
        return placeholder, placeholder, (0, 0, 0)
    want = (num_tokens, pools.num_kv_heads, head_dim)
    tail_dtype = pools.tails[0].dtype
    for name, t in (("fresh_key", fresh_key), ("fresh_value", fresh_value)):
        if t is None:
            raise ValueError(f"kv_format={pools.fmt.name!r} reads each query's own block in full precision: it needs "
                             f"{name}")
        if tuple(t.shape) != want or t.dtype != tail_dtype or t.device != device:
            raise ValueError(f"{name} must be {tail_dtype} {list(want)} on {device}, got {t.dtype} {tuple(t.shape)} "
                             f"on {t.device}")
    if fresh_key.stride() != fresh_value.stride():
        raise ValueError("fresh_key and fresh_value must share their strides")
    return fresh_key, fresh_value, tuple(fresh_key.stride())


def check_query(query: torch.Tensor, name: str) -> tuple[int, int, int]:
    if query.dim() != 3:
        raise ValueError(f"{name} must be [tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if query.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32/float16/bfloat16, got {query.dtype}")
    return tuple(query.shape)


def check_index(t: torch.Tensor, name: str, dim: int, device) -> None:
    if t.dim() != dim or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a {dim}-d int32/int64 tensor, got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, query on {device}")


def check_sinks(sinks, num_heads: int, device) -> None:
    if sinks is None:
        return
    if sinks.shape != (num_heads,) or not sinks.dtype.is_floating_point or sinks.device != device:
        raise ValueError(f"sinks must be a float [{num_heads}] tensor on {device}, got {sinks.dtype} "
                         f"{tuple(sinks.shape)} on {sinks.device}")


def feature_meta(sliding_window, softcap, sinks) -> dict:
    if sliding_window is not None and int(sliding_window) <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    if softcap is not None and float(softcap) <= 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")
    return dict(USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None, USE_SINKS=sinks is not None)


def dot_mode(dtype: torch.dtype) -> int:
    """The ``DOT`` constexpr of the attention kernels for queries of ``dtype``: 0: the dots take K/V tiles and
    probabilities in ``dtype`` (float16/bfloat16 tensor cores, float32 accumulation); 1: float32 queries, float32
    dots in IEEE precision (not TF32); 2: bfloat16 rounding as in 0, dots in float32 (triton's interpreter
    multiplies the raw bits of bfloat16 operands in ``tl.dot``)."""
    if dtype == torch.float32:
        return 1
    if dtype == torch.bfloat16 and triton_interpreting():
        return 2
    return 0


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def triton_interpreting() -> bool:
    """Whether triton runs kernels in its CPU interpreter (``TRITON_INTERPRET``, read as triton reads it)."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def jit_unspecialized(fn, integers: tuple, pointers: tuple = ()):
    """``triton.jit(fn)`` with ``integers`` not specialized (== 1, multiples of 16) and, where this triton can say
    so, neither they nor ``pointers`` on alignment: the batch-following arguments (counts, widths, slices of
    per-sequence tensors, which a mixed step starts mid-tensor) then leave the compiled variant unchanged."""
    import inspect

    import triton

    options = dict(do_not_specialize=list(integers))
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        options["do_not_specialize_on_alignment"] = [*integers, *pointers]
    return triton.jit(fn, **options)


def constexpr_globals(module_globals: dict, names: tuple) -> None:
    """Compiled kernels may read module globals only as ``tl.constexpr``: wraps ``names`` (ints) once; the
    interpreter reads them as plain ints."""
    if triton_interpreting():
        return
    import triton.language as tl

    for name in names:
        if not isinstance(module_globals[name], tl.constexpr):
            module_globals[name] = tl.constexpr(module_globals[name])


class Kernels:
    """The decorated kernels (and helpers) of one module, by name."""

    def __init__(self, **kernels) -> None:
        self.__dict__.update(kernels)
