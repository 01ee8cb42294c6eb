"""What the compiled CPU forward runs besides the model's own ops: the C++ store and attention of unquantized pools
(``paged_hf_cpu::store`` / ``attend``, ``ops.store_layer``), the fused q/k/v and gate/up linears of a bfloat16 model
(``packed_linear.FusePackedLinears``): each is used where it applies and not elsewhere, and the greedy tokens stay
the eager engine's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from paged_hf import PagedEngine, SamplingParams
from paged_hf.kernels import cpu_ext
from paged_hf.packed_linear import FusePackedLinears, pack_linears
from models import tiny_model
from test_engine_compile import STEADY, graphs_during, tokens
from test_engine_families import prompts

pytestmark = pytest.mark.skipif(not cpu_ext.loaded(), reason="the CPU kernels could not be built here")
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def ops_run(engine: PagedEngine) -> set[str]:
    """The operator names a ``generate`` on ``engine`` ran."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate(prompts()[:2], GREEDY, use_tqdm=False)
    return {event.key for event in prof.key_averages()}


class _NotBuilt:
    @staticmethod
    def loaded() -> bool:
        return False


def compiled_engine(model, **options) -> PagedEngine:
    """A compiled engine over ``model`` compiled afresh (no graph of an earlier engine reused, none from inductor's
    cache), so a pass or switch patched by the test takes effect."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        return PagedEngine(model, None, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_unquantized_pools_store_and_attend_in_cpp_with_the_python_ops_tokens(dtype, monkeypatch):
    """float32: the eager engine's tokens too. bfloat16: inductor's fused element-wise ops round otherwise than
    eager, so the reference is the compiled engine through the Python ops."""
    model = tiny_model("llama").to(dtype)
    eager = tokens(PagedEngine(model, None, enforce_eager=True, **STEADY), GREEDY)
    engine = compiled_engine(model, **STEADY)
    new_graphs, calls, got = graphs_during(engine, GREEDY)
    assert calls > 5 and new_graphs == 0
    names = ops_run(engine)
    assert {"paged_hf_cpu::store", "paged_hf_cpu::attend"} <= names
    assert not {"paged_hf::store_kv", "paged_hf::paged_attention"} & names
    monkeypatch.setattr("paged_hf.engine.forward_cache.cpu_ext", _NotBuilt)
    python_ops = compiled_engine(model, **STEADY)
    assert "paged_hf::paged_attention" in ops_run(python_ops)
    assert got == tokens(python_ops, GREEDY)
    if dtype == torch.float32:
        assert got == eager


def test_quantized_pools_keep_the_python_ops():
    engine = PagedEngine(tiny_model("llama"), None, kv_cache_dtype="int8", **STEADY)
    names = ops_run(engine)
    assert {"paged_hf::store_kv", "paged_hf::paged_attention"} <= names
    assert not {"paged_hf_cpu::store", "paged_hf_cpu::attend"} & names


def test_a_windowed_model_stores_and_attends_in_cpp():
    """Mistral's sliding window (6 keys, shorter than every prompt): the C++ store and attention, the window passed
    down to both kernels, with the eager engine's greedy tokens."""
    model = tiny_model("mistral")
    eager = tokens(PagedEngine(model, None, enforce_eager=True, **STEADY), GREEDY)
    engine = compiled_engine(model, **STEADY)
    assert tokens(engine, GREEDY) == eager
    names = ops_run(engine)
    assert {"paged_hf_cpu::store", "paged_hf_cpu::attend"} <= names and "paged_hf::paged_attention" not in names


def test_a_softcapped_windowed_model_stores_and_attends_in_cpp():
    """Gemma2 (an attention softcap of 50, windows of 6 keys on every other layer): the C++ store and attention,
    with the eager engine's greedy tokens."""
    model = tiny_model("gemma2")
    eager = tokens(PagedEngine(model, None, enforce_eager=True, **STEADY), GREEDY)
    engine = compiled_engine(model, **STEADY)
    assert tokens(engine, GREEDY) == eager
    names = ops_run(engine)
    assert {"paged_hf_cpu::store", "paged_hf_cpu::attend"} <= names and "paged_hf::paged_attention" not in names


