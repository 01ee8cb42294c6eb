"""The engine's compiled forward (``engine/compile.py``, ``paged_hf.ops``): on by default, used at every step, no
recompile in steady serving, the same greedy tokens as the eager engine and as generate + DynamicCache, in every KV
format; a model that does not compile runs eagerly with a warning; ``enforce_eager=True`` (engine and ``LLM``) turns
it off."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.exc import Unsupported
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from paged_hf import LLM, PagedEngine, SamplingParams, ops
from paged_hf.config import EngineConfig
from paged_hf.engine import compile as compile_module
from paged_hf.engine.compile import WARMUP_STEPS, CompiledForward
from models import tiny_model
from test_engine_families import prompts, references

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Chunks, block boundaries, table widths 1..8, decode-only and mixed steps, one and many sequences.
STEADY = dict(block_size=4, num_blocks=128, max_num_batched_tokens=9)


def tokens(engine: PagedEngine, params=GREEDY) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in engine.generate(prompts(), params, use_tqdm=False)]


class CountingCompiled:
    """Wraps a ``CompiledForward``'s compiled callable: counts the forwards that ran through it."""

    def __init__(self, compiled: CompiledForward) -> None:
        self.inner, self.calls = compiled.compiled, 0
        compiled.compiled = self

    def __call__(self, **inputs):
        self.calls += 1
        return self.inner(**inputs)


def graphs_during(engine: PagedEngine, params=GREEDY, **kwargs) -> tuple[int, int, list[list[int]]]:
    """(graphs compiled, forwards run compiled, tokens) of one ``generate`` on ``engine``, every dynamo guard
    evaluated at every forward and recompiles made errors (so a recompile cannot hide behind the eager fallback)."""
    assert engine.runner.compiled is not None, "the engine must have compiled its forward"
    counting = CountingCompiled(engine.runner.compiled)
    before = counters["stats"]["unique_graphs"]
    engine.runner.compiled.evaluate_guards = True
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = tokens(engine, params)
    assert engine.runner.compiled is not None, "the compiled forward fell back to eager during steady serving"
    return counters["stats"]["unique_graphs"] - before, counting.calls, out


@pytest.fixture(autouse=True)
def size_asserts(monkeypatch):
    """The compiled graphs check every custom op's output sizes and strides against its fake, as the engine's do
    not (``compile._INDUCTOR_SETTINGS``): a fake that disagrees with its op's layout gives wrong values, no error."""
    monkeypatch.setitem(compile_module._INDUCTOR_SETTINGS, "size_asserts", True)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "qwen3_moe", "phi", "gpt_neox"])
def test_compiled_engine_equals_eager_and_generate(family):
    """kv_cache_dtype="auto": greedy tokens compiled == eager == generate + DynamicCache (dense attention)."""
    model = tiny_model(family)
    expected = [t for t, _ in references(family)]
    compiled = PagedEngine(model, None, **STEADY)
    new_graphs, calls, got = graphs_during(compiled)
    assert got == expected
    assert tokens(PagedEngine(model, None, enforce_eager=True, **STEADY)) == expected
    assert calls > 5 and new_graphs == 0


@pytest.mark.parametrize("block_size", [1, 2])
def test_the_warm_up_fits_its_scratch_pool_at_any_block_size(block_size):
    """The warm-up's steps run on a scratch pool of their own: at one or two tokens a block they need more blocks
    than a 16-token block's 16 (a compiled engine with block_size=1 failed to build, "need 6 free KV blocks")."""
    model = tiny_model("llama")
    options = dict(block_size=block_size, num_blocks=512, max_num_batched_tokens=9)
    compiled = PagedEngine(model, None, **options)
    new_graphs, calls, got = graphs_during(compiled)
    assert got == tokens(PagedEngine(model, None, enforce_eager=True, **options)) and calls > 5 and new_graphs == 0


@pytest.mark.parametrize("family, kv_cache_dtype", [("llama", "int8"), ("llama", "int4"), ("llama", "fp8"),
                                                    ("phi", "int8")])
def test_compiled_quantized_formats_equal_eager(family, kv_cache_dtype):
    """A quantized pool (int4: the tail rows written after the attention reads them) gives the eager tokens; Phi's
    head-major query through the Python ops."""
    model = tiny_model(family)
    options = dict(STEADY, kv_cache_dtype=kv_cache_dtype)
    eager = tokens(PagedEngine(model, None, enforce_eager=True, **options))
    new_graphs, calls, got = graphs_during(PagedEngine(model, None, **options))
    assert got == eager and calls > 5 and new_graphs == 0


