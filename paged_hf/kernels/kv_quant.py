"""Quantized KV formats: torch reference math on raw tensors (the CPU path and the oracle for GPU kernels).

Two granularities (which format uses which: ``kv_format.KVFormat``):

- per vector (``quantize_kv_ref``: int8, fp8): one scale per ``[head_dim]`` vector, i.e. per token per KV head.
  The bytes of a vector depend only on that vector's own values.
- per block (int4: ``quantize_channels_ref`` for keys, ``quantize_block_values_ref`` for values): side data shared
  by a block's tokens of one KV head. The bytes of a block depend only on that block's own tokens: the store
  quantizes a block once, when it is full (``kv_format.KVFormat.tail``), so the same tokens still give the same
  bytes.

Either way the same tokens always give the same bytes, whatever batch or slot they were written with, so prefix-
cache hits and recomputation agree bit for bit.

Formats (``q`` = stored code, ``s`` = float16 scale, ``absmax = max |x|`` over the group):

- ``int8``: symmetric, ``s = absmax / 127``, ``x ~ q * s`` with ``q`` in ``[-127, 127]``. Error <= ``s / 2`` =
  ``absmax / 254`` (0.39%; plus up to 2^-25 absolute once ``s`` is a subnormal float16, ``absmax`` < 0.0078).
  Asymmetric int8 (scale + zero) was measured: 1.1x (Gaussian) to 1.5x (post-RoPE keys of stories260K) lower
  mean error, but it costs 2 more bytes per vector, so int8 would save 1.88x instead of 1.94x over fp16 at
  head_dim 64, and symmetric already keeps every vector within 0.4% of its absmax.
- ``fp8_e4m3`` / ``fp8_e5m2``: ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` codes, ``s = absmax / finfo.max``
  (so no code overflows), ``x ~ q * s``. Error per element <= 2^-4 (e4m3) / 2^-3 (e5m2) of ``|x|`` plus a subnormal
  floor (2^-10 * s resp. 2^-17 * s). Relative to ``absmax``: <= 1/28 (3.6%) resp. 1/14 (7.1%) while ``s`` is a
  normal float16 (``absmax`` >= 0.027 resp. 3.5), at worst 1/16 resp. 1/8 (a subnormal ``s`` rounded up leaves
  ``absmax / s`` below the top binade).
- ``int4`` keys (``quantize_channels_ref``), per channel ``c`` over a block's tokens, asymmetric, on a grid of the
  (block, KV head): ``base = down(min_c mn_c)``, ``step = up((max_c mx_c - base) / 255)`` (float16; ``mn_c``,
  ``mx_c``: the channel's min and max over the tokens); 8-bit range codes ``u_lo = floor((mn_c - base) / step)``,
  ``u_hi = ceil((mx_c - base) / step)`` (one more step outwards where float32 rounding left ``mn_c`` or ``mx_c``
  outside; both 0 when ``step == 0``), ``lo_c = base + step u_lo``, ``hi_c = base + step u_hi``, ``s_c = (hi_c -
  lo_c) / 15``; ``q = round((x - lo_c) / s_c)`` in ``[0, 15]``, ``x ~ lo_c + s_c q``. Every value lies in ``[lo_c,
  hi_c]`` (``base`` and ``step`` rounded outwards, the range codes too), so the error is <= ``s_c / 2`` (plus
  float32 rounding) = ``(mx_c - mn_c + 2 step) / 30``: the range stretches by at most a grid step (1/255 of the
  block's range) on each side. The codes: two per uint8, even channel in the low nibble.
- ``int4`` values (``quantize_block_values_ref``), per token, symmetric, 4-bit log-scale codes: ``vmax = up(max |x|
  / 7)`` over the block's tokens and channels (float16); candidate scales ``s_k = vmax * 2^(-k/3)``, ``k = 0 ..
  15`` (``VALUE_SCALE_STEPS``, float32); each token takes the ``k`` whose codes ``q = clamp(round(x / s_k), -8,
  7)`` give the least squared error ``sum_d (q s_k - x)^2`` (ties: the smallest ``k``), stored as ``q + 8`` in
  ``[0, 15]``; ``x ~ (code - 8) s_k``. ``k = 0`` clips nothing (``7 vmax >= max |x|``), so a token's squared error
  is never above that of the block's absmax scale, ``<= D (vmax / 2)^2`` (a smaller scale may clip an outlier
  channel when that lowers the token's total); a token much smaller than the block's largest gets a scale down to
  ``vmax / 32``. The squared errors are summed exactly, as integers (each term ``((q
  s_k - x) / vmax)^2 * 2^32`` truncated), so the choice does not depend on the order of a sum (the Triton fill
  reproduces it bit for bit).

Rounding of the float16 side data: zero points and ``base`` are rounded down, scales, ``step`` and ``vmax`` up to
the next float16, so every code lies in range and no value is cut at the edges (also with subnormal scales; the
clamps only absorb float32 rounding). A zero scale only comes with a group whose values all equal its zero point
(symmetric formats: all zero), which dequantizes exactly, with no NaN; all-zero bytes (a fresh pool slot)
dequantize to 0 in every format. Inputs must be finite; magnitudes beyond the float16 range of the side data
(``|x| > 65504 * qmax``; int4: ``|x| > 65504`` for keys, ``> 7 * 65504`` for values) saturate.
"""

