"""Quantized KV formats: round-trip error bounds, determinism, zero handling, QuantizedKVStorage, bad input.

The per-vector math and the slot-level storage tests cover the per-token formats (int8, fp8); int4 quantizes whole
blocks (its quantizers: the "int4 blocks" section here; its storage, which fills blocks through a tail:
``tests/test_int4.py``)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import paged_hf.kernels.kv_format as kv_format_module
from paged_hf.kernels.kv_quant import (
    QUANTIZED_KV_FORMATS,
    VALUE_SCALE_STEPS,
    dequantize_block_values_ref,
    dequantize_channels_ref,
    dequantize_kv_ref,
    key_ranges_ref,
    pack_int4,
    quantize_block_values_ref,
    quantize_channels_ref,
    quantize_kv_ref,
    unpack_int4,
)
from kv_probe import read_blocks
from paged_hf.quant import (
    KV_CACHE_DTYPES,
    QuantizedKVStorage,
    canonical_kv_format,
    check_kv_format,
    layer_block_bytes,
    make_storage,
)
from paged_hf.rotation import kv_rotation, rotate, unrotate
from paged_hf.storage import KVStorage

FORMATS = QUANTIZED_KV_FORMATS
TOKEN_FORMATS = tuple(f for f in FORMATS if f != "int4")  # stored per token, written slot by slot
CODE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
HALF_TINY = 2.0**-24  # smallest float16 subnormal: the coarsest rounding a tiny float16 scale can suffer


def error_bound(x: torch.Tensor, kv_format: str) -> torch.Tensor:
    """Per-element bound on ``|dequantize(quantize(x)) - x|`` that the format's math guarantees (float64)."""
    x = x.double()
    absmax = x.abs().amax(-1, keepdim=True)
    slack = 1e-6 * absmax + 1e-30  # float32 arithmetic
    if kv_format == "int8":  # half a step of absmax / 127, the float16 scale rounded up
        return (absmax / 127 * (1 + 2**-10) + HALF_TINY) / 2 + slack
    fp8 = {"fp8_e4m3": (3, 448.0, 2.0**-10), "fp8_e5m2": (2, 57344.0, 2.0**-17)}
    mantissa_bits, fp8_max, subnormal = fp8[kv_format]
    scale = absmax / fp8_max * (1 + 2**-10) + HALF_TINY
    return x.abs() * 2.0 ** -(mantissa_bits + 1) + subnormal * scale + slack


# Worst case of the bound relative to each vector's absmax (what the docs promise; fp8: for any scale, also a
# subnormal float16 one, which keeps codes below finfo.max and so out of the top binade's tighter bound).
RELATIVE_BOUND = {"int8": 1 / 254, "fp8_e4m3": 1 / 16, "fp8_e5m2": 1 / 8}


def round_trip(x: torch.Tensor, kv_format: str) -> torch.Tensor:
    return dequantize_kv_ref(*quantize_kv_ref(x, kv_format), kv_format)


def stored_round_trip(x: torch.Tensor, kv_format: str) -> torch.Tensor:
    """What a ``QuantizedKVStorage`` reads back for ``x``: rotated, quantized, dequantized, rotated back (float32)."""
    rotation = kv_rotation(x.shape[-1])
    return unrotate(round_trip(rotate(x, rotation), kv_format), rotation)