@pytest.mark.parametrize("packing", ["1", "all"])
def test_steady_serving_uses_the_warm_up_graph_and_never_recompiles(caplog, monkeypatch, packing):
    """The warm-up compiles one graph (log line) and every later step, whatever its token, sequence, decode and
    block-table counts, runs it: no new graph, no recompile, every forward compiled. ``all``: the float32 linears
    packed, so the compiled graph runs the fused q/k/v and gate/up products (``FusePackedLinears``)."""
    monkeypatch.setenv("PAGED_HF_PACKED_LINEAR", packing)
    torch.compiler.reset()
    before = counters["stats"]["unique_graphs"]
    with caplog.at_level(logging.INFO, logger="paged_hf"):
        engine = PagedEngine(tiny_model("llama", seed=3), None, **STEADY)
    assert counters["stats"]["unique_graphs"] - before == 1
    assert any("compiled the forward in" in r.message for r in caplog.records)
    mixed = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 5, 17, 3, 30, 9)]
    new_graphs, calls, _ = graphs_during(engine, mixed)
    assert new_graphs == 0
    assert calls >= 30


@pytest.fixture(scope="module")
def warm_up_kernels() -> list[str]:
    """The C++ kernels the warm-up of an engine over a two-layer llama compiles (dynamo reset, no graph cache)."""
    with torch._inductor.config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(PagedEngine, tiny_model("llama", num_hidden_layers=2), None, **STEADY)
    kernels = [part.split("''')")[0] for code in codes for part in code.split("async_compile.cpp_pybinding(")[1:]]
    assert kernels, "the warm-up compiled no C++ kernel"
    return kernels


def test_every_compiled_kernel_splits_its_work_over_the_intra_op_threads(warm_up_kernels):
    """Each of the compiled forward's kernels opens an OpenMP region sized at run time (inductor's
    ``cpp.dynamic_threads``). Without it inductor sizes a kernel's parallelism by the first warm-up step's token
    count (a decode: one token) and compiles the norms, the rotary embedding and the residual adds serial, whatever
    a later step's token count: one core of two idle through them (SmolLM2 bf16: 5-8% of a prefill or mixed run)."""
    serial = sum("#pragma omp parallel" not in kernel for kernel in warm_up_kernels)
    assert serial == 0, f"{serial} of {len(warm_up_kernels)} compiled kernels run on one thread"


def test_the_rotary_tables_are_computed_once_a_step(warm_up_kernels):
    """One kernel evaluates the rotary cos/sin (``RealizeRotaryTables``); without the pass inductor inlines them into
    the q and the k rotation kernels, which every layer runs (2 kernels here), per head."""
    assert sum("cos(" in kernel for kernel in warm_up_kernels) == 1


def test_the_recompile_check_catches_a_baked_step_count(monkeypatch, caplog):
    """The check above fails when a per-step Python value reaches the graph: here the store reads ``num_decodes``
    as an int (dynamo guards on it), so the next step with another count recompiles."""
    engine = PagedEngine(tiny_model("llama"), None, **STEADY)
    store_layer = ops.store_layer

    def baking_store(metadata, group, layer, key_states, value_states, num_decodes, native=False):
        return store_layer(metadata, group, layer, key_states + metadata.num_decodes * 0.0, value_states,
                           num_decodes, native)

    monkeypatch.setattr(ops, "store_layer", baking_store)
    with pytest.raises(AssertionError, match="fell back to eager"):
        graphs_during(engine)
    assert "RecompileError" in caplog.text, "the fallback must come from the recompile, not another failure"


def test_steady_steps_skip_the_guards_the_warm_up_checked():
    """Every warm-up forward evaluates all of dynamo's guards; the steps after it, with the model unchanged, run
    under ``skip_guard_eval_unsafe`` (the test above shows they pass every guard), with the eager tokens."""
    model = tiny_model("llama")
    eager = tokens(PagedEngine(model, None, enforce_eager=True, **STEADY))
    engine = PagedEngine(model, None, **STEADY)
    compiled = engine.runner.compiled
    assert compiled.full_checks == len(WARMUP_STEPS)
    counting = CountingCompiled(compiled)
    assert tokens(engine) == eager
    assert counting.calls > 5 and compiled.full_checks == len(WARMUP_STEPS)


