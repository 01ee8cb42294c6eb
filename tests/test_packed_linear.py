"""CPU linears packed once for oneDNN (``paged_hf.packed_linear``): bfloat16 bit-identical to ``F.linear`` where
oneDNN has bfloat16 (else a float32 copy, within one rounding of the float32 product), float32 within the summation
bound of ``F.linear``'s, compiled and eager; a changed weight is packed again; float16 and
``PAGED_HF_PACKED_LINEAR=0`` stay unpacked; the engine packs its model and its greedy tokens equal the unpacked
engine's and generate + DynamicCache's."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from paged_hf import PagedEngine, SamplingParams, packed_linear
from paged_hf.kernels import cpu_ext
from paged_hf.packed_linear import PackedLinear, pack_linears
from kernel_target import cpu_flags, target_defines
from models import tiny_model
from test_engine_families import prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


NATIVE_BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.fixture(autouse=True)
def _float32_packed_too(monkeypatch):
    """float32 packing is the default on non-Intel CPUs only (``PAGED_HF_PACKED_LINEAR=all`` everywhere): these tests
    cover both dtypes on every CPU."""
    monkeypatch.setenv(packed_linear.ENV, "all")


def linear(n_in: int, n_out: int, bias: bool, seed: int = 0, dtype=torch.bfloat16) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(n_in, n_out, bias=bias).to(dtype)


def assert_like_f_linear(got, x, weight, bias):
    """bfloat16 with oneDNN's bfloat16: F.linear's bits, or else (as every other case) within the float32
    product's summation bound (two orders of ``K`` terms: ``2 K u sum|x w|``, u = 2^-24) of F.linear in float32,
    plus, for bfloat16 (widened), the one rounding of that product to bfloat16 (half an ulp: at most 2^-8
    relative)."""
    if x.dtype == torch.bfloat16 and NATIVE_BF16 and torch.equal(got, F.linear(x, weight, bias)):
        return  # usually F.linear's bits; for some small shapes (K = 23 on a Zen 4) F.linear takes another kernel
        # and one element lands one bfloat16 ulp away, so the bound below is what is asserted
    wide = [t.float() if t is not None else None for t in (x, weight, bias)]
    exact = F.linear(*wide)
    terms = F.linear(wide[0].abs(), wide[1].abs(), None if bias is None else wide[2].abs())
    bound = 2 * x.shape[-1] * 2**-24 * terms + 1e-30
    if x.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2**-8
    assert got.dtype == x.dtype
    excess = (got.float() - exact).abs() - bound
    assert excess.max() <= 0, f"{excess.max().item()} over the bound"


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), n_in=st.integers(1, 96), n_out=st.integers(1, 96), bias=st.booleans(),
       lead=st.sampled_from([(), (1,), (2,)]), dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_packed_equals_f_linear(rows, n_in, n_out, bias, lead, dtype):
    module = linear(n_in, n_out, bias, dtype=dtype)
    x = torch.randn(*lead, rows, n_in).to(dtype)
    assert pack_linears(module) == 1 and type(module) is PackedLinear
    assert_like_f_linear(module(x), x, module.weight, module.bias)


def test_float32_products_at_engine_sizes_keep_the_bound():
    """A decode step's head and a prefill chunk's projections (SmolLM2's widths), where oneDNN blocks the sums."""
    for rows, n_in, n_out in ((8, 576, 4096), (300, 576, 1536), (33, 1536, 576)):
        module = linear(n_in, n_out, False, dtype=torch.float32)
        x = torch.randn(rows, n_in)
        pack_linears(module)
        assert_like_f_linear(module(x), x, module.weight, None)


def test_bfloat16_products_of_few_rows_keep_the_bound():
    """Around the AMX tile path's row blocks (at most 64 rows, in blocks of 16, two a pass) and at widths that are
    not whole tiles
    (features past a multiple of 16, inputs past a multiple of 32), with and without a bias; the tile copy is made
    on a CPU with AMX (``linear_tile_copies``), oneDNN's product serves elsewhere, in the same bound."""
    for n_in, n_out, bias in ((576, 960, False), (600, 1000, True), (40, 24, True)):
        module = linear(n_in, n_out, bias)
        pack_linears(module)
        for rows in (1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65):
            x = torch.randn(rows, n_in).to(torch.bfloat16)
            assert_like_f_linear(module(x), x, module.weight, module.bias)


def test_the_tile_copy_is_made_where_the_cpu_has_amx():
    if not packed_linear.cpu_ext.loaded():
        pytest.skip("no C++ kernels here")
    amx = "amx_bf16" in cpu_flags() and {"__AMX_TILE__", "__AMX_BF16__", "__AVX512BF16__"} <= target_defines()
    assert torch.ops.paged_hf_cpu.linear_tile_copies() is (amx and NATIVE_BF16)


def test_the_panel_product_serves_where_the_build_is_avx2_without_avx512():
    if not packed_linear.cpu_ext.loaded():
        pytest.skip("no C++ kernels here")
    defines = target_defines()
    avx2_alone = {"__AVX2__", "__FMA__"} <= defines and "__AVX512F__" not in defines
    assert torch.ops.paged_hf_cpu.linear_panels() is avx2_alone


def panel_build() -> None:
    if not (packed_linear.cpu_ext.loaded() and torch.ops.paged_hf_cpu.linear_panels()):
        pytest.skip("packed copies are oneDNN's here (not a build for AVX2 without AVX-512)")


@pytest.mark.parametrize("n_in, n_out, bias", [(600, 1000, True), (576, 37, False), (40, 16, True), (1, 5, True)])
def test_panel_products_give_each_row_the_same_bits_whatever_its_neighbours(n_in, n_out, bias):
    """The AVX2 panel product sums each output in input order whatever the row count (groups of six rows, passes of
    64, several feature blocks a pass for 1-3 rows), the thread count or the row stride: a sequence's logits do not
    depend on the batch it decodes in. Inputs past a 256-input chunk, features past a 16-feature block."""
    panel_build()
    module = linear(n_in, n_out, bias, dtype=torch.float32)
    pack_linears(module)
    wide = torch.randn(70, n_in + 3)
    x = wide[:, :n_in]  # rows strided past their width
    whole = module(x)
    assert_like_f_linear(whole, x, module.weight, module.bias)
    start = 0
    for rows in (1, 2, 3, 4, 6, 7, 12, 13, 22):  # 70 rows in batches of every size class
        assert torch.equal(module(x[start:start + rows].contiguous()), whole[start:start + rows]), rows
        start += rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(module(x), whole)
    finally:
        torch.set_num_threads(threads)


def test_widened_bfloat16_panel_products_round_once():
    """A bfloat16 weight on this CPU is a bfloat16 panel copy widened in registers: the products of the float32
    panels of the same weight bit for bit (inputs past a 256-input chunk, features past a block), rounded to
    bfloat16 once."""
    panel_build()
    module = linear(300, 40, True)
    pack_linears(module)
    x = torch.randn(9, 300).to(torch.bfloat16)
    got = module(x)
    assert got.dtype == torch.bfloat16
    assert_like_f_linear(got, x, module.weight, module.bias)
    as_float32 = linear(300, 40, True, dtype=torch.float32)
    with torch.no_grad():
        as_float32.weight.copy_(module.weight.float())
        as_float32.bias.copy_(module.bias.float())
    pack_linears(as_float32)
    assert torch.equal(got, as_float32(x.float()).to(torch.bfloat16))


def test_widening_is_chosen_where_onednn_has_no_bfloat16():
    panels = cpu_ext.loaded() and torch.ops.paged_hf_cpu.linear_panels()  # a library built for AVX2 alone
    assert packed_linear.widens(torch.bfloat16) is (not NATIVE_BF16 or panels)
    assert packed_linear.widens(torch.float32) is False and packed_linear.widens(torch.float16) is None


def test_compiled_packed_linear_equals_eager_over_dynamic_rows():
    module = linear(64, 48, True)
    pack_linears(module)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    with torch.inference_mode():
        for rows in (1, 7, 33):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            assert torch.equal(compiled(x), module(x))
            assert_like_f_linear(compiled(x), x, module.weight, module.bias)


def test_a_weight_changed_after_packing_is_packed_again():
    module = linear(32, 16, False)
    pack_linears(module)
    x = torch.randn(4, 32).to(torch.bfloat16)
    module(x)
    with torch.no_grad():
        module.weight.mul_(-2)  # in place: the version counter moves
    assert_like_f_linear(module(x), x, module.weight, None)
    module.load_state_dict({"weight": torch.randn(16, 32).to(torch.bfloat16)})
    assert_like_f_linear(module(x), x, module.weight, None)


def test_other_dtypes_run_f_linear_and_float16_is_never_packed():
    module = linear(32, 16, True)
    assert pack_linears(module.half()) == 0 and type(module) is torch.nn.Linear
    pack_linears(module.to(torch.bfloat16))
    x = torch.randn(3, 32).half()
    module.half()  # packed in bfloat16, now float16: the op falls back to F.linear
    assert torch.equal(module(x), F.linear(x, module.weight, module.bias))
    module.float()  # float32 now: packed again, in float32
    x = torch.randn(3, 32)
    assert_like_f_linear(module(x), x, module.weight, module.bias)


def test_the_env_var_turns_packing_off_and_refuses_other_values(monkeypatch):
    monkeypatch.setenv(packed_linear.ENV, "0")
    assert pack_linears(linear(8, 8, True)) == 0
    monkeypatch.setenv(packed_linear.ENV, "yes")
    with pytest.raises(ValueError, match="PAGED_HF_PACKED_LINEAR must be 0, 1 or all"):
        pack_linears(linear(8, 8, True))
    monkeypatch.setenv(packed_linear.ENV, "1")  # the default, on an Intel CPU too: both dtypes
    monkeypatch.setattr(packed_linear, "mkl_sgemm_is_native", lambda: True)
    assert pack_linears(linear(8, 8, True, dtype=torch.float32)) == 1 and pack_linears(linear(8, 8, True)) == 1


def stale(module: torch.nn.Module) -> torch.Tensor:
    """Negates ``module.weight`` behind its version counter (through ``.data``), so that its packed copy is stale
    and an output shows which product served: the weight before (the packed copy) or after (``F.linear``)."""
    before = module.weight.detach().clone()
    module.weight.data.mul_(-1)
    return before


@pytest.mark.parametrize("cpp", [True, False], ids=["cpp_op", "python_op"])
@pytest.mark.parametrize("setting, intel, dense", [("1", True, packed_linear.MKL_ROWS), ("1", False, 0),
                                                   ("all", True, 0)])
def test_float32_products_of_a_few_rows_stay_mkls_on_an_intel_cpu(monkeypatch, cpp, setting, intel, dense):
    """MKL's sgemm has a path of its own for 1-3 rows on an Intel CPU, faster there than oneDNN: such products run
    ``F.linear``, more rows the packed copy; elsewhere, or with ``all``, the packed copy at every size."""
    if cpp and not packed_linear.cpu_ext.loaded():
        pytest.skip("the CPU kernels could not be built here")
    if not cpp:
        monkeypatch.setattr(packed_linear.cpu_ext, "loaded", lambda: False)
    monkeypatch.setenv(packed_linear.ENV, setting)
    monkeypatch.setattr(packed_linear, "mkl_sgemm_is_native", lambda: intel)
    assert packed_linear.dense_rows(torch.float32) == dense and packed_linear.dense_rows(torch.bfloat16) == 0
    module = linear(48, 40, True, dtype=torch.float32)
    assert pack_linears(module) == 1 and module._cpp is cpp
    packed_weight = stale(module)
    for rows in range(1, packed_linear.MKL_ROWS + 2):
        x = torch.randn(2, rows, 48)  # rows of the product: 2 * rows
        served_by = module.weight if 2 * rows < dense else packed_weight
        assert_like_f_linear(module(x), x, served_by, module.bias)


def test_a_fused_group_of_a_few_float32_rows_runs_its_members_through_f_linear(monkeypatch):
    """The compiled forward's q/k/v and gate/up groups follow the same rule: below ``MKL_ROWS`` rows each member
    runs ``F.linear``, from there the group's packed concatenation."""
    if not packed_linear.cpu_ext.loaded():
        pytest.skip("the CPU kernels could not be built here")
    monkeypatch.setenv(packed_linear.ENV, "1")
    monkeypatch.setattr(packed_linear, "mkl_sgemm_is_native", lambda: True)
    members = [linear(48, 40, True, seed=0, dtype=torch.float32), linear(48, 24, True, seed=1, dtype=torch.float32)]
    assert pack_linears(torch.nn.ModuleList(members)) == 2

    def group(x):
        return torch.ops.paged_hf_cpu.packed_linear_group(x, [m.weight for m in members], [m.bias for m in members],
                                                          [m._pack_key for m in members])

    group(torch.randn(8, 48))  # the group's packed copy is made at its first call of enough rows
    packed_weights = [stale(m) for m in members]
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, 48)
        weights = [m.weight for m in members] if rows < packed_linear.MKL_ROWS else packed_weights
        assert_like_f_linear(group(x), x, torch.cat(weights), torch.cat([m.bias for m in members]))


