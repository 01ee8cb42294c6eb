"""Paged decode attention: one query token per sequence against that sequence's blocks.

``paged_decode_attention_ref`` is the torch reference (the CPU path and the test oracle);
``paged_decode_attention`` is the Triton kernel with the same signature (flash-decoding):

- grid ``(sequences, kv_heads, partitions)``: a program holds the ``group`` query heads that share one KV head
  (GQA: each K/V tile is read once for the whole group) and walks one partition of ``partition_size`` tokens
  of its sequence in tiles of ``BLOCK_N`` tokens, gathering each token's slot through the block table, so the
  tile size does not depend on the block size;
- K/V codes enter the dots as loaded (every ``kv_format``: int8, fp8 e4m3/e5m2 decoded from their bits, int4
  nibbles; exact in the query's dtype) and each token's scale and zero point apply to the scores and
  probabilities instead (``load_kv_codes``); scores and the online softmax (running max, sum, accumulator) are
  float32;
- each partition writes its partial max, sum and unnormalized output; a reduce kernel rescales and sums them
  (and adds the attention sink, once). A batch whose block tables span a single partition skips the reduce.
  The partition count comes from the block-table width, not from ``seq_lens``: no device-to-host sync. So the
  partials are allocated for the widest table, but a program whose partition starts at or past its sequence's
  length exits before reading or writing anything (the reduce reads only the partitions below the length): one
  long sequence batched with many short ones costs the short ones no partial traffic. Sizing the partials to the
  lengths themselves would need ``seq_lens`` on the host (a sync, or a host-side length from the step plan).

The Triton functions are decorated on first launch (``_kernels()``), not at import: ``import paged_hf`` imports
this module without needing triton, and ``TRITON_INTERPRET`` (which ``triton.jit`` reads when it decorates) takes
effect whenever it was set before the first launch.
"""

from __future__ import annotations

import functools
import os

import torch

from .attention_ref import paged_attention_core
from .kv_quant import kv_data_dim, kv_data_dtype, kv_has_zero

# kv_format -> the FORMAT constexpr of the kernels.
KV_FORMAT_IDS = {"auto": 0, "int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3, "int4": 4}
PARTITION_SIZE = 512  # tokens per flash-decoding partition
BLOCK_N = 64  # tokens per K/V tile inside a program
# Launch options of the decode kernel. maxnreg=255 lets ptxas use the registers it needs (up to 244 here): left to
# itself it sometimes stopped at 128 and spilled (8-56 bytes per thread, sm_90; benchmarks/RESULTS.md).
DECODE_OPTIONS = dict(num_warps=4, num_stages=2, maxnreg=255, enable_fp_fusion=True)
# head_dim > 128: [32, 256] K/V tiles (the bytes of a [64, 128] one); [64, 256] ones spilled at 4 warps.
WIDE_HEAD_BLOCK_N = 32
WIDE_HEAD_DECODE_OPTIONS = dict(num_warps=4, num_stages=2, maxnreg=255, enable_fp_fusion=True)
_REDUCE_CHUNK = 32  # partitions merged per step of the reduce kernel
# Integers that follow the batch (partition count, block-table width): not specialized by triton (== 1, multiple
# of 16), so one compiled variant serves every batch (see ``warmup``).
DECODE_NO_SPECIALIZE = ("num_parts", "stride_bt")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def paged_decode_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    key_zero: torch.Tensor | None = None,
    value_zero: torch.Tensor | None = None,
    kv_format: str = "auto",
) -> torch.Tensor:
    """Torch reference.

    Args:
        query: ``[S, num_heads, head_dim]``, the token at position ``seq_lens[s] - 1`` of each sequence.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; the query's own K/V is
            already stored. Quantized pools add ``key_scale`` .. ``kv_format`` (see ``paged_attention_core``).
        block_tables: ``[S, max_blocks]`` int32/int64.
        seq_lens: ``[S]`` tokens held per sequence, the query's own included (>= 1).

    Returns ``[S, num_heads, head_dim]``.
    """
    positions = (seq_lens.long() - 1).unsqueeze(1)
    out = paged_attention_core(
        query.unsqueeze(2), positions, key_cache, value_cache, block_tables, seq_lens,
        scale, sliding_window, softcap, sinks, key_scale, value_scale, key_zero, value_zero, kv_format,
    )
    return out.squeeze(2)


