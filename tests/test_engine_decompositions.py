"""The engine's own decompositions (``engine/decompositions.py``): gelu's tanh form computed through a sigmoid, within
a few ulp of ``F.gelu``; the engine's backend uses it; the table leaves inductor's compile caches working; the same
form written out in a model's code (``1 + tanh(u)``) is rewritten too, and no other ``tanh``."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from paged_hf.engine import compile as compile_module
from paged_hf.engine.decompositions import engine_decompositions, gelu_tanh_by_sigmoid
from transformers.activations import FastGELUActivation, NewGELUActivation


def gelu_inputs(dtype: torch.dtype) -> torch.Tensor:
    """Every magnitude gelu sees, both signs: the tail where ``1 + tanh`` cancels (x < -3) included."""
    spread = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 3
    return torch.cat([torch.linspace(-12, 12, 4001), spread]).to(dtype)


def ulps_off(got: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|got - gelu_tanh(x)| in units in the last place of got's dtype, against the value in float64 by the stable
    form x sigmoid(2u) (float64's own 1 + tanh cancels to 0 below x = -7), where that value is a normal number of
    the dtype and 2^24 times float32's smallest one or more (x > -10: below, the float32 sigmoid is subnormal and
    both forms lose their digits to underflow)."""
    d = x.double()
    exact = d * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (d + 0.044715 * d**3))
    info = torch.finfo(got.dtype)
    normal = exact.abs() >= max(info.tiny, torch.finfo(torch.float32).tiny * 2.0**24)
    ulp = torch.pow(2.0, torch.floor(torch.log2(exact.abs()[normal]))) * info.eps
    return (got.double()[normal] - exact[normal]).abs() / ulp


def test_gelu_tanh_in_float32_is_closer_than_torchs_own():
    """In the tail exp's argument carries float32's rounding, relative error up to |2u| ulp (~100 at x = -9); torch's
    own kernel loses every digit there (1 + tanh cancels). Elsewhere a few ulp."""
    x = gelu_inputs(torch.float32)
    ours, torchs = ulps_off(gelu_tanh_by_sigmoid(x, approximate="tanh"), x), ulps_off(F.gelu(x, approximate="tanh"), x)
    assert ours.max() <= 128 and ours.max() < torchs.max()
    middle = x.abs() <= 3
    assert ulps_off(gelu_tanh_by_sigmoid(x[middle], approximate="tanh"), x[middle]).max() <= 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gelu_tanh_in_half_precision_is_the_float32_value_rounded_once(dtype):
    x = gelu_inputs(dtype)
    got = gelu_tanh_by_sigmoid(x, approximate="tanh")
    assert got.dtype == dtype
    assert ulps_off(got, x).max() <= 0.51


def test_other_gelus_are_inductors_own():
    x = gelu_inputs(torch.float32)
    torch.testing.assert_close(gelu_tanh_by_sigmoid(x), F.gelu(x), atol=1e-6, rtol=1e-6)
    with pytest.raises(RuntimeError, match="approximate argument"):
        gelu_tanh_by_sigmoid(x, approximate="sigmoid")


def test_the_engine_backend_computes_gelu_tanh_without_tanh():
    """Inductor's own table would emit a vectorized tanh (Sleef's, 2.7x slower here); the engine's emits exp."""
    compiled = torch.compile(lambda x: F.gelu(x, approximate="tanh"), backend=compile_module._INDUCTOR)
    x = gelu_inputs(torch.bfloat16)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        out, (code, *_) = run_and_get_code(compiled, x)  # compiled now, not a cached graph
    assert "tanh" not in code and "exp" in code
    torch.testing.assert_close(out, gelu_tanh_by_sigmoid(x, approximate="tanh"), atol=0, rtol=0)


def test_the_table_keeps_inductors_compile_caches():
    """The table pickles as the call that makes it (its builtin entries would not pickle, and every engine compile
    would bypass the FX graph cache: 20 s more at each start of a Gemma 2 shaped engine)."""
    assert pickle.loads(pickle.dumps(engine_decompositions())) is engine_decompositions()
    before = counters["inductor"]["fxgraph_cache_bypass"]
    compiled = torch.compile(lambda x: F.gelu(x @ x, approximate="tanh"), backend=compile_module._INDUCTOR)
    compiled(torch.randn(8, 8))
    assert counters["inductor"]["fxgraph_cache_bypass"] == before


def engine_code(fn, *args):
    """``fn``'s output compiled by the engine's backend now (no cached graph), and its generated code."""
    compiled = torch.compile(fn, backend=compile_module._INDUCTOR, dynamic=False)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        out, (code, *_) = run_and_get_code(compiled, *args)
    return out, code


@pytest.mark.parametrize("activation", [NewGELUActivation(), FastGELUActivation(), lambda x: (torch.tanh(
    0.7978845608028654 * x * (1 + 0.044715 * x * x)) + 1.0) * x * 0.5], ids=["new", "fast", "bloom-like, tanh + 1"])
def test_gelu_written_out_compiles_without_tanh_within_a_few_ulp(activation):
    """GPT-2's, the "fast" and Bloom's gelu spell ``0.5 x (1 + tanh(u))`` in Python: in float32 within the ulp bounds
    of ``gelu_tanh_by_sigmoid``, closer than eager in the tail; in bfloat16 the float32 value rounded once."""
    x = gelu_inputs(torch.float32)
    out, code = engine_code(activation, x)
    assert "tanh" not in code and "exp" in code
    ours, eager = ulps_off(out, x), ulps_off(activation(x), x)
    assert ours.max() <= 256 and ours.max() < eager.max()  # u's own rounding, in each model's order, adds to 128
    assert ulps_off(out[x.abs() <= 3], x[x.abs() <= 3]).max() <= 16
    half = gelu_inputs(torch.bfloat16)
    out, code = engine_code(activation, half)
    assert "tanh" not in code and out.dtype == torch.bfloat16
    assert ulps_off(out, half).max() <= 1.01  # a bfloat16 cube and product in the model's code: one rounding more


def test_a_tanh_read_elsewhere_stays_and_a_softcap_is_left_alone():
    x = torch.linspace(-6, 6, 1001)
    out, code = engine_code(lambda x: (1 + torch.tanh(x), torch.tanh(x) * 30.0), x)
    assert "tanh" in code
    torch.testing.assert_close(out[0], 1 + torch.tanh(x), atol=1e-6, rtol=0)
    torch.testing.assert_close(out[1], torch.tanh(x) * 30.0)  # inductor's tanh: an ulp from eager's here and there
    out, code = engine_code(lambda x: (torch.tanh(x / 30.0) * 30.0, torch.tanh(x) + 2.0), x)  # a softcap; not 1 +
    assert "tanh" in code
    torch.testing.assert_close(out[0], torch.tanh(x / 30.0) * 30.0)
    torch.testing.assert_close(out[1], torch.tanh(x) + 2.0)