@pytest.mark.parametrize("setting", [None, "1"])
def test_float32_is_packed_by_default_where_mkl_is_not_on_an_intel_cpu(monkeypatch, setting):
    """MKL's sgemm takes its fast path on Intel CPUs only: elsewhere (an AMD EPYC) float32 linears go to oneDNN."""
    if setting is None:
        monkeypatch.delenv(packed_linear.ENV, raising=False)
    else:
        monkeypatch.setenv(packed_linear.ENV, setting)
    monkeypatch.setattr(packed_linear, "mkl_sgemm_is_native", lambda: False)
    module = linear(8, 8, True, dtype=torch.float32)
    assert pack_linears(module) == 1 and type(module) is PackedLinear
    monkeypatch.setenv(packed_linear.ENV, "0")
    assert pack_linears(linear(8, 8, True, dtype=torch.float32)) == 0


def test_the_cpu_vendor_is_read_from_proc_cpuinfo():
    vendors = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("vendor_id")] \
        if os.path.exists("/proc/cpuinfo") else []
    assert packed_linear.mkl_sgemm_is_native() == (vendors[0] == "GenuineIntel" if vendors else True)


def test_a_copy_over_half_the_available_memory_is_not_made(caplog):
    model = torch.nn.Sequential(linear(64, 64, True), linear(64, 32, False))  # 12 KiB of bfloat16 weights
    panels = packed_linear.cpu_ext.loaded() and torch.ops.paged_hf_cpu.linear_panels()
    # widened into oneDNN's layout: a float32 copy (an AMX tile copy is left out first: below); panels stay bfloat16
    copy_kib = 12 if NATIVE_BF16 or panels else 24
    with caplog.at_level("WARNING", logger="paged_hf"):
        assert pack_linears(model, available_bytes=(2 * copy_kib - 1) * 1024) == 0
    assert "not packing 2 bfloat16 linear weights" in caplog.text
    assert all(type(m) is torch.nn.Linear for m in model)
    assert pack_linears(model, available_bytes=2 * copy_kib * 1024) == 2