# ----------------------------------------------------------------------------------------------- launcher


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    key_zero: torch.Tensor | None = None,
    value_zero: torch.Tensor | None = None,
    kv_format: str = "auto",
    *,
    partition_size: int | None = None,
) -> torch.Tensor:
    """Triton flash-decoding; the arguments and result of ``paged_decode_attention_ref``.

    ``partition_size`` (keyword only, a multiple of the tile of ``decode_tiles``, 64 tokens; default
    ``PARTITION_SIZE``) is the number of tokens one program reads; tests shrink it to reach the multi-partition
    path with short sequences.
    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for launch in _decode_launches(
        query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap, sinks,
        key_scale, value_scale, key_zero, value_zero, kv_format, out, partition_size,
    ):
        launch()
    return out


class Launch:
    """One kernel launch, prepared: ``kernel[grid](*args, **meta)`` (kept apart so tests can compile it AOT)."""

    def __init__(self, kernel, grid: tuple, args: tuple, meta: dict, options: dict | None = None) -> None:
        self.kernel, self.grid, self.args, self.meta, self.options = kernel, grid, args, meta, options or {}

    def __call__(self) -> None:
        if all(self.grid):
            self.kernel[self.grid](*self.args, **self.meta, **self.options)

    def compile(self) -> None:
        """Compiles this launch's variant for the current device without running it (triton's ``warmup``; the
        interpreter compiles nothing)."""
        self.kernel.warmup(*self.args, grid=self.grid, **self.meta, **self.options)


def _decode_launches(
    query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap, sinks,
    key_scale, value_scale, key_zero, value_zero, kv_format, out, partition_size=None,
) -> list[Launch]:
    k = _kernels()
    num_seqs, num_heads, head_dim = _check_query(query, "query")
    pools = check_pools(
        query, key_cache, value_cache, key_scale, value_scale, key_zero, value_zero, kv_format, head_dim
    )
    group = num_heads // pools.num_kv_heads
    if group * pools.num_kv_heads != num_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={pools.num_kv_heads}")
    _check_index(block_tables, "block_tables", 2, query.device)
    _check_index(seq_lens, "seq_lens", 1, query.device)
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"query has {num_seqs} sequences but block_tables {tuple(block_tables.shape)}, "
            f"seq_lens {tuple(seq_lens.shape)}"
        )
    _check_sinks(sinks, num_heads, query.device)
    partition = PARTITION_SIZE if partition_size is None else int(partition_size)
    block_n, options = decode_tiles(head_dim)
    if partition <= 0 or partition % block_n:
        raise ValueError(f"partition_size must be a positive multiple of {block_n}, got {partition}")
    max_tokens = block_tables.shape[1] * pools.block_size
    num_parts = max(1, -(-max_tokens // partition))
    direct = num_parts == 1

    g_pad = max(16, _next_pow2(group))  # tl.dot needs >= 16 rows
    d_pad = max(16, _next_pow2(head_dim))
    if direct:
        part_m = part_l = part_acc = out  # unused
    else:
        part_m = torch.empty((num_seqs, num_heads, num_parts), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_seqs, num_heads, num_parts, head_dim), dtype=torch.float32, device=query.device)
    flags = _feature_meta(sliding_window, softcap, sinks)
    window = int(sliding_window) if sliding_window is not None else 0
    cap = float(softcap) if softcap is not None else 1.0
    args = (
        query, *pools.data, *pools.side, block_tables, seq_lens, sinks, out, part_m, part_l, part_acc,
        float(scale), cap, window, num_heads, num_parts, partition,
        *query.stride(), *pools.data_strides, *pools.side_strides, block_tables.stride(0), *out.stride(),
    )
    meta = dict(
        GROUP=group, G_PAD=g_pad, HEAD_DIM=head_dim, D_PAD=d_pad, PADDED=head_dim < d_pad,
        BLOCK_SIZE=pools.block_size, BLOCK_N=block_n, FORMAT=KV_FORMAT_IDS[kv_format],
        DOT=dot_mode(query.dtype), DIRECT=direct, **flags,
    )
    launches = [Launch(k.decode, (num_seqs, pools.num_kv_heads, num_parts), args, meta, options)]
    if not direct:
        reduce_args = (part_m, part_l, part_acc, seq_lens, sinks, out, num_heads, num_parts, partition, *out.stride())
        reduce_meta = dict(
            HEAD_DIM=head_dim, D_PAD=d_pad, CHUNK=_REDUCE_CHUNK, USE_SINKS=sinks is not None
        )
        options = dict(num_warps=4, enable_fp_fusion=True)
        launches.append(Launch(k.reduce, (num_seqs, num_heads), reduce_args, reduce_meta, options))
    return launches


def decode_tiles(head_dim: int) -> tuple[int, dict]:
    """``(BLOCK_N, launch options)`` of the decode kernel for ``head_dim`` (module settings, which
    ``benchmarks/kernels.py --tune`` varies, up to 128; ``WIDE_HEAD_*`` above)."""
    if head_dim <= 128:
        return BLOCK_N, dict(DECODE_OPTIONS)
    return WIDE_HEAD_BLOCK_N, dict(WIDE_HEAD_DECODE_OPTIONS)


# ------------------------------------------------------------------------------------ shared launcher checks


class PoolOperands:
    """Validated pools of one launch: ``data`` (K, V codes; float8 as uint8 views), ``side`` (K/V scales and
    zeros, None where the format has none) and their strides."""

    def __init__(self, data, side, data_strides, side_strides, block_size, num_kv_heads) -> None:
        self.data, self.side = data, side
        self.data_strides, self.side_strides = data_strides, side_strides
        self.block_size, self.num_kv_heads = block_size, num_kv_heads


def check_pools(
    query, key_cache, value_cache, key_scale, value_scale, key_zero, value_zero, kv_format: str, head_dim: int
) -> PoolOperands:
    """Checks the pools against ``kv_format`` and ``head_dim`` (shapes, dtypes, strides, device)."""
    if kv_format not in KV_FORMAT_IDS:
        raise ValueError(f"kv_format={kv_format!r} is not one of {tuple(KV_FORMAT_IDS)}")
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
    block_size, num_kv_heads, dim = key_cache.shape[1:]
    if kv_format == "auto":
        if key_cache.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"kv_format='auto' needs a float32/float16/bfloat16 pool, got {key_cache.dtype}")
        expected_dim = head_dim
    else:
        if key_cache.dtype != kv_data_dtype(kv_format):
            raise ValueError(f"kv_format={kv_format!r} stores {kv_data_dtype(kv_format)}, got {key_cache.dtype}")
        expected_dim = kv_data_dim(kv_format, head_dim)
    if dim != expected_dim:
        raise ValueError(f"pools have last dim {dim}; kv_format={kv_format!r} with head_dim={head_dim} needs "
                         f"{expected_dim}")
    data = (key_cache, value_cache)
    if key_cache.dtype.is_floating_point and key_cache.element_size() == 1:  # float8: the kernels decode bits
        data = (key_cache.view(torch.uint8), value_cache.view(torch.uint8))

    side_names = ("key_scale", "value_scale", "key_zero", "value_zero")
    side = (key_scale, value_scale, key_zero, value_zero)
    needed = {"key_scale", "value_scale"} if kv_format != "auto" else set()
    if kv_format != "auto" and kv_has_zero(kv_format):
        needed |= {"key_zero", "value_zero"}
    present = [t for t in side if t is not None]
    for name, t in zip(side_names, side):
        if name in needed and t is None:
            raise ValueError(f"kv_format={kv_format!r} needs {name}")
        if name not in needed and t is not None:
            raise ValueError(f"kv_format={kv_format!r} takes no {name}")
        if t is None:
            continue
        if t.shape != key_cache.shape[:3] or t.dtype != torch.float16 or t.device != device:
            raise ValueError(
                f"{name} must be float16 {tuple(key_cache.shape[:3])} on {device}, got {t.dtype} "
                f"{tuple(t.shape)} on {t.device}"
            )
        if t.stride() != present[0].stride():
            raise ValueError(f"scale/zero pools must share strides, got {[p.stride() for p in present]}")
    side_strides = present[0].stride() if present else (0, 0, 0)
    return PoolOperands(data, side, key_cache.stride(), side_strides, block_size, num_kv_heads)


def _check_query(query: torch.Tensor, name: str) -> tuple[int, int, int]:
    if query.dim() != 3:
        raise ValueError(f"{name} must be [tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32/float16/bfloat16, got {query.dtype}")
    return tuple(query.shape)


def _check_index(t: torch.Tensor, name: str, dim: int, device) -> None:
    if t.dim() != dim or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a {dim}-d int32/int64 tensor, got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, query on {device}")


def _check_sinks(sinks, num_heads: int, device) -> None:
    if sinks is None:
        return
    if sinks.shape != (num_heads,) or not sinks.dtype.is_floating_point or sinks.device != device:
        raise ValueError(f"sinks must be a float [{num_heads}] tensor on {device}, got {sinks.dtype} "
                         f"{tuple(sinks.shape)} on {sinks.device}")


def _feature_meta(sliding_window, softcap, sinks) -> dict:
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


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# ----------------------------------------------------------------------------------------------- kernels
# Plain functions until ``_kernels()`` decorates them (their bodies read ``tl`` and the jitted helpers from this
# module's globals, which is where both triton's compiler and its interpreter look them up).

tl = None  # triton.language, bound by _kernels()
_STD_MAX = _STD_MIN = _STD_SUM = None  # triton's own combine functions (interpreter reductions)


def triton_interpreting() -> bool:
    """Whether triton runs kernels in its CPU interpreter (``TRITON_INTERPRET``, read as triton reads it)."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _kernels():
    """Imports triton and decorates this module's kernels (once, at the first launch).

    Compiled, every function the kernels call is ``triton.jit``-ed. Interpreted, the helpers stay plain Python
    (the interpreter re-patches ``triton.language`` on every call of a jitted function, ~10 ms each) and the
    reductions go to ``tl.reduce`` with triton's own combine functions, which the interpreter maps to numpy:
    this also works when triton was imported before ``TRITON_INTERPRET`` was set (then ``tl.max``, ``tl.sum``,
    ``tl.zeros``... are compiled-mode functions the interpreter cannot call; the kernels use none of them).
    """
    global tl, _STD_MAX, _STD_MIN, _STD_SUM
    global kv_columns, load_kv_codes, load_kv_side, dot, softcap_scores, row_max, row_min, row_sum
    global _decode_kernel, _decode_reduce_kernel
    import triton
    import triton.language as language

    tl = language
    if triton_interpreting():
        standard = language.standard
        combines = [getattr(standard, name, None) for name in ("_elementwise_max", "_elementwise_min", "_sum_combine")]
        if all(combines):
            _STD_MAX, _STD_MIN, _STD_SUM = combines
            row_max, row_min, row_sum = _interpreted_max, _interpreted_min, _interpreted_sum
        else:  # another triton layout: tl.max & co. (fine when triton was imported with TRITON_INTERPRET set)
            row_max, row_min, row_sum = _max, _min, _sum
    else:
        kv_columns = triton.jit(kv_columns)
        load_kv_codes, load_kv_side = triton.jit(load_kv_codes), triton.jit(load_kv_side)
        dot = triton.jit(dot)
        softcap_scores = triton.jit(softcap_scores)
        row_max, row_min, row_sum = triton.jit(_max), triton.jit(_min), triton.jit(_sum)
    _decode_kernel = jit_unspecialized(_decode_kernel, DECODE_NO_SPECIALIZE, ("BlockTables", "SeqLens"))
    _decode_reduce_kernel = jit_unspecialized(_decode_reduce_kernel, ("num_parts",), ("SeqLens",))
    return _Kernels(
        decode=_decode_kernel, reduce=_decode_reduce_kernel, kv_columns=kv_columns, load_kv_codes=load_kv_codes,
        load_kv_side=load_kv_side,
        dot=dot, softcap_scores=softcap_scores, row_max=row_max, row_min=row_min, row_sum=row_sum,
    )


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