def test_the_pack_keys_stay_out_of_the_guards_every_step_checks(monkeypatch):
    """Under the skipped guards dynamo still checks, at every forward, each tensor input it guards by value (its
    metadata, and that no two alias): the step's own tensors. A packed linear's key buffer held as a plain tensor
    joined them (211 keys: 0.68 ms of a SmolLM2 bfloat16 decode step); held as an ``nn.Parameter``, it is checked
    by its dict's tag with the weights. The keys are still graph inputs: a second model's engine runs the same graph
    on its own keys (``test_compiled_cpu_ops.py``)."""
    monkeypatch.setenv("PAGED_HF_PACKED_LINEAR", "all")
    torch.compiler.reset()  # graphs earlier tests left on the class's forward add their own entries
    model = tiny_model("llama", seed=3)
    engine = PagedEngine(model, None, **STEADY)
    keys = [name for name, _ in model.named_buffers() if name.endswith("_pack_key")]
    assert len(keys) == 7 * model.config.num_hidden_layers + 1, "every linear packed (and the head)"
    assert not any(name.endswith("_pack_key") for name in dict(model.named_parameters()))
    assert not any("_pack_key" in name for name in model.state_dict())
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(type(model).forward.__code__)
    assert len(entries) == 1
    checked = entries[0].guard_manager.diff_guard_sources
    assert not [source for source in checked if "_pack_key" in source]
    assert len(checked) < 40, sorted(checked)
    assert engine.runner.compiled is not None


def test_a_hook_added_or_removed_after_the_warm_up_is_honoured():
    """A hook registered after the warm-up runs at every later forward, and stops when removed: each change makes
    the next forward check every guard (which compiles the hook in, or picks the graph without it)."""
    model = tiny_model("llama")
    eager = tokens(PagedEngine(model, None, enforce_eager=True, **STEADY))
    engine = PagedEngine(model, None, **STEADY)
    counting = CountingCompiled(engine.runner.compiled)
    seen = []
    handle = model.get_input_embeddings().register_forward_pre_hook(lambda module, args: seen.append(1))
    assert tokens(engine) == eager
    assert len(seen) == counting.calls > 5
    handle.remove()
    checks, calls = engine.runner.compiled.full_checks, counting.calls
    assert tokens(engine) == eager
    assert len(seen) == calls, "a removed hook ran"
    assert engine.runner.compiled.full_checks == checks + 1 and counting.calls > calls + 5


class _ShiftedNorm(torch.nn.Module):
    """An RMS norm with the same weight, shifted by one after it: another module class in the norm's place."""

    def __init__(self, norm) -> None:
        super().__init__()
        self.weight, self.norm = norm.weight, norm

    def forward(self, hidden):
        return self.norm(hidden) + 1.0


def test_the_engine_binds_pools_it_built_once():
    """The compiled forward binds the pools its cache built at the first forward (no pass over the layers a step),
    every layer's, and nothing stays bound after a step."""
    engine = PagedEngine(tiny_model("llama"), None, **STEADY)
    tokens(engine)
    cache = engine.runner.cache
    bound = cache.pools()
    assert bound is cache.pools() and sorted(bound.storages) == sorted(engine.kv.group_of)
    assert getattr(ops._bound, "pools", None) is None


def test_a_module_replaced_after_the_warm_up_gets_a_graph_of_its_own():
    """Assigning a submodule through the module API makes the next forward check every guard: the old graph
    (which would read the same ``weight`` and skip the shift) is not run for the new module."""
    model = tiny_model("llama")
    engine = PagedEngine(model, None, **STEADY)
    before = tokens(engine)
    model.model.norm = _ShiftedNorm(model.model.norm)
    eager = tokens(PagedEngine(model, None, enforce_eager=True, **STEADY))
    assert eager != before, "the shift must change the tokens"
    assert tokens(engine) == eager


