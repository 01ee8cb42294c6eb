"""Quantized KV formats: torch reference math on raw tensors (the CPU path and the oracle for GPU kernels).

Two granularities (which format uses which: ``kv_format.KVFormat``):

- per vector (``quantize_kv_ref``): one scale (and, for int4, one zero point) per ``[head_dim]`` vector, i.e. per
  token per KV head. The bytes of a vector depend only on that vector's own values.
- per channel (``quantize_channels_ref``, int4 keys): one scale and zero point per channel of a KV head over a
  block's tokens. The bytes of a block depend only on that block's own tokens: the store quantizes a block once,
  when it is full (``kv_format.KVFormat.tail``), so the same tokens still give the same bytes.

Either way the same tokens always give the same bytes, whatever batch or slot they were written with, so prefix-
cache hits and recomputation agree bit for bit.

Formats (``q`` = stored code, ``s``/``z`` = float16 scale/zero, ``absmax = max |x|`` over the group):

- ``int8``: symmetric, ``s = absmax / 127``, ``x ~ q * s`` with ``q`` in ``[-127, 127]``. Error <= ``s / 2`` =
  ``absmax / 254`` (0.39%; plus up to 2^-25 absolute once ``s`` is a subnormal float16, ``absmax`` < 0.0078).
  Asymmetric int8 (scale + zero) was measured: 1.1x (Gaussian) to 1.5x (post-RoPE keys of stories260K) lower
  mean error, but it costs 2 more bytes per vector, so int8 would save 1.88x instead of 1.94x over fp16 at
  head_dim 64, and symmetric already keeps every vector within 0.4% of its absmax.
- ``int4``: asymmetric (LMDeploy style), ``z = min``, ``s = (max - min) / 15``, ``x ~ q * s + z`` with ``q`` in
  ``[0, 15]``, the min and max taken over the group (a vector, or a channel over a block); two codes per uint8,
  even index (vectors: even channel) in the low nibble. Error <= ``(max - min) / 30`` <= ``absmax / 15`` (6.7%).
  Measured: 1.2x (Gaussian) to 1.8x (one-sided data; 1.5-1.7x on stories260K K/V) lower mean error than
  symmetric int4 (``[-7, 7]``), which spends half its levels on the side a vector does not use.
- ``fp8_e4m3`` / ``fp8_e5m2``: ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` codes, ``s = absmax / finfo.max``
  (so no code overflows), ``x ~ q * s``. Error per element <= 2^-4 (e4m3) / 2^-3 (e5m2) of ``|x|`` plus a subnormal
  floor (2^-10 * s resp. 2^-17 * s). Relative to ``absmax``: <= 1/28 (3.6%) resp. 1/14 (7.1%) while ``s`` is a
  normal float16 (``absmax`` >= 0.027 resp. 3.5), at worst 1/16 resp. 1/8 (a subnormal ``s`` rounded up leaves
  ``absmax / s`` below the top binade).

Rounding of the float16 side data: the zero point is rounded down and the scale up to the next float16, so
every code lies in range and no value is cut at the edges (also with subnormal scales; the clamps only absorb
float32 rounding). ``s == 0`` only for a group whose values all equal ``z`` (symmetric formats: all zero), which
dequantizes exactly, with no NaN; all-zero bytes (a fresh pool slot) dequantize to 0 in every format.
Inputs must be finite; magnitudes beyond the float16 range of the side data (``|x| > 65504 * qmax``, or
``|min| > 65504`` for int4) saturate.
"""

from __future__ import annotations

import torch

from .kv_format import QUANTIZED_KV_FORMATS, kv_format as _kv_format

__all__ = ["QUANTIZED_KV_FORMATS", "quantize_kv_ref", "dequantize_kv_ref", "quantize_channels_ref",
           "dequantize_channels_ref", "pack_int4", "unpack_int4"]

_HALF_MAX = torch.finfo(torch.float16).max
_INT8_MAX = 127
_INT4_LEVELS = 15


def kv_data_dtype(kv_format: str) -> torch.dtype:
    """Torch dtype of the stored codes of ``kv_format`` (uint8 for int4: two codes per byte)."""
    fmt = _kv_format(kv_format)
    if not fmt.quantized:
        raise ValueError(f"kv_format={kv_format!r} is not one of {QUANTIZED_KV_FORMATS}")
    return fmt.code_dtype()