def random_kv(n: int, heads: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """Gaussian vectors with per-vector magnitudes over six decades and offsets (one-sided vectors too)."""
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (torch.rand(n, heads, 1, generator=g) * 6 - 3)
    offset = torch.randn(n, heads, 1, generator=g) * 2
    return (torch.randn(n, heads, head_dim, generator=g) + offset) * magnitude


def raw_bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous().view(torch.uint8)


def same_bytes(a, b) -> bool:
    return all((x is None and y is None) or torch.equal(raw_bytes(x), raw_bytes(y)) for x, y in zip(a, b))


# ---------------------------------------------------------------- reference math


@pytest.mark.parametrize("n", [1, 17, 64])
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("kv_format", TOKEN_FORMATS)
def test_round_trip_error_within_bound(kv_format, head_dim, heads, n):
    x = random_kv(n, heads, head_dim, seed=head_dim * 100 + heads * 10 + n)
    err = (round_trip(x, kv_format).double() - x.double()).abs()
    assert (err <= error_bound(x, kv_format)).all()
    absmax = x.double().abs().amax(-1, keepdim=True)
    assert (err <= absmax * RELATIVE_BOUND[kv_format] * 1.002 + HALF_TINY).all()


@settings(max_examples=100, deadline=None)
@given(
    kv_format=st.sampled_from(TOKEN_FORMATS),
    values=st.lists(
        st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=16
    ).filter(lambda v: len(v) % 2 == 0),
)
def test_round_trip_bound_holds_for_any_vector(kv_format, values):
    x = torch.tensor(values, dtype=torch.float32).view(1, 1, -1)
    err = (round_trip(x, kv_format).double() - x.double()).abs()
    assert torch.isfinite(err).all()
    assert (err <= error_bound(x, kv_format)).all()


@pytest.mark.parametrize("kv_format", TOKEN_FORMATS)
def test_shapes_and_dtypes(kv_format):
    data, scale, zero = quantize_kv_ref(torch.randn(5, 3, 16), kv_format)
    assert data.dtype == CODE_DTYPES[kv_format]
    assert data.shape == (5, 3, 16)
    assert scale.shape == (5, 3) and scale.dtype == torch.float16 and zero is None
    out = dequantize_kv_ref(data, scale, zero, kv_format, dtype=torch.bfloat16)
    assert out.shape == (5, 3, 16) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("kv_format", TOKEN_FORMATS)
def test_dequantize_any_leading_shape(kv_format):
    x = random_kv(2 * 3 * 4, 2, 8)
    data, scale, zero = quantize_kv_ref(x, kv_format)
    flat = dequantize_kv_ref(data, scale, zero, kv_format)
    shaped = dequantize_kv_ref(
        data.view(2, 3, 4, 2, -1), scale.view(2, 3, 4, 2), None if zero is None else zero.view(2, 3, 4, 2), kv_format
    )
    assert torch.equal(shaped, flat.view(2, 3, 4, 2, 8))


def test_int4_packing_order_and_round_trip():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    all_codes = torch.arange(16, dtype=torch.uint8).repeat(2).view(2, 16)
    assert torch.equal(unpack_int4(pack_int4(all_codes)), all_codes)


@pytest.mark.parametrize("kv_format", TOKEN_FORMATS)
def test_zero_vectors_dequantize_to_exact_zero(kv_format):
    x = random_kv(6, 2, 8)
    x[1] = 0.0
    x[4, 1] = 0.0
    data, scale, zero = quantize_kv_ref(x, kv_format)
    out = dequantize_kv_ref(data, scale, zero, kv_format)
    assert not torch.isnan(out).any()
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[4, 1], torch.zeros_like(out[4, 1]))
    assert (scale[1] == 0).all() and scale[4, 1] == 0 and (scale[0] > 0).all()


@pytest.mark.parametrize("kv_format", TOKEN_FORMATS)
def test_tiny_vectors_keep_a_nonzero_scale(kv_format):
    x = torch.tensor([[[1e-7, -3e-8, 2e-7, 0.0]]])  # absmax / qmax underflows float16 unless rounded up
    data, scale, zero = quantize_kv_ref(x, kv_format)
    assert scale.item() > 0
    err = (dequantize_kv_ref(data, scale, zero, kv_format).double() - x.double()).abs()
    assert (err <= error_bound(x, kv_format)).all()


@pytest.mark.parametrize("kv_format", TOKEN_FORMATS)
def test_all_zero_bytes_dequantize_to_zero(kv_format):
    data = torch.zeros(4, 2, 8, dtype=CODE_DTYPES[kv_format])
    out = dequantize_kv_ref(data, torch.zeros(4, 2, dtype=torch.float16), None, kv_format)
    assert torch.equal(out, torch.zeros(4, 2, 8))


@pytest.mark.parametrize("kv_format", TOKEN_FORMATS)
def test_bytes_depend_only_on_the_vector(kv_format):
    x = random_kv(32, 4, 64)
    whole = quantize_kv_ref(x, kv_format)
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(1))
    permuted = quantize_kv_ref(x[perm], kv_format)
    assert same_bytes([t if t is None else t[perm] for t in whole], permuted)
    for i in (0, 13, 31):
        single = quantize_kv_ref(x[i : i + 1], kv_format)
        assert same_bytes([t if t is None else t[i : i + 1] for t in whole], single)
    assert same_bytes(whole, quantize_kv_ref(x.clone(), kv_format))


@pytest.mark.parametrize("kv_format", TOKEN_FORMATS)
def test_low_precision_input_equals_its_float32_value(kv_format):
    x = random_kv(8, 2, 16).bfloat16()
    assert same_bytes(quantize_kv_ref(x, kv_format), quantize_kv_ref(x.float(), kv_format))


def test_int4_is_not_quantized_per_vector():
    with pytest.raises(ValueError, match="quantize_block_values_ref"):
        quantize_kv_ref(torch.randn(2, 1, 8), "int4")
    with pytest.raises(ValueError, match="quantize_channels_ref"):
        dequantize_kv_ref(torch.zeros(2, 1, 4, dtype=torch.uint8), torch.zeros(2, 1), None, "int4")


# ---------------------------------------------------------------- int4 blocks