def test_a_parameter_converted_in_place_or_the_mode_switched_is_seen():
    """``model.to`` converts parameters in place and ``model.train()`` sets a flag (no module edit either): a
    conversion anywhere (``Module._apply``) and the mode are part of what is compared, and the next forward checks
    every guard, running the converted model's own graph."""
    model = tiny_model("llama")
    engine = PagedEngine(model, None, **STEADY)
    compiled = engine.runner.compiled
    before = tokens(engine)
    state = compiled._state()
    model.lm_head.to(torch.float64)
    assert compiled._state() != state
    state = compiled._state()
    model.lm_head.to(torch.float32)
    assert compiled._state() != state
    state = compiled._state()
    model.train()
    assert compiled._state() != state
    model.eval()
    assert compiled._state() == state
    torch.nn.Linear(2, 2).to(torch.float64)  # any module's conversion counts: the check is global
    assert compiled._state() != state
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # an in-place change of values: the graph reads the parameter itself
    checks = compiled.full_checks
    flipped = tokens(engine)
    assert compiled.full_checks == checks + 1, "a forward after conversions checks every guard, once"
    assert flipped != before and flipped == tokens(PagedEngine(model, None, enforce_eager=True, **STEADY))


def test_a_size_the_warm_up_did_not_see_compiles_its_graph(monkeypatch):
    """A forward with a size guard (here the store scales K for steps of more than 8 tokens; the warm-up's steps
    have at most 7) fails it under the skipped guards: dynamo raises before anything ran, and the forward runs again
    with every guard, compiling the second graph. The tokens are the eager ones (same patched store)."""
    store_layer = ops.store_layer

    def branching_store(metadata, group, layer, key_states, value_states, num_decodes, native=False):
        if key_states.shape[-2] > 8:
            key_states = key_states * 1.5
        return store_layer(metadata, group, layer, key_states, value_states, num_decodes, native)

    monkeypatch.setattr(ops, "store_layer", branching_store)
    model = tiny_model("llama")
    long_prompts = [list(range(3, 3 + n)) for n in (12, 20, 5)]
    eager_engine = PagedEngine(model, None, enforce_eager=True, **STEADY)
    eager = [o.outputs[0].token_ids for o in eager_engine.generate(long_prompts, GREEDY, use_tqdm=False)]
    engine = PagedEngine(model, None, **STEADY)
    got = [o.outputs[0].token_ids for o in engine.generate(long_prompts, GREEDY, use_tqdm=False)]
    assert got == eager
    assert engine.runner.compiled is not None and engine.runner.compiled.full_checks > len(WARMUP_STEPS)


def test_a_forward_the_stance_refuses_makes_every_later_forward_check_its_guards(caplog):
    """A skipped-guard forward that dynamo fails (as when a Python frame it has no graph for runs inside the call:
    "found no compiled frames") switches the engine to every guard at every forward; the runner's isolation runs
    the step again, so no request fails. Here every skipped-guard call fails: without the switch every step would,
    and every request with it."""
    model = tiny_model("llama")
    eager = tokens(PagedEngine(model, None, enforce_eager=True, **STEADY))
    engine = PagedEngine(model, None, **STEADY)
    compiled = engine.runner.compiled
    inner = compiled.compiled
    refused = []

    def refusing(**inputs):
        outputs = inner(**inputs)
        if torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe:
            refused.append(inputs["input_ids"].shape[1])
            raise RuntimeError("torch.compile with fullgraph=True found no compiled frames.")
        return outputs

    compiled.compiled = refusing
    with caplog.at_level(logging.WARNING, logger="paged_hf"):
        outs = engine.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(outs)
    assert [o.outputs[0].token_ids for o in outs] == eager
    assert len(refused) == 1 and compiled.evaluate_guards and engine.runner.compiled is compiled
    assert any("evaluates every guard" in r.message for r in caplog.records)


def test_engines_over_two_models_of_one_class_each_run_their_own_graph():
    """Two models of one class share the code object dynamo caches graphs on; here the second one's norm is another
    module with the same ``weight`` (the first graph would run on it, silently skipping the shift). The second
    engine's warm-up fails the first graph's guard on the norm, and dynamo keeps checking guards on what once failed
    under the skipped guards, so alternating steps of the two engines each run their own model's graph."""
    first, second = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    second.model.norm = _ShiftedNorm(second.model.norm)
    eager = [tokens(PagedEngine(m, None, enforce_eager=True, **STEADY)) for m in (first, second)]
    assert eager[0] != eager[1], "the two models must differ"
    engines = [PagedEngine(m, None, **STEADY) for m in (first, second)]
    for _ in range(2):
        assert [tokens(engine) for engine in engines] == eager
    assert all(engine.runner.compiled is not None for engine in engines)