from __future__ import annotations

import struct

import torch

from .kv_format import QUANTIZED_KV_FORMATS, kv_format as _kv_format

__all__ = ["QUANTIZED_KV_FORMATS", "quantize_kv_ref", "dequantize_kv_ref", "quantize_channels_ref",
           "dequantize_channels_ref", "quantize_block_values_ref", "dequantize_block_values_ref", "key_ranges_ref",
           "value_scales_ref", "pack_int4", "unpack_int4", "unpack_int4_float", "VALUE_SCALE_STEPS"]

_HALF_MAX = torch.finfo(torch.float16).max
_INT8_MAX = 127
_INT4_LEVELS = 15
_GRID_LEVELS = 255  # int4 key range codes: 8 bits on the (block, head) grid
_VALUE_LEVELS = 7  # int4 values: q in [-8, 7], vmax = up(absmax / 7)
_ERROR_UNIT = 4294967296.0  # 2^32: int4 value errors ((q s - x) / vmax)^2 summed as integers of this unit


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


# 2^(-1/3), 2^(-2/3) rounded to float32; the Triton fill and attention use the same constants (``_rounding``).
CUBE_ROOT_HALF, CUBE_ROOT_QUARTER = _float32(2.0 ** (-1 / 3)), _float32(2.0 ** (-2 / 3))
# s_k / vmax = 2^(-k/3) as float32: a cube root of 1/2^(k % 3) times 2^-(k // 3) (exact), k = 0 .. 15.
VALUE_SCALE_STEPS = torch.tensor([(1.0, CUBE_ROOT_HALF, CUBE_ROOT_QUARTER)[k % 3] * 2.0 ** -(k // 3)
                                  for k in range(16)], dtype=torch.float32)


def kv_data_dtype(kv_format: str) -> torch.dtype:
    """Torch dtype of the stored codes of ``kv_format`` (uint8 for int4: two codes per byte)."""
    fmt = _kv_format(kv_format)
    if not fmt.quantized:
        raise ValueError(f"kv_format={kv_format!r} is not one of {QUANTIZED_KV_FORMATS}")
    return fmt.code_dtype()


def _half_up(x: torch.Tensor) -> torch.Tensor:
    """Smallest float16 >= ``x`` (float32, >= 0), capped at the float16 max."""
    if torch.compiler.is_compiling():
        return _half_grid(x.clamp(max=_HALF_MAX), up=True).half()
    half = x.clamp(max=_HALF_MAX).half()
    up = torch.nextafter(half, torch.full_like(half, float("inf"))).clamp(max=_HALF_MAX)
    return torch.where(half.float() < x, up, half)


def _half_down(x: torch.Tensor) -> torch.Tensor:
    """Largest float16 <= ``x`` (float32), saturated at +-float16 max."""
    x = x.clamp(-_HALF_MAX, _HALF_MAX)
    if torch.compiler.is_compiling():
        size = x.abs()  # a negative x rounds away from 0; the sign is x's own (so -0 stays -0)
        return torch.copysign(torch.where(x < 0, _half_grid(size, up=True), _half_grid(size, up=False)), x).half()
    half = x.half()
    down = torch.nextafter(half, torch.full_like(half, float("-inf"))).clamp(min=-_HALF_MAX)
    return torch.where(half.float() > x, down, half)


# float16's grid within float32: 13 fewer mantissa bits at normal values, a step of 2^-24 below its smallest normal
_HALF_LOW_BITS = (1 << 13) - 1
_HALF_SMALLEST_NORMAL = 2.0**-14
_HALF_SUBNORMAL_STEPS = 2.0**24


def _half_grid(x: torch.Tensor, up: bool) -> torch.Tensor:
    """``x`` (float32, 0 <= x <= float16 max) rounded up or down to a float16 value, still in float32 (its
    ``.half()`` is then exact): ``_half_up`` / ``_half_down`` where dynamo traces. Integer and power-of-two
    arithmetic, no float16 round trip: inductor computes a ``.half().float()`` in float32 without rounding (unless
    told to emulate the casts), which made a compiled store's scales round to nearest instead of up. Eagerly the
    round trip is exact and twice as fast (18 against 36 us a call)."""
    bits = x.view(torch.int32)
    normal = ((bits + _HALF_LOW_BITS) if up else bits) & ~_HALF_LOW_BITS
    steps = x * _HALF_SUBNORMAL_STEPS  # exact: a power of two
    subnormal = (torch.ceil(steps) if up else torch.floor(steps)) / _HALF_SUBNORMAL_STEPS
    return torch.where(x >= _HALF_SMALLEST_NORMAL, normal.view(torch.float32), subnormal)


def _safe_div(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` with a zero scale giving 0 (the vector is constant, so ``x`` is 0 there)."""
    return x / torch.where(scale == 0, torch.ones_like(scale), scale)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` codes in ``[0, 15]`` -> ``[..., D // 2]`` uint8, element ``2i`` in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``[..., D // 2]`` uint8 -> ``[..., D]`` uint8 codes (inverse of ``pack_int4``)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def unpack_int4_float(packed: torch.Tensor) -> torch.Tensor:
    """``[..., D // 2]`` uint8 -> ``[..., D]`` float32 codes: ``unpack_int4(packed).float()`` in fewer passes (the
    hot read of the torch path: each nibble is cast straight into its place)."""
    out = torch.empty((*packed.shape, 2), dtype=torch.float32, device=packed.device)
    out[..., 0] = packed & 0xF
    out[..., 1] = packed >> 4
    return out.flatten(-2)


def _per_vector_format(kv_format: str) -> torch.dtype:
    """The code dtype of a per-vector format (int8, fp8); ValueError for int4, which quantizes whole blocks."""
    if kv_format == "int4":
        raise ValueError("int4 quantizes whole blocks: quantize_channels_ref (keys) and quantize_block_values_ref "
                         "(values), not per vector")
    return kv_data_dtype(kv_format)


def quantize_kv_ref(
    x: torch.Tensor, kv_format: str
) -> tuple[torch.Tensor, torch.Tensor, None]:
    """Quantizes ``x`` ``[..., D]`` (float, finite; ``[n, H, D]`` in the cache) one ``[D]`` vector at a time (int8,
    fp8; int4 quantizes blocks: see the module docstring).

    Returns ``(data, scale, None)``: ``data`` ``[..., D]`` int8 / float8; ``scale`` ``[...]`` float16; no zero point.
    Computed in float32.
    """
    data_dtype = _per_vector_format(kv_format)
    x = x.float()
    absmax = x.abs().amax(-1)
    if kv_format == "int8":
        scale = _half_up(absmax / _INT8_MAX)
        codes = torch.round(_safe_div(x, scale.float().unsqueeze(-1)))
        return codes.clamp(-_INT8_MAX, _INT8_MAX).to(data_dtype), scale, None
    fp8_max = torch.finfo(data_dtype).max
    scale = _half_up(absmax / fp8_max)
    codes = _safe_div(x, scale.float().unsqueeze(-1)).clamp(-fp8_max, fp8_max)
    return codes.to(data_dtype), scale, None


def dequantize_kv_ref(
    data: torch.Tensor,
    scale: torch.Tensor,
    zero: None,
    kv_format: str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``quantize_kv_ref`` on any leading shape ``S``: ``data`` ``[*S, D]``, ``scale`` ``[*S]`` (``zero``:
    None, kept for the call shape). Returns ``[*S, D]`` in ``dtype``; computed in float32."""
    _per_vector_format(kv_format)  # validates the name
    if zero is not None:
        raise ValueError(f"kv_format={kv_format!r} is symmetric: it takes no zero point")
    return (data.float() * scale.float().unsqueeze(-1)).to(dtype)


def _check_int4_block(x: torch.Tensor) -> None:
    if x.dim() < 3:
        raise ValueError(f"int4 quantizes blocks [..., T, H, D], got {tuple(x.shape)}")
    if x.shape[-1] % 2:
        raise ValueError(f"int4 packs two values per byte: head_dim must be even, got head_dim={x.shape[-1]}")


def key_ranges_ref(range_codes: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 keys: ``(lo, s)`` float32 ``[..., H, D]`` of each channel from its range codes ``[..., H, 2, D]`` uint8
    and the grid ``[..., H, 2]`` float16 (``lo = base + step u_lo``, ``s = (base + step u_hi - lo) / 15``: the
    float32 operations the Triton fill repeats)."""
    base = grid[..., 0].float().unsqueeze(-1)
    step = grid[..., 1].float().unsqueeze(-1)
    lo = base + step * range_codes[..., 0, :].float()
    hi = base + step * range_codes[..., 1, :].float()
    return lo, (hi - lo) / _INT4_LEVELS


def quantize_channels_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 keys: ``x`` ``[..., T, H, D]`` (float, finite: a block's ``T`` tokens) quantized per ``(h, d)`` channel
    over the ``T`` tokens, on a grid per ``h`` (see the module docstring).

    Returns ``(codes [..., T, H, D // 2] uint8, range_codes [..., H, 2, D] uint8, grid [..., H, 2] float16)``: the
    codes packed along ``D`` (channel ``2i`` in the low nibble), ``range_codes[..., 0, :]`` = ``u_lo``, ``[..., 1,
    :]`` = ``u_hi``, ``grid[..., 0]`` = ``base``, ``grid[..., 1]`` = ``step``. Computed in float32.
    """
    _check_int4_block(x)
    x = x.float()
    lowest, highest = x.amin(-3), x.amax(-3)  # [..., H, D]
    base = _half_down(lowest.amin(-1))  # [..., H]
    step = _half_up((highest.amax(-1) - base.float()) / _GRID_LEVELS)
    b, st = base.float().unsqueeze(-1), step.float().unsqueeze(-1)
    flat = st == 0
    u_lo = torch.floor(_safe_div(lowest - b, st)).clamp(0, _GRID_LEVELS)
    u_hi = torch.ceil(_safe_div(highest - b, st)).clamp(0, _GRID_LEVELS)
    # one step outwards where float32 rounding (of the quotient, or of base + step u) left the extreme outside
    u_lo = torch.where((b + st * u_lo > lowest) & (u_lo > 0), u_lo - 1, u_lo)
    u_hi = torch.where((b + st * u_hi < highest) & (u_hi < _GRID_LEVELS), u_hi + 1, u_hi)
    u_lo, u_hi = torch.where(flat, 0.0, u_lo), torch.where(flat, 0.0, u_hi)
    range_codes = torch.stack((u_lo, u_hi), dim=-2).to(torch.uint8)
    grid = torch.stack((base, step), dim=-1)
    lo, scale = key_ranges_ref(range_codes, grid)
    lo, scale = lo.unsqueeze(-3), scale.unsqueeze(-3)
    codes = torch.round(_safe_div(x - lo, scale)).clamp(0, _INT4_LEVELS)
    codes = torch.where(scale == 0, 0.0, codes)
    return pack_int4(codes), range_codes.contiguous(), grid.contiguous()


def dequantize_channels_ref(codes: torch.Tensor, range_codes: torch.Tensor, grid: torch.Tensor,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_channels_ref``: ``codes [..., T, H, D // 2]``, ``range_codes [..., H, 2, D]``, ``grid
    [..., H, 2]`` -> ``[..., T, H, D]`` in ``dtype`` (float32 math: ``lo + s * q``)."""
    lo, scale = key_ranges_ref(range_codes, grid)
    # a multiply, then an add: ``addcmul`` may fuse them (one rounding) in its vectorized body and not in its
    # remainder, so a value's bits would follow the batch's size (a prefix hit and a miss would then differ)
    return (unpack_int4_float(codes).mul_(scale.unsqueeze(-3)).add_(lo.unsqueeze(-3))).to(dtype)


def value_scales_ref(scale_codes: torch.Tensor, vmax: torch.Tensor) -> torch.Tensor:
    """int4 values: the float32 scales ``vmax * VALUE_SCALE_STEPS[k]`` of unpacked scale codes ``k`` ``[*S]`` (any
    integer dtype) with ``vmax`` broadcastable to ``[*S]`` (float16)."""
    return vmax.float() * VALUE_SCALE_STEPS.to(scale_codes.device)[scale_codes.long()]


def quantize_block_values_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 values: ``x`` ``[..., T, H, D]`` (float, finite: a block's ``T`` tokens, ``T`` even) quantized per token
    with a 4-bit log-scale code on the block's ``vmax`` per ``h`` (see the module docstring).

    Returns ``(codes [..., T, H, D // 2] uint8, scale_codes [..., H, T // 2] uint8, vmax [..., H] float16)``: the
    codes (``q + 8``) packed along ``D`` (channel ``2i`` in the low nibble), the scale codes along ``T`` (token
    ``2i`` in the low nibble). Computed in float32.
    """
    _check_int4_block(x)
    if x.shape[-3] % 2:
        raise ValueError(f"int4 packs two value scale codes per byte: the block's tokens must be even, got "
                         f"{x.shape[-3]}")
    x = x.float()
    vmax = _half_up(x.abs().amax(dim=(-3, -1)) / _VALUE_LEVELS)  # [..., H]
    v = vmax.float()
    scales = v.unsqueeze(-1) * VALUE_SCALE_STEPS.to(x.device)  # [..., H, 16]
    unit = torch.where(v == 0, 1.0, v).unsqueeze(-2).unsqueeze(-1)  # [..., 1, H, 1]
    search = _best_value_scales if torch.compiler.is_compiling() else _scan_value_scales
    best, best_q = search(x, scales, unit)
    codes = best_q + (_VALUE_LEVELS + 1)
    scale_codes = pack_int4(best.transpose(-1, -2))  # [..., H, T // 2]
    return pack_int4(codes), scale_codes.contiguous(), vmax.contiguous()


def _scan_value_scales(x: torch.Tensor, scales: torch.Tensor, unit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_block_values_ref``'s search, eagerly: each token's scale ``[..., T, H]`` (of the 16 steps
    ``scales [..., H, 16]``) with the least error, and its codes ``q [..., T, H, D]``, one scale at a time (a 16x
    smaller working set than all at once)."""
    best = best_q = best_error = None
    for k in range(scales.shape[-1]):
        scale = scales[..., k].unsqueeze(-2).unsqueeze(-1)  # [..., 1, H, 1]
        q = torch.round(_safe_div(x, scale)).clamp(-_VALUE_LEVELS - 1, _VALUE_LEVELS)  # [..., T, H, D]
        error = (q * scale - x) / unit
        error = (error * error * _ERROR_UNIT).to(torch.int64).sum(-1)  # [..., T, H], exact
        if best is None:
            best, best_q, best_error = torch.zeros_like(error), q, error
        else:  # strictly lower: of equal errors the first (smallest k) stays
            lower = error < best_error
            best = torch.where(lower, k, best)
            best_q = torch.where(lower.unsqueeze(-1), q, best_q)
            best_error = torch.where(lower, error, best_error)
    return best, best_q


def _best_value_scales(x: torch.Tensor, scales: torch.Tensor, unit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_scan_value_scales`` as one tensor expression, for a compiled graph (the eager loop over 16 scales unrolls
    there into one fused kernel per layer that inductor takes minutes to generate): the errors of all scales
    ``[..., 16, T, H]`` at once, the first smallest (``argmin``, as the loop's strict ``<``), and the codes of that
    scale computed again by the loop's own operations. Returns ``(best [..., T, H] int64, q [..., T, H, D])``, bit
    for bit the loop's."""
    every = scales.transpose(-1, -2).unsqueeze(-2).unsqueeze(-1)  # [..., 16, 1, H, 1]
    q = torch.round(_safe_div(x.unsqueeze(-4), every)).clamp(-_VALUE_LEVELS - 1, _VALUE_LEVELS)
    error = (q * every - x.unsqueeze(-4)) / unit.unsqueeze(-4)
    best = (error * error * _ERROR_UNIT).to(torch.int64).sum(-1).argmin(-3)  # [..., T, H]
    scale = scales.unsqueeze(-3).expand(*best.shape, scales.shape[-1]).gather(-1, best.unsqueeze(-1))  # [..., T, H, 1]
    return best, torch.round(_safe_div(x, scale)).clamp(-_VALUE_LEVELS - 1, _VALUE_LEVELS)


def dequantize_block_values_ref(codes: torch.Tensor, scale_codes: torch.Tensor, vmax: torch.Tensor,
                                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_block_values_ref``: ``codes [..., T, H, D // 2]``, ``scale_codes [..., H, T // 2]``,
    ``vmax [..., H]`` -> ``[..., T, H, D]`` in ``dtype`` (float32 math: ``(code - 8) * s``)."""
    scale = value_scales_ref(unpack_int4(scale_codes), vmax.unsqueeze(-1)).transpose(-1, -2)  # [..., T, H]
    return unpack_int4_float(codes).sub_(_VALUE_LEVELS + 1).mul_(scale.unsqueeze(-1)).to(dtype)