def random_blocks(blocks: int, block_size: int, heads: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """``[blocks, block_size, heads, head_dim]``: per-token magnitudes over five decades, a channel bias and an
    outlier channel (what keys look like), one-sided tokens; within float16's range (int4's grid saturates
    beyond)."""
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (torch.rand(blocks, block_size, heads, 1, generator=g) * 5 - 3)
    x = (torch.randn(blocks, block_size, heads, head_dim, generator=g) + torch.randn(head_dim, generator=g) * 2)
    x[..., 3] *= 20
    return x * magnitude


@pytest.mark.parametrize("block_size,head_dim", [(2, 8), (16, 64), (32, 128), (64, 16)])
def test_int4_key_error_within_half_a_channel_step(block_size, head_dim):
    """Every key lies in its channel's range (``lo <= x <= lo + 15 s``) and reads back within ``s / 2``."""
    x = random_blocks(6, block_size, 3, head_dim, seed=block_size + head_dim)
    codes, range_codes, grid = quantize_channels_ref(x)
    assert codes.shape == (6, block_size, 3, head_dim // 2) and codes.dtype == torch.uint8
    assert range_codes.shape == (6, 3, 2, head_dim) and range_codes.dtype == torch.uint8
    assert grid.shape == (6, 3, 2) and grid.dtype == torch.float16
    lo, scale = (t.double().unsqueeze(-3) for t in key_ranges_ref(range_codes, grid))
    xd = x.double()
    slack = 1e-6 * xd.abs().amax(dim=(-3, -1), keepdim=True)  # float32 arithmetic
    assert (lo <= xd + slack).all() and (lo + 15 * scale >= xd - slack).all()
    err = (dequantize_channels_ref(codes, range_codes, grid).double() - xd).abs()
    assert (err <= scale / 2 + slack).all()
    # the range of a channel is its own, stretched by at most a grid step each side
    step = grid[..., 1].double()[..., None, :, None]
    span = xd.amax(-3, keepdim=True) - xd.amin(-3, keepdim=True)
    assert (15 * scale <= span + 2 * step + slack).all()
    assert (range_codes[:, :, 0] <= range_codes[:, :, 1]).all()


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False), min_size=16,
                       max_size=16))
def test_int4_key_bound_holds_for_any_block(values):
    x = torch.tensor(values, dtype=torch.float32).view(4, 1, 4)  # 4 tokens, 4 channels
    codes, range_codes, grid = quantize_channels_ref(x)
    lo, scale = key_ranges_ref(range_codes, grid)
    err = (dequantize_channels_ref(codes, range_codes, grid).double() - x.double()).abs()
    assert torch.isfinite(err).all()
    assert (err <= scale.double() / 2 + 1e-6 * x.double().abs().max() + 1e-30).all()