class _Unsupported(torch.nn.Module):
    """A block that dynamo cannot put in one graph (an explicit graph break) in front of the model's forward."""

    def __init__(self, model) -> None:
        super().__init__()
        self.inner = model

    def forward(self, hidden):
        torch._dynamo.graph_break()
        return self.inner(hidden)


def test_a_model_that_does_not_compile_runs_eagerly_with_a_warning(caplog):
    model = tiny_model("llama")
    eager = tokens(PagedEngine(model, None, enforce_eager=True, **STEADY))
    model.model.norm = _Unsupported(model.model.norm)
    with caplog.at_level(logging.WARNING, logger="paged_hf"):
        engine = PagedEngine(model, None, **STEADY)
    assert engine.runner.compiled is None
    assert any("cannot compile" in r.message for r in caplog.records)
    assert tokens(engine) == eager


def test_a_torch_that_cannot_compile_the_forward_runs_it_eagerly(caplog, monkeypatch):
    """torch 2.7 compiles a graph that decodes wrong tokens and 2.6 lacks settings the compiled forward patches (a
    patch of a missing setting crashed the engine's start): the engine says why and runs eagerly. Here a setting
    this torch lacks stands in for the second, and a later floor for the first."""
    assert compile_module.why_not_compiled() is None, "this torch compiles the forward"
    needed = compile_module._NEEDED_SETTINGS
    monkeypatch.setattr(compile_module, "_NEEDED_SETTINGS",
                        ((needed[0][0], needed[0][1], (*needed[0][2], "a_setting_of_a_later_torch")), *needed[1:]))
    assert compile_module.why_not_compiled().endswith("lacks torch._dynamo.config.a_setting_of_a_later_torch")
    model = tiny_model("llama")
    eager = tokens(PagedEngine(model, None, enforce_eager=True, **STEADY))
    with caplog.at_level(logging.WARNING, logger="paged_hf"):
        engine = PagedEngine(model, None, **STEADY)
    assert engine.runner.compiled is None
    assert any("cannot compile" in r.message and "a_setting_of_a_later_torch" in r.message for r in caplog.records)
    assert tokens(engine) == eager
    monkeypatch.undo()
    monkeypatch.setattr(compile_module, "COMPILE_FLOOR", "99.0")
    assert "older than 99.0" in compile_module.why_not_compiled()
    assert PagedEngine(model, None, **STEADY).runner.compiled is None


def test_a_compile_failure_after_warm_up_falls_back_to_eager(caplog):
    model = tiny_model("llama")
    engine = PagedEngine(model, None, **STEADY)
    eager = tokens(PagedEngine(model, None, enforce_eager=True, **STEADY))

    def failing(**inputs):
        raise Unsupported("a shape the warm-up did not see fails to compile")

    engine.runner.compiled.compiled = failing
    with caplog.at_level(logging.WARNING, logger="paged_hf"):
        got = tokens(engine)
    assert got == eager, "no request may fail for a compile error"
    assert engine.runner.compiled is None
    assert any("runs eagerly from now on" in r.message for r in caplog.records)


def test_enforce_eager_turns_compile_off():
    model = tiny_model("llama")
    assert PagedEngine(model, None, enforce_eager=True, num_blocks=16).runner.compiled is None
    assert PagedEngine(model, None, num_blocks=16).runner.compiled is not None
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes")


def test_llm_honours_enforce_eager():
    model = tiny_model("llama")
    assert LLM(model, skip_tokenizer_init=True, enforce_eager=True, num_blocks=16).llm_engine.runner.compiled is None
    assert LLM(model, skip_tokenizer_init=True, num_blocks=16).llm_engine.runner.compiled is not None


def test_tensor_parallel_runs_eagerly_on_every_rank():
    """A follower builds its runner eagerly, and so does the leader under tensor parallelism (a warm-up forward
    runs collectives; a compile failing on one rank only would split the ranks' forwards)."""
    from paged_hf.engine.worker import follower_runner

    class OneRankGroup:
        size = 1

        def min(self, value):
            return value

    runner = follower_runner(tiny_model("llama"), {"num_blocks": 16}, OneRankGroup())
    assert runner.compiled is None