def _half_up(x: torch.Tensor) -> torch.Tensor:
    """Smallest float16 >= ``x`` (float32, >= 0), capped at the float16 max."""
    half = x.clamp(max=_HALF_MAX).half()
    up = torch.nextafter(half, torch.full_like(half, float("inf"))).clamp(max=_HALF_MAX)
    return torch.where(half.float() < x, up, half)


def _half_down(x: torch.Tensor) -> torch.Tensor:
    """Largest float16 <= ``x`` (float32), saturated at +-float16 max."""
    half = x.clamp(-_HALF_MAX, _HALF_MAX).half()
    down = torch.nextafter(half, torch.full_like(half, float("-inf"))).clamp(min=-_HALF_MAX)
    return torch.where(half.float() > x, down, half)


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


def quantize_kv_ref(
    x: torch.Tensor, kv_format: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantizes ``x`` ``[..., D]`` (float, finite; ``[n, H, D]`` in the cache) one ``[D]`` vector at a time.

    Returns ``(data, scale, zero)``: ``data`` ``[..., D]`` int8 / float8, or ``[..., D // 2]`` uint8 for int4;
    ``scale`` ``[...]`` float16; ``zero`` ``[...]`` float16 for int4, else None. Computed in float32.
    """
    data_dtype = kv_data_dtype(kv_format)
    x = x.float()
    if kv_format == "int4":
        if x.shape[-1] % 2:
            raise ValueError(f"int4 packs two values per byte: head_dim must be even, got head_dim={x.shape[-1]}")
        zero = _half_down(x.amin(-1))
        scale = _half_up((x.amax(-1) - zero.float()) / _INT4_LEVELS)
        codes = torch.round(_safe_div(x - zero.float().unsqueeze(-1), scale.float().unsqueeze(-1)))
        return pack_int4(codes.clamp(0, _INT4_LEVELS)), scale, zero
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
    zero: torch.Tensor | None,
    kv_format: str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``quantize_kv_ref`` on any leading shape ``S``.

    ``data`` ``[*S, Dp]`` (``Dp = D // 2`` for int4, else ``D``), ``scale`` (and ``zero`` for int4) ``[*S]``.
    Returns ``[*S, D]`` in ``dtype``; computed in float32.
    """
    if kv_format == "int4":
        if zero is None:
            raise ValueError("int4 needs a zero point: got zero=None")
        codes = unpack_int4(data).float()
        return (codes * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).to(dtype)
    kv_data_dtype(kv_format)  # validates the name
    return (data.float() * scale.float().unsqueeze(-1)).to(dtype)


def quantize_channels_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 per channel: ``x`` ``[..., T, H, D]`` (float, finite: a block's ``T`` tokens) quantized with one scale and
    zero point per ``(h, d)`` over the ``T`` tokens; the same asymmetric math as ``quantize_kv_ref(.., "int4")``
    along the token axis.

    Returns ``(codes [..., T, H, D // 2] uint8, scale [..., H, D] float16, zero [..., H, D] float16)``; codes are packed
    along ``D`` as for vectors (channel ``2i`` in the low nibble). Computed in float32.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"int4 packs two values per byte: head_dim must be even, got head_dim={x.shape[-1]}")
    x = x.float()
    zero = _half_down(x.amin(-3))
    scale = _half_up((x.amax(-3) - zero.float()) / _INT4_LEVELS)
    codes = torch.round(_safe_div(x - zero.float().unsqueeze(-3), scale.float().unsqueeze(-3)))
    return pack_int4(codes.clamp(0, _INT4_LEVELS)), scale, zero


def dequantize_channels_ref(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_channels_ref``: ``codes [..., T, H, D // 2]``, ``scale``/``zero`` ``[..., H, D]`` ->
    ``[..., T, H, D]`` in ``dtype`` (float32 math)."""
    values = unpack_int4(codes).float()
    return (values * scale.float().unsqueeze(-3) + zero.float().unsqueeze(-3)).to(dtype)