@pytest.mark.parametrize("block_size,head_dim", [(2, 8), (16, 64), (32, 128), (64, 16)])
def test_int4_value_error_no_worse_than_the_block_absmax_scale(block_size, head_dim):
    """Each token's squared error is at most that of ``vmax = up(absmax / 7)`` (candidate ``k = 0``, which clips
    nothing: each element within vmax / 2), and over many tokens of 64+ channels below that of each token's own
    absmax / 7."""
    x = random_blocks(8, block_size, 2, head_dim, seed=3 * block_size + head_dim)
    codes, scale_codes, vmax = quantize_block_values_ref(x)
    assert codes.shape == (8, block_size, 2, head_dim // 2) and codes.dtype == torch.uint8
    assert scale_codes.shape == (8, 2, block_size // 2) and scale_codes.dtype == torch.uint8
    assert vmax.shape == (8, 2) and vmax.dtype == torch.float16
    out = dequantize_block_values_ref(codes, scale_codes, vmax).double()
    xd = x.double()
    v = vmax.double()[:, None, :, None]
    assert (v * 7 >= xd.abs().amax(dim=(1, 3), keepdim=True)).all()
    plain = (torch.round(xd / v).clamp(-8, 7) * v - xd).pow(2).sum(-1)  # [blocks, tokens, heads]
    error = (out - xd).pow(2).sum(-1)
    assert (error <= plain * (1 + 1e-5) + head_dim * v[..., 0].pow(2) * 2.0**-30).all()
    assert (error <= head_dim * (v[..., 0] / 2).pow(2) * (1 + 1e-5)).all()  # k = 0: within vmax / 2 everywhere
    if head_dim >= 64:  # enough channels for the error-minimizing scale to beat each token's own absmax / 7
        own = xd.abs().amax(-1, keepdim=True) / 7
        per_token = (torch.round(xd / own).clamp(-8, 7) * own - xd).pow(2).sum(-1)
        assert error.sum() < per_token.sum()


def test_int4_value_scale_codes_pick_the_least_error_and_pack_by_token():
    """A block whose tokens have magnitudes 2^(-k/3) of the largest: token t takes a code near its own magnitude, the
    codes are packed two tokens per byte (token 2i low), and ties go to the smallest code (a zero token: 0)."""
    block = torch.zeros(16, 1, 8)
    for t in range(15):
        block[t, 0] = torch.tensor([7.0, -7.0, 3.5, 1.0, -2.0, 0.5, 6.0, -5.0]) * float(VALUE_SCALE_STEPS[t])
    codes, scale_codes, vmax = quantize_block_values_ref(block)
    assert vmax.item() == 1.0
    k = unpack_int4(scale_codes)[0]
    assert k[:15].tolist() == list(range(15)) and k[15] == 0  # token 15: all zero, every code ties
    assert scale_codes[0, 0] == k[0] | (k[1] << 4)
    out = dequantize_block_values_ref(codes, scale_codes, vmax)
    assert torch.allclose(out[:15, 0, :2], block[:15, 0, :2]) and torch.equal(out[15], block[15])


def test_int4_value_scale_steps_are_the_float32_cube_roots():
    steps = VALUE_SCALE_STEPS.double()
    assert steps.dtype == torch.float64 and VALUE_SCALE_STEPS.dtype == torch.float32
    assert steps[0] == 1 and torch.equal(steps[3:], steps[:-3] / 2)  # 2^(-k/3): exact halvings every third step
    assert torch.allclose(steps, 2.0 ** (-torch.arange(16, dtype=torch.float64) / 3), rtol=2**-23)


def test_int4_constant_and_zero_blocks_are_exact():
    x = torch.full((2, 4, 3, 8), 0.5)
    codes, range_codes, grid = quantize_channels_ref(x)
    assert (grid[..., 1] == 0).all() and (range_codes == 0).all()
    assert torch.equal(dequantize_channels_ref(codes, range_codes, grid), x)
    zero = torch.zeros(2, 4, 3, 8)
    for quantize, dequantize in ((quantize_channels_ref, dequantize_channels_ref),
                                 (quantize_block_values_ref, dequantize_block_values_ref)):
        out = dequantize(*quantize(zero))
        assert torch.equal(out, zero) and not torch.isnan(out).any()
    # all-zero bytes (a fresh pool) read 0
    codes = torch.zeros(2, 4, 3, 4, dtype=torch.uint8)
    assert torch.equal(dequantize_channels_ref(codes, torch.zeros(2, 3, 2, 8, dtype=torch.uint8),
                                               torch.zeros(2, 3, 2, dtype=torch.float16)), zero)
    assert torch.equal(dequantize_block_values_ref(codes, torch.zeros(2, 3, 2, dtype=torch.uint8),
                                                   torch.zeros(2, 3, dtype=torch.float16)), zero)


def test_int4_block_bytes_depend_only_on_the_block():
    x = random_blocks(5, 16, 2, 32, seed=4)
    for quantize in (quantize_channels_ref, quantize_block_values_ref):
        whole = quantize(x)
        for i in (0, 3):
            assert same_bytes([t[i : i + 1] for t in whole], quantize(x[i : i + 1]))
        assert same_bytes(quantize(x.bfloat16()), quantize(x.bfloat16().float()))


def test_int4_block_quantizers_reject_odd_sizes():
    for quantize in (quantize_channels_ref, quantize_block_values_ref):
        with pytest.raises(ValueError, match="head_dim"):
            quantize(torch.randn(2, 4, 1, 7))
    with pytest.raises(ValueError, match="even"):
        quantize_block_values_ref(torch.randn(2, 5, 1, 8))


def _float16_rounding_inputs() -> torch.Tensor:
    """Every finite float16 value with its two float32 neighbours, float32 values over 14 decades, the edges."""
    grid = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    grid = grid[torch.isfinite(grid)].float()
    up, down = torch.full_like(grid, 1e9), torch.full_like(grid, -1e9)
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(200_000, generator=gen) * 10 ** (torch.rand(200_000, generator=gen) * 14 - 9)
    edges = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2.0**-14, 65504.0, 65505.0, 65520.0, 3e38, float("inf"),
                          -65505.0, -float("inf")])
    return torch.cat([grid, torch.nextafter(grid, up), torch.nextafter(grid, down), spread, edges])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_float16_side_data_rounds_up_and_down_also_when_compiled(compiled):
    """The float16 scales round up (``_half_up``: the smallest float16 >= x) and grid bases down (``_half_down``):
    checked against ``nextafter`` on every float16 value's neighbours, eager and compiled (inductor computes a
    ``.half().float()`` round trip in float32, without rounding: a compiled store rounded its scales to nearest),
    and the grid arithmetic of the compiled path run eagerly too."""
    from paged_hf.kernels import kv_quant

    x = _float16_rounding_inputs()
    half_max = torch.finfo(torch.float16).max
    h = x.clamp(-half_max, half_max).half()
    above = torch.nextafter(h, torch.full_like(h, float("inf"))).clamp(max=half_max)
    below = torch.nextafter(h, torch.full_like(h, float("-inf"))).clamp(min=-half_max)
    want_up = torch.where(h.float() < x, above, h)
    want_down = torch.where(h.float() > x, below, h)
    up, down = kv_quant._half_up, kv_quant._half_down
    if compiled:
        torch.compiler.reset()
        up, down = torch.compile(up, fullgraph=True), torch.compile(down, fullgraph=True)
    positive = x >= 0
    assert torch.equal(up(x[positive]).view(torch.int16), want_up[positive].view(torch.int16))
    assert torch.equal(down(x).view(torch.int16), want_down.view(torch.int16))
    if not compiled:  # the grid arithmetic the compiled path takes, run eagerly: the same values
        size = x.clamp(-half_max, half_max).abs()
        grid_up, grid_down = kv_quant._half_grid(size, up=True), kv_quant._half_grid(size, up=False)
        assert torch.equal(grid_up[positive].half(), want_up[positive])
        grid_down = torch.copysign(torch.where(x < 0, grid_up, grid_down), x).half()
        assert torch.equal(grid_down.view(torch.int16), want_down.view(torch.int16))