def test_the_tile_copies_are_left_out_first_when_memory_is_short(caplog):
    """Room for oneDNN's copy but not for the AMX tile copy too: packed without tiles, which is logged; the products
    keep the bound either way."""
    if not (NATIVE_BF16 and packed_linear.cpu_ext.loaded() and torch.ops.paged_hf_cpu.linear_tile_copies()):
        pytest.skip("no AMX tile copies on this CPU")
    model = torch.nn.Sequential(linear(64, 64, True), linear(64, 32, False))  # 12 KiB of bfloat16 weights
    with caplog.at_level("INFO", logger="paged_hf"):
        assert pack_linears(model, available_bytes=2 * 12 * 1024) == 2
    assert "no AMX tile copies of 2 bfloat16 linear weights" in caplog.text
    x = torch.randn(5, 64).to(torch.bfloat16)
    assert_like_f_linear(model[0](x), x, model[0].weight, model[0].bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_engine_packs_and_keeps_its_greedy_tokens(enforce_eager, dtype, monkeypatch):
    """The packed engine's greedy tokens == the unpacked engine's (compiled and eager); and generate + DynamicCache
    (sdpa) over the packed model == over the unpacked one. (The bfloat16 paged attention itself may differ from sdpa
    by rounding: ``test_cpu_bf16.py`` bounds that.)"""
    model = tiny_model("llama").to(dtype)
    unpacked_model = copy.deepcopy(model)
    options = dict(block_size=4, num_blocks=128, max_num_batched_tokens=9, enforce_eager=enforce_eager)
    monkeypatch.setenv(packed_linear.ENV, "0")
    unpacked = PagedEngine(unpacked_model, None, **options)
    monkeypatch.setenv(packed_linear.ENV, "all")
    packed = PagedEngine(model, None, **options)
    assert not any(isinstance(m, PackedLinear) for m in unpacked_model.modules())
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 7 * model.config.num_hidden_layers + 1
    got = [[o.outputs[0].token_ids for o in engine.generate(prompts(), GREEDY, use_tqdm=False)]
           for engine in (unpacked, packed)]
    assert got[1] == got[0]
    for each in (model, unpacked_model):
        each.set_attn_implementation("sdpa")
    ids = torch.tensor([prompts()[0]])
    generated = [m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                            eos_token_id=None, pad_token_id=0, cache=DynamicCache(config=m.config))
                 for m in (model, unpacked_model)]
    assert torch.equal(generated[0], generated[1])