def test_a_bfloat16_engine_runs_qkv_and_gate_up_as_one_product_each(monkeypatch):
    """Fused, the greedy tokens equal the compiled engine's without the pass."""
    model = tiny_model("llama").to(torch.bfloat16)
    engine = compiled_engine(model, **STEADY)
    fused = tokens(engine, GREEDY)
    assert "paged_hf_cpu::packed_linear_group" in ops_run(engine)
    monkeypatch.setattr(FusePackedLinears, "__call__", lambda self, graph: None)
    unfused = compiled_engine(model, **STEADY)
    assert "paged_hf_cpu::packed_linear_group" not in ops_run(unfused)
    assert tokens(unfused, GREEDY) == fused


def test_the_fusion_pass_groups_the_linears_of_one_input_and_keeps_their_values():
    linears = [torch.nn.Linear(32, n, bias=False).to(torch.bfloat16) for n in (32, 16, 16)]
    other = torch.nn.Linear(24, 8, bias=False).to(torch.bfloat16)
    for module in (*linears, other):
        pack_linears(module)
    weights = [m.weight.detach() for m in (*linears, other)]
    keys = [m._pack_key for m in (*linears, other)]

    def forward(x, y, wq, wk, wv, wo, *keys):  # the keys are inputs, as the module buffers they are in the engine
        q, k, v = (torch.ops.paged_hf_cpu.packed_linear(x, w, None, key) for w, key in zip((wq, wk, wv), keys))
        alone = torch.ops.paged_hf_cpu.packed_linear(y, wo, None, keys[3])  # no sibling: left as it is
        return q * 2, k + 1, v, alone

    x, y = torch.randn(5, 32).to(torch.bfloat16), torch.randn(5, 24).to(torch.bfloat16)
    graph = torch.fx.experimental.proxy_tensor.make_fx(forward, tracing_mode="fake")(x, y, *weights, *keys)
    FusePackedLinears()(graph.graph)
    graph.recompile()
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.paged_hf_cpu.packed_linear_group.default) == 1
    assert targets.count(torch.ops.paged_hf_cpu.packed_linear.default) == 1
    want = (F.linear(x, weights[0]) * 2, F.linear(x, weights[1]) + 1, F.linear(x, weights[2]), F.linear(y, weights[3]))
    for got, expected in zip(graph(x, y, *weights, *keys), want):
        assert torch.equal(got, expected)
    weights[1].mul_(-1)  # a member changed in place: the group is packed again
    assert torch.equal(graph(x, y, *weights, *keys)[1], F.linear(x, weights[1]) + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_second_engine_over_the_same_config_compiles_no_new_graph(dtype):
    """One backend object for every engine (the fusion pass inside it): dynamo reuses the first engine's graph.
    A backend made per engine recompiled every engine, and a test run hit dynamo's recompile limit. bfloat16: the
    linears are packed (each model's own pack keys, buffers of the graph) and fused."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    first = PagedEngine(tiny_model("llama").to(dtype), None, **STEADY)
    tokens(first, GREEDY)
    before = counters["stats"]["unique_graphs"]
    second = PagedEngine(tiny_model("llama").to(dtype), None, **STEADY)
    tokens(second, GREEDY)
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_store_writes_each_row_to_its_slot_and_refuses_a_slot_outside_the_pool(dtype):
    """The C++ store equals ``index_copy_`` into the flattened pools (K/V given in another dtype are converted), and
    a slot past the pool's end fails naming it, writing nothing out of bounds."""
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.zeros(6, 4, 2, 8, dtype=dtype) for _ in range(2))
    key, value = (torch.randn(5, 2, 8, generator=generator) for _ in range(2))
    slots = torch.tensor([3, 0, 23, 9, 17])
    store, bind = torch.ops.paged_hf_cpu.store, torch.ops.paged_hf_cpu.bind_pools
    bind([keys], [values])
    try:
        store(key, value, slots, 0)
        for pool, rows in ((keys, key), (values, value)):
            want = torch.zeros(24, 2, 8, dtype=dtype).index_copy_(0, slots, rows.to(dtype))
            assert torch.equal(pool.view(24, 2, 8), want)
        with pytest.raises(RuntimeError, match="slot 24 outside"):
            store(key[:1], value[:1], torch.tensor([24]), 0)
    finally:
        bind([], [])