@pytest.mark.parametrize("quantize", ["int8", "fp8_e4m3", "fp8_e5m2", "int4 keys", "int4 values"])
def test_quantizers_compiled_give_the_eager_bytes(quantize):
    """A compiled ``generate`` traces the quantizers into its graph: codes and side data bit for bit the eager ones
    (values over six decades, zero blocks and a constant channel among them)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 16, 2, 32, generator=gen) * 10 ** (torch.rand(6, 1, 2, 1, generator=gen) * 6 - 3)
    x[0] = 0.0
    x[1, :, :, 3] = 2.5
    fn = {"int4 keys": quantize_channels_ref, "int4 values": quantize_block_values_ref}.get(quantize)
    if fn is None:
        def fn(t, kv_format=quantize):
            return quantize_kv_ref(t, kv_format)
    torch.compiler.reset()
    compiled = torch.compile(fn, fullgraph=True)(x)
    for got, want in zip(compiled, fn(x)):
        if want is not None:
            assert got.dtype == want.dtype
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


# ---------------------------------------------------------------- QuantizedKVStorage

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 6, 4, 2, 8


def storage(kv_format: str, dtype=torch.float32) -> QuantizedKVStorage:
    return QuantizedKVStorage(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, dtype, "cpu", kv_format)


def pools(s: QuantizedKVStorage) -> list:
    return [s.key_cache, s.value_cache, s.key_scale, s.value_scale, s.key_zero, s.value_zero]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_format", TOKEN_FORMATS)
def test_storage_reads_equal_reference_round_trip(kv_format, dtype):
    s = storage(kv_format, dtype)
    assert s.dtype == dtype and s.kv_format == kv_format
    slots = torch.tensor([5, 0, 22, 9, 10, 11])
    key, value = random_kv(6, HEADS, HEAD_DIM, seed=1).to(dtype), random_kv(6, HEADS, HEAD_DIM, seed=2).to(dtype)
    s.write(slots, key, value)
    k, v = s.read_slots(slots)
    assert k.dtype == dtype and k.shape == (6, HEADS, HEAD_DIM)
    assert torch.equal(k, stored_round_trip(key, kv_format).to(dtype))
    assert torch.equal(v, stored_round_trip(value, kv_format).to(dtype))
    kb, vb = read_blocks(s, torch.tensor([[1, 2], [5, 0]]))
    assert kb.shape == (2, 2, BLOCK_SIZE, HEADS, HEAD_DIM) and kb.dtype == dtype
    assert torch.equal(kb[0, 0, 1], k[0]) and torch.equal(vb[1, 0, 2], v[2]) and torch.equal(kb[1, 1, 0], k[1])
    assert torch.equal(kb[0, 1, 1:], k[3:]) and torch.equal(vb[0, 1, 1:], v[3:])
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[slots] = True
    rest_k, rest_v = s.read_slots(torch.arange(NUM_BLOCKS * BLOCK_SIZE)[~written])
    assert torch.equal(rest_k, torch.zeros_like(rest_k)) and torch.equal(rest_v, torch.zeros_like(rest_v))


@pytest.mark.parametrize("kv_format", TOKEN_FORMATS)
def test_storage_bytes_do_not_depend_on_batch_or_slot(kv_format):
    key, value = random_kv(8, HEADS, HEAD_DIM, seed=3), random_kv(8, HEADS, HEAD_DIM, seed=4)
    a, b = storage(kv_format), storage(kv_format)
    a.write(torch.arange(8), key, value)  # tokens 0..7 -> blocks 0, 1, in one batch
    other = random_kv(2, HEADS, HEAD_DIM, seed=5)
    # tokens 0..7 -> blocks 4, 5 of b, in two batches, in another order and with unrelated tokens beside them
    first, second = [key[1], other[0], key[0]], [value[1], other[0], value[0]]
    b.write(torch.tensor([17, 8, 16]), torch.stack(first), torch.stack(second))
    slots = torch.cat([torch.arange(18, 24), torch.tensor([9])])
    b.write(slots, torch.cat([key[2:], other[1:]]), torch.cat([value[2:], other[1:]]))
    for pa, pb in zip(pools(a), pools(b)):
        if pa is not None:
            assert torch.equal(raw_bytes(pa[0:2]), raw_bytes(pb[4:6]))


@pytest.mark.parametrize("kv_format", TOKEN_FORMATS)
def test_copy_blocks_copies_codes_and_scales(kv_format):
    s = storage(kv_format)
    s.write(torch.arange(8), random_kv(8, HEADS, HEAD_DIM, seed=5), random_kv(8, HEADS, HEAD_DIM, seed=6))
    before = read_blocks(s, torch.tensor([0, 1]))
    s.copy_blocks(torch.tensor([0, 1]), torch.tensor([3, 5]))
    after = read_blocks(s, torch.tensor([3, 5]))
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    for pool in pools(s):
        if pool is not None:
            assert torch.equal(raw_bytes(pool[3]), raw_bytes(pool[0]))
            assert torch.equal(raw_bytes(pool[5]), raw_bytes(pool[1]))


@pytest.mark.parametrize("kv_format", TOKEN_FORMATS)
def test_grow_keeps_content_and_adds_zeroed_blocks(kv_format):
    s = storage(kv_format)
    s.write(torch.arange(24), random_kv(24, HEADS, HEAD_DIM, seed=7), random_kv(24, HEADS, HEAD_DIM, seed=8))
    before = [None if p is None else p.clone() for p in pools(s)]
    all_blocks = torch.arange(NUM_BLOCKS)
    old_k, old_v = read_blocks(s, all_blocks)
    s.grow(3)
    assert s.num_blocks == NUM_BLOCKS + 3 and all(p is None or p.shape[0] == NUM_BLOCKS + 3 for p in pools(s))
    assert same_bytes(before, [None if p is None else p[:NUM_BLOCKS] for p in pools(s)])
    k, v = read_blocks(s, all_blocks)
    assert torch.equal(k, old_k) and torch.equal(v, old_v)
    new_k, _ = read_blocks(s, torch.arange(NUM_BLOCKS, NUM_BLOCKS + 3))
    assert torch.equal(new_k, torch.zeros_like(new_k))
    key = random_kv(1, HEADS, HEAD_DIM, seed=9)
    s.write(torch.tensor([(NUM_BLOCKS + 2) * BLOCK_SIZE + 1]), key, key)
    assert torch.equal(s.read_slots(torch.tensor([(NUM_BLOCKS + 2) * BLOCK_SIZE + 1]))[0],
                       stored_round_trip(key, kv_format))


@pytest.mark.parametrize("kv_format", TOKEN_FORMATS)
def test_nbytes_and_bytes_per_token_count_scales(kv_format):
    s = QuantizedKVStorage(10, 16, 4, 64, torch.float16, "cpu", kv_format)
    assert s.bytes_per_token == 2 * 4 * (64 + 2)
    bs = s.block_size
    assert s.nbytes == 10 * bs * s.bytes_per_token == sum(p.nbytes for p in pools(s) if p is not None)
    assert s.nbytes == 10 * layer_block_bytes(kv_format, bs, 4, 64, torch.float16)
    assert layer_block_bytes(kv_format, bs, 4, 64, torch.bfloat16) == s.nbytes // 10
    fp16 = KVStorage(10, bs, 4, 64, torch.float16, "cpu")
    assert fp16.bytes_per_token / s.bytes_per_token >= 1.9


@pytest.mark.parametrize("block_size,head_dim,ratio", [(16, 64, 3.51), (16, 128, 3.53), (32, 64, 3.72),
                                                       (2, 64, 1.94), (64, 256, 3.87)])
def test_int4_bytes_per_block_count_every_tensor(block_size, head_dim, ratio):
    """Per block and KV head: B D bytes of codes, 2 D + 4 of key ranges and grid, B / 2 + 2 of value scale codes and
    maximum; >= 3.5x fewer than float16 at the default block size 16."""
    s = QuantizedKVStorage(10, block_size, 3, head_dim, torch.float16, "cpu", "int4")
    per_block = layer_block_bytes("int4", block_size, 3, head_dim, torch.float16)
    assert per_block == 3 * (block_size * head_dim + 2 * head_dim + 4 + block_size // 2 + 2)
    assert s.nbytes == 10 * per_block == sum(p.nbytes for p in pools(s))
    assert layer_block_bytes("int4", block_size, 3, head_dim, torch.bfloat16) == per_block
    fp16 = KVStorage(1, block_size, 3, head_dim, torch.float16, "cpu").nbytes
    assert fp16 / per_block >= ratio
    if block_size == 16:
        assert fp16 / per_block >= 3.5


def test_int4_odd_block_size_is_rejected():
    for call in (
        lambda: QuantizedKVStorage(2, 1, 1, 8, torch.float32, "cpu", "int4"),
        lambda: make_storage("int4", 2, 3, 1, 8, torch.float32, "cpu"),
        lambda: layer_block_bytes("int4", 1, 1, 8, torch.float32),
    ):
        with pytest.raises(ValueError, match=r"block_size must be even for kv_cache_dtype='int4'.*block_size=[13]"):
            call()
    assert make_storage("int8", 2, 1, 1, 8, torch.float32, "cpu").block_size == 1


def test_make_storage_and_bytes_per_block_for_auto_and_alias():
    plain = make_storage("auto", 3, 4, 2, 8, torch.bfloat16, "cpu")
    assert type(plain) is KVStorage and plain.dtype == torch.bfloat16
    assert layer_block_bytes("auto", 4, 2, 8, torch.bfloat16) == plain.nbytes // 3 == 2 * 4 * 2 * 8 * 2
    fp8 = make_storage("fp8", 3, 4, 2, 8, torch.bfloat16, "cpu")
    assert isinstance(fp8, QuantizedKVStorage) and fp8.kv_format == "fp8_e4m3"
    assert fp8.key_cache.dtype == torch.float8_e4m3fn and fp8.dtype == torch.bfloat16
    assert fp8.key_cache.shape == (3, 4, 2, 8) and fp8.key_scale.shape == (3, 4, 2) and fp8.key_zero is None
    int4 = make_storage("int4", 3, 4, 2, 8, torch.float32, "cpu")
    assert int4.key_cache.shape == (3, 4, 2, 4)
    assert int4.key_scale.shape == (3, 2, 2, 8) and int4.key_scale.dtype == torch.uint8  # channel ranges
    assert int4.key_zero.shape == (3, 2, 2) and int4.key_zero.dtype == torch.float16  # grid of each block, head
    assert int4.value_scale.shape == (3, 2, 2) and int4.value_scale.dtype == torch.uint8  # a code per token
    assert int4.value_zero.shape == (3, 2) and int4.value_zero.dtype == torch.float16  # vmax of each block, head
    assert int4.key_tail.shape == (0, 4, 2, 8) and int4.key_tail.dtype == torch.float32
    assert all(torch.equal(raw_bytes(p), torch.zeros_like(raw_bytes(p))) for p in pools(int4))
    k, v = read_blocks(int4, torch.arange(3))  # a fresh pool reads exact zeros
    assert torch.equal(k, torch.zeros(3, 4, 2, 8)) and torch.equal(v, torch.zeros(3, 4, 2, 8))
    k, v = int4.read_slots(torch.arange(12))
    assert torch.equal(k, torch.zeros(12, 2, 8)) and torch.equal(v, torch.zeros(12, 2, 8))


# ---------------------------------------------------------------- bad input


def test_canonical_kv_format():
    assert canonical_kv_format("fp8") == "fp8_e4m3"
    assert [canonical_kv_format(n) for n in ("auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4")] == [
        "auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4"
    ]
    for bad in ("int3", "FP8", "float16"):
        with pytest.raises(ValueError, match="kv_cache_dtype") as info:
            canonical_kv_format(bad)
        assert all(name in str(info.value) for name in KV_CACHE_DTYPES) and repr(bad) in str(info.value)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_storage("int2", 2, 4, 1, 8, torch.float32, "cpu")


def test_int4_odd_head_dim_is_rejected():
    assert check_kv_format("int4", 8) == "int4" and check_kv_format("int8", 7) == "int8"
    for call in (
        lambda: check_kv_format("int4", 7),
        lambda: QuantizedKVStorage(2, 4, 1, 7, torch.float32, "cpu", "int4"),
        lambda: make_storage("int4", 2, 4, 1, 7, torch.float32, "cpu"),
        lambda: layer_block_bytes("int4", 4, 1, 7, torch.float32),
    ):
        with pytest.raises(ValueError, match="head_dim"):
            call()


def test_quantized_storage_rejects_auto():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        QuantizedKVStorage(2, 4, 1, 8, torch.float32, "cpu", "auto")


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
def test_fp8_without_torch_support_is_rejected(monkeypatch, name):
    monkeypatch.setattr(kv_format_module, "_FP8", {"fp8_e4m3": None, "fp8_e5m2": None})
    for call in (lambda: check_kv_format(name, 8), lambda: make_storage(name, 2, 4, 1, 8, torch.float32, "cpu")):
        with pytest.raises(ValueError, match="float8"):
            call()
    assert check_kv_format("int8", 8) == "int8"


# ------------------------------------------------------------------------------------------------ rotation


@pytest.mark.parametrize("head_dim", [1, 2, 6, 8, 64, 80, 96, 128, 256])
def test_kv_rotation_is_orthonormal_and_fixed(head_dim):
    r = kv_rotation(head_dim)
    assert r.shape == (head_dim, head_dim) and r.dtype == torch.float32
    torch.testing.assert_close(r @ r.T, torch.eye(head_dim), atol=1e-6, rtol=0)
    assert torch.equal(r, kv_rotation(head_dim))  # depends on head_dim only: same tokens, same bytes
    x = torch.randn(5, 3, head_dim)
    torch.testing.assert_close(unrotate(rotate(x, r), r), x, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="head_dim"):
        kv_rotation(0)


def test_kv_rotation_spreads_an_outlier_channel():
    x = torch.zeros(64)
    x[5] = 10.0  # all the magnitude in one channel: per-vector int4 would give every other channel one level
    rotated = rotate(x, kv_rotation(64))
    assert torch.allclose(rotated.abs(), torch.full((64,), 10.0 / 8))  # a (signed) Hadamard row: flat magnitude


@pytest.mark.parametrize("kv_format", TOKEN_FORMATS)
def test_storage_holds_codes_of_the_rotated_vectors(kv_format):
    s = storage(kv_format)
    key, value = random_kv(4, HEADS, HEAD_DIM, seed=11), random_kv(4, HEADS, HEAD_DIM, seed=12)
    s.write(torch.arange(4), key, value)
    data, scale, zero = quantize_kv_ref(rotate(key, kv_rotation(HEAD_DIM)), kv_format)
    assert torch.equal(raw_bytes(s.key_cache[0]), raw_bytes(data)) and torch.equal(s.key_scale[0], scale)
    assert zero is None or torch.equal(s.key_zero[0], zero)
    plain = make_storage("auto", 2, 4, HEADS, HEAD_DIM, torch.float32, "cpu")
    assert plain.key_rotation is None and plain.value_rotation is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotated_query_reaches_the_kernels_in_the_model_dtype(monkeypatch, dtype):
    """A quantized pool rotates the query in float32, but the attention (kernel or reference) receives it back in
    the model dtype: bf16 queries take the kernels' tensor-core path (not the float32 IEEE dots) in every format,
    and a float32 model stays float32. The attention's output comes back in the model dtype too."""
    from models import tiny_model

    import paged_hf.attention
    from paged_hf.kernels import paged_decode_attention as decode_module
    from paged_hf.kernels import paged_prefill_attention as prefill_module

    seen = []

    def spy(module, name):
        original = getattr(module, name)

        def wrapper(query, *args, **kwargs):
            out = original(query, *args, **kwargs)
            pools = args[0] if args else kwargs.get("pools")  # the kernels' PoolTensors
            seen.append((name, query.dtype, out.dtype, getattr(pools, "kv_format", None)))
            return out

        monkeypatch.setattr(module, name, wrapper)

    for name in ("paged_decode_attention", "paged_decode_attention_ref"):
        spy(decode_module, name)
    for name in ("paged_prefill_attention", "paged_prefill_attention_ref"):
        spy(prefill_module, name)
    from paged_hf.kernels import cpu_attention  # the CPU's production path

    for name in ("paged_decode_attention_cpu", "paged_prefill_attention_cpu"):
        spy(cpu_attention, name)
    spy(paged_hf.attention, "paged_attention")  # the un-rotated output, as the model receives it
    model = tiny_model("llama", "paged").to(dtype)
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    out = model.generate(input_ids=ids, attention_mask=(ids > 0).long(), max_new_tokens=3, do_sample=False,
                         cache_implementation="paged", cache_config={"kv_cache_dtype": "int8"}, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    kernels = [call for call in seen if call[0] != "paged_attention"]
    assert {name.split("_")[1] for name, *_ in kernels} == {"prefill", "decode"}, seen  # both paths ran
    assert {(q, o, fmt) for _, q, o, fmt in kernels} == {(dtype, dtype, "int8")}
    assert {(q, o) for name, q, o, _ in seen if name == "paged_attention"} == {(dtype, dtype)}
    assert (decode_module.dot_mode(dtype) == 1) == (dtype == torch.float32)  # 1: the float32 IEEE dots
    assert out.sequences.shape == (2, 8)