def test_a_packed_bfloat16_engine_never_recompiles_in_steady_serving():
    from test_engine_compile import STEADY, graphs_during  # noqa: PLC0415 - its helpers, not its tests

    model = tiny_model("llama").to(torch.bfloat16)
    engine = PagedEngine(model, None, **STEADY)
    assert type(model.lm_head) is PackedLinear
    new_graphs, calls, _ = graphs_during(engine)
    assert calls > 5 and new_graphs == 0


def test_without_the_cpu_kernels_the_python_op_serves(monkeypatch):
    """Where the C++ library cannot be built, ``paged_hf::packed_linear`` (Python) runs the same oneDNN product."""
    monkeypatch.setattr(packed_linear.cpu_ext, "loaded", lambda: False)
    module = linear(48, 40, True)
    x = torch.randn(5, 48).to(torch.bfloat16)
    assert pack_linears(module) == 1 and type(module) is PackedLinear and not module._cpp
    assert int(module._pack_key) in packed_linear._packs
    assert_like_f_linear(module(x), x, module.weight, module.bias)
    with torch.no_grad():
        module.weight.mul_(3)
    assert_like_f_linear(module(x), x, module.weight, module.bias)
    f32 = linear(48, 40, True, dtype=torch.float32)
    assert pack_linears(f32) == 1 and not f32._cpp
    assert_like_f_linear(f32(x.float()), x.float(), f32.weight, f32.bias)


def test_with_the_cpu_kernels_the_cpp_op_serves():
    if not packed_linear.cpu_ext.loaded():
        pytest.skip("the CPU kernels could not be built here")
    module = linear(48, 40, False)
    assert pack_linears(module) == 1 and module._cpp and int(module._pack_key) not in packed_linear._packs
    x = torch.randn(2, 3, 48).to(torch.bfloat16)
    assert_like_f_linear(module(x), x, module.weight, None)