class _Kernels:
    def __init__(self, **kernels) -> None:
        self.__dict__.update(kernels)


def _max(x, axis):
    return tl.max(x, axis)


def _min(x, axis):
    return tl.min(x, axis)


def _sum(x, axis):
    return tl.sum(x, axis)


def _interpreted_max(x, axis):
    return tl.reduce(x, axis, _STD_MAX)


def _interpreted_min(x, axis):
    return tl.reduce(x, axis, _STD_MIN)


def _interpreted_sum(x, axis):
    return tl.reduce(x, axis, _STD_SUM)


row_max = row_min = row_sum = None  # bound by _kernels()


def kv_columns(stride_cd, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, FORMAT: tl.constexpr):
    """The code columns of a token's row: element offsets and which are real. int4: ``D_PAD // 2`` bytes of two
    codes each (contiguous, so the loads vectorize; ``load_kv_codes`` interleaves the nibbles)."""
    if FORMAT == 4:
        c = tl.arange(0, D_PAD // 2)
        return c.to(tl.int64) * stride_cd, c < HEAD_DIM // 2
    else:
        c = tl.arange(0, D_PAD)
        return c.to(tl.int64) * stride_cd, c < HEAD_DIM


def load_kv_codes(Cache, row_off, valid, cols, col_ok, FORMAT: tl.constexpr, PADDED: tl.constexpr):
    """K or V codes of ``row_off.shape[0]`` tokens as ``[N, D_PAD]``: the pool's values for "auto", else the codes
    as float16 (int8, int4 nibbles) or float32 (float8 values); exact, also in bfloat16, the dtype the dots may
    take them in. Each token's scale (and int4 zero point, ``load_kv_side``) applies outside the dots:
    ``q . (c s + z) = (q . c) s + z sum(q)`` and ``sum_j p_j (c_j s_j + z_j) = sum_j (p_j s_j) c_j + sum_j p_j z_j``,
    so no dequantized float32 tile is built. ``row_off``: each token's element offset in the codes; ``valid``: which
    tokens to read (others give 0); ``cols, col_ok``: from ``kv_columns``; ``PADDED``: whether
    ``head_dim < D_PAD`` (else a row mask alone, so loads vectorize)."""
    if PADDED:
        mask = valid[:, None] & col_ok[None, :]
    else:
        mask = valid[:, None]
    raw = tl.load(Cache + (row_off[:, None] + cols[None, :]), mask=mask, other=0)
    if FORMAT == 4:  # int4: low nibble = even column, high nibble = odd column
        byte = raw.to(tl.int32)
        x = tl.reshape(tl.join((byte & 15).to(tl.float16), (byte >> 4).to(tl.float16)),
                       (raw.shape[0], 2 * raw.shape[1]))
    elif FORMAT == 2 or FORMAT == 3:  # float8 bits (uint8): the float16 of the same value (e4m3: scaled by 2^-8)
        bits = raw.to(tl.int32)
        if FORMAT == 2:  # e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits
            magnitude = ((bits & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        else:  # e5m2: the top byte of a float16
            magnitude = ((bits & 0x7F) << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        x = tl.where(bits >= 128, -magnitude, magnitude)  # float32: a float16 -> bfloat16 cast of e5m2 values
        # compiled for sm_90 into a long sequence that spilled (300-400 bytes per thread)
    elif FORMAT == 1:  # int8 (through float16: triton's interpreter converts integers to bfloat16 wrongly)
        x = raw.to(tl.float16)
    else:  # auto
        x = raw
    return x


def load_kv_side(Scale, Zero, side_off, valid, FORMAT: tl.constexpr):
    """Scale and zero point (int4; else 0) of each token, float32 ``[N]``, 0 for tokens not ``valid``."""
    s = tl.load(Scale + side_off, mask=valid, other=0.0).to(tl.float32)
    if FORMAT == 4:
        z = tl.load(Zero + side_off, mask=valid, other=0.0).to(tl.float32)
    else:
        z = s * 0.0
    return s, z


def dot(a, b, DOT: tl.constexpr):
    """``a @ b`` with float32 accumulation; ``DOT``: see ``dot_mode``."""
    if DOT == 1:
        return tl.dot(a, b, input_precision="ieee")
    elif DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


def softcap_scores(s, cap):
    """``tanh(s / cap) * cap`` (tanh from exp: the interpreter has no libdevice)."""
    t = s / cap
    e = tl.exp(-2.0 * tl.abs(t))
    th = (1.0 - e) / (1.0 + e)
    return tl.where(t < 0, -th, th) * cap


def _decode_kernel(
    Q, KC, VC, KS, VS, KZ, VZ, BlockTables, SeqLens, Sinks, Out, PartM, PartL, PartAcc,
    scale, softcap, window, num_heads, num_parts, partition,
    stride_qs, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_sb, stride_so, stride_sh,
    stride_bt,
    stride_os, stride_oh, stride_od,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, FORMAT: tl.constexpr,
    DOT: tl.constexpr, DIRECT: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
):
    """One (sequence, KV head, partition): the GROUP query heads of the KV head against the partition's tokens."""
    # Index math in int64: no overflow on large pools (and the interpreter skips its int32 overflow checks).
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(SeqLens + seq).to(tl.int64)
    start = part * partition
    if not DIRECT:
        if start >= seq_len:  # a partition past the sequence: the reduce reads none of its partials
            return
    end = tl.minimum(start + partition, seq_len)
    lo = start
    if USE_WINDOW:  # the query (position seq_len - 1) sees keys > seq_len - 1 - window
        lo = tl.maximum(lo, seq_len - window)

    g = tl.arange(0, G_PAD)
    heads = kv_head * GROUP + g  # [G_PAD] int64
    row_ok = g < GROUP
    d = tl.arange(0, D_PAD).to(tl.int64)
    d_ok = d < HEAD_DIM
    q = tl.load(
        Q + (seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd),
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if DOT == 1:
        q = q.to(tl.float32)
    if FORMAT == 4:  # the zero point's share of each score: z * sum(q)
        q_sum = row_sum(q.to(tl.float32), 1)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.full([G_PAD], 0.0, tl.float32)
    acc = tl.full([G_PAD, D_PAD], 0.0, tl.float32)
    table = BlockTables + seq * stride_bt
    cols, col_ok = kv_columns(stride_cd, HEAD_DIM, D_PAD, FORMAT)
    head_off = kv_head * stride_ch
    head_side_off = kv_head * stride_sh
    n = tl.arange(0, BLOCK_N).to(tl.int64)
    for tile in range((lo // BLOCK_N) * BLOCK_N, end, BLOCK_N):
        pos = tile + n
        valid = (pos >= lo) & (pos < end)
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        row_off = block * stride_cb + offset * stride_co + head_off
        side_off = block * stride_sb + offset * stride_so + head_side_off
        k = load_kv_codes(KC, row_off, valid, cols, col_ok, FORMAT, PADDED).to(q.dtype)
        s = dot(q, tl.trans(k), DOT)
        if FORMAT != 0:
            k_scale, k_zero = load_kv_side(KS, KZ, side_off, valid, FORMAT)
            s = s * k_scale[None, :]
            if FORMAT == 4:
                s = s + q_sum[:, None] * k_zero[None, :]
        s = s * scale
        if USE_SOFTCAP:
            s = softcap_scores(s, softcap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, row_max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + row_sum(p, 1)
        v = load_kv_codes(VC, row_off, valid, cols, col_ok, FORMAT, PADDED).to(q.dtype)
        if FORMAT == 0:
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT)
        else:
            v_scale, v_zero = load_kv_side(VS, VZ, side_off, valid, FORMAT)
            if v.dtype == tl.float16:  # p * s / top in [0, 1], top a power of two >= max(s): no float16 underflow
                top = tl.exp2(tl.ceil(tl.log2(tl.maximum(row_max(v_scale, 0), 5.9604644775390625e-08))))
                acc = (acc * (alpha / top)[:, None] + dot((p * (v_scale / top)[None, :]).to(v.dtype), v, DOT)) * top
            else:  # bfloat16 (float32's range), float32
                acc = acc * alpha[:, None] + dot((p * v_scale[None, :]).to(v.dtype), v, DOT)
            if FORMAT == 4:
                acc = acc + row_sum(p * v_zero[None, :], 1)[:, None]
        m_i = m_new

    if DIRECT:
        if USE_SINKS:  # the sink is one more logit of each head's softmax
            sink = tl.load(Sinks + heads, mask=row_ok, other=0.0).to(tl.float32)
            m_all = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_all)
            l_i = l_i * alpha + tl.exp(sink - m_all)
            acc = acc * alpha[:, None]
        out = acc / tl.maximum(l_i, 1.1754943508222875e-38)[:, None]
        tl.store(
            Out + (seq * stride_os + heads[:, None] * stride_oh + d[None, :] * stride_od),
            out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        part_row = (seq * num_heads + heads) * num_parts + part  # [G_PAD]: row (seq, head, part) of the partials
        tl.store(PartM + part_row, m_i, mask=row_ok)
        tl.store(PartL + part_row, l_i, mask=row_ok)
        tl.store(PartAcc + (part_row[:, None] * HEAD_DIM + d[None, :]), acc, mask=row_ok[:, None] & d_ok[None, :])


def _decode_reduce_kernel(
    PartM, PartL, PartAcc, SeqLens, Sinks, Out, num_heads, num_parts, partition,
    stride_os, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CHUNK: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    """Merges the partitions of one (sequence, query head): rescale each partial to the global max, sum."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(SeqLens + seq).to(tl.int64)
    used = tl.minimum((seq_len + partition - 1) // partition, num_parts)  # later partitions hold no token
    base = (seq * num_heads + head) * num_parts
    d = tl.arange(0, D_PAD).to(tl.int64)
    d_ok = d < HEAD_DIM
    c = tl.arange(0, CHUNK).to(tl.int64)
    m_all = row_max(tl.full([CHUNK], float("-inf"), tl.float32), 0)
    l_all = row_sum(tl.full([CHUNK], 0.0, tl.float32), 0)
    acc = tl.full([D_PAD], 0.0, tl.float32)
    for first in range(0, used, CHUNK):
        rows = base + first + c
        ok = first + c < used
        pm = tl.load(PartM + rows, mask=ok, other=float("-inf"))
        pl = tl.load(PartL + rows, mask=ok, other=0.0)
        pa = tl.load(PartAcc + (rows[:, None] * HEAD_DIM + d[None, :]), mask=ok[:, None] & d_ok[None, :], other=0.0)
        m_new = tl.maximum(m_all, row_max(pm, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(pm - m_safe)
        alpha = tl.exp(m_all - m_safe)
        l_all = l_all * alpha + row_sum(pl * w, 0)
        acc = acc * alpha + row_sum(pa * w[:, None], 0)
        m_all = m_new
    if USE_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32)
        m_fin = tl.maximum(m_all, sink)
        alpha = tl.exp(m_all - m_fin)
        l_all = l_all * alpha + tl.exp(sink - m_fin)
        acc = acc * alpha
    out = acc / tl.maximum(l_all, 1.1754943508222875e-38)
    tl.store(Out + (seq * stride_os + head * stride_oh + d * stride_od), out.to(Out.dtype.element_ty), mask=d_ok)
