"""The padded static decode path of CUDA graphs, proven on CPU (``engine/static_decode.py``,
``engine/cuda_graphs.py``): ``PAGED_HF_STATIC_DECODE=1`` runs every decode-only step at its bucket size through the
static buffers (no graph on CPU), padded rows writing the scratch block only. Greedy tokens (and logprobs) equal the
normal path's on stories260K and tiny random models, in every format, eager and compiled, through prefix hits, forks
and preemption, and for random batches (hypothesis); the pool keeps its size and its invariants; the switches
(``enforce_eager``, ``cudagraph_mode``, ``cudagraph_capture_sizes``) and a capture that fails behave as documented.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

from paged_hf import LLM, PagedEngine, SamplingParams
from paged_hf.config import EngineConfig
from paged_hf.engine import engine as engine_module
from paged_hf.engine.cuda_graphs import STATIC_DECODE_ENV, DecodeGraphs, GraphOptions, graph_options
from paged_hf.engine.runner import ModelRunner
from paged_hf.engine.static_decode import StaticDecode, capture_sizes
from models import stories_model, stories_tokenizer, story_openings, tiny_model
from test_engine_families import prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
SMALL = dict(block_size=4, num_blocks=128, max_num_batched_tokens=9, max_num_seqs=8)
LOGPROB_TOL = 1e-5  # a padded batch runs its GEMMs at another row count: the same tokens, float noise at most


class Loads:
    """Records ``(S, B)`` of every decode step the static path runs."""

    def __init__(self, monkeypatch) -> None:
        self.steps: list[tuple[int, int]] = []
        load = StaticDecode.load

        def recording(bucket, input_ids, metadata):
            self.steps.append((metadata.num_seqs, bucket.size))
            return load(bucket, input_ids, metadata)

        monkeypatch.setattr(StaticDecode, "load", recording)

    @property
    def padded(self) -> int:
        return sum(s < b for s, b in self.steps)


def outputs(engine: PagedEngine, requests, params=GREEDY) -> list[tuple]:
    outs = engine.generate(requests, params, use_tqdm=False)
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0
    return [[(c.token_ids, [e[t].logprob for e, t in zip(c.logprobs, c.token_ids)] if c.logprobs else None)
             for c in out.outputs] for out in outs]


def assert_same(normal, static) -> None:
    assert [[c[0] for c in out] for out in static] == [[c[0] for c in out] for out in normal]
    for a, b in zip(normal, static):
        for (_, x), (_, y) in zip(a, b):
            if x is not None:
                assert torch.allclose(torch.tensor(y), torch.tensor(x), atol=LOGPROB_TOL, rtol=0)


def both(monkeypatch, make_model, requests, params=GREEDY, tokenizer=None, **options):
    """(normal outputs, static outputs, the static path's loads) of two engines over fresh models."""
    monkeypatch.delenv(STATIC_DECODE_ENV, raising=False)
    normal_engine = PagedEngine(make_model(), tokenizer, **options)
    assert normal_engine.runner.graphs is None
    normal = outputs(normal_engine, requests, params)
    monkeypatch.setenv(STATIC_DECODE_ENV, "1")
    static_engine = PagedEngine(make_model(), tokenizer, **options)
    assert static_engine.runner.graphs is not None and not static_engine.runner.graphs.graphs
    loads = Loads(monkeypatch)
    static = outputs(static_engine, requests, params)
    return normal, static, loads


@pytest.mark.parametrize("kv_format", ["auto", "int8", "int4"])
def test_stories260k_static_decode_equals_the_normal_path(monkeypatch, kv_format):
    tok = stories_tokenizer()
    normal, static, loads = both(monkeypatch, lambda: stories_model("paged"), story_openings()[:6],
                                 SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0), tok,
                                 kv_cache_dtype=kv_format, block_size=16, num_blocks=64, max_num_seqs=8,
                                 max_num_batched_tokens=64, enforce_eager=True)
    assert_same(normal, static)
    assert loads.padded > 0, loads.steps


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
@pytest.mark.parametrize("kv_format", ["auto", "int8", "int4"])
def test_tiny_llama_static_decode_equals_the_normal_path(monkeypatch, kv_format, enforce_eager):
    normal, static, loads = both(monkeypatch, lambda: tiny_model("llama"), prompts(), kv_cache_dtype=kv_format,
                                 enforce_eager=enforce_eager, **SMALL)
    assert_same(normal, static)
    assert loads.padded > 0 and {b for _, b in loads.steps} >= {1, 2, 4, 8}, loads.steps


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_windows_and_softcaps_static_decode_equals_the_normal_path(monkeypatch, family):
    normal, static, loads = both(monkeypatch, lambda: tiny_model(family), prompts(), enforce_eager=True, **SMALL)
    assert_same(normal, static)
    assert loads.padded > 0


@pytest.mark.parametrize("kv_format", ["auto", "int4"])
def test_forks_prefix_hits_and_preemption_through_the_static_path(monkeypatch, kv_format):
    """n > 1 (copy-on-write of a shared tail), a shared prefix (hits) and a pool too small for every sequence
    (preemption), seeded sampling: the padded rows never touch a real block."""
    shared = prompts()[3][:9]
    requests = [shared + p[:5] for p in prompts()]
    params = SamplingParams(n=2, max_tokens=10, temperature=0.8, seed=7, ignore_eos=True, logprobs=0)
    normal, static, loads = both(monkeypatch, lambda: tiny_model("llama"), requests, params,
                                 kv_cache_dtype=kv_format, enforce_eager=True, block_size=4, num_blocks=24,
                                 max_num_batched_tokens=16, max_num_seqs=8, swap_space=0.01)
    assert_same(normal, static)
    assert loads.padded > 0


def test_the_compiled_static_path_does_not_recompile(monkeypatch):
    monkeypatch.setenv(STATIC_DECODE_ENV, "1")
    engine = PagedEngine(tiny_model("llama"), None, **SMALL)
    loads = Loads(monkeypatch)
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        outputs(engine, prompts())
    assert engine.runner.compiled is not None
    assert counters["stats"]["unique_graphs"] == before
    assert {b for _, b in loads.steps} >= {1, 2, 4, 8}


def test_the_scratch_block_is_outside_the_pool(monkeypatch):
    monkeypatch.setenv(STATIC_DECODE_ENV, "1")
    engine = PagedEngine(tiny_model("llama"), None, kv_cache_dtype="int4", enforce_eager=True, **SMALL)
    assert engine.get_stats()["kv_cache_total"] == SMALL["num_blocks"]
    for group in engine.kv.groups:
        assert group.pool.num_blocks == SMALL["num_blocks"]
        for storage in group.storages.values():
            assert all(t.shape[0] == SMALL["num_blocks"] + 1 for t in storage.tensors().values())
    outputs(engine, prompts())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 14), min_size=1, max_size=8), max_tokens=st.integers(1, 9),
       sizes=st.one_of(st.none(), st.sets(st.integers(1, 8), min_size=1, max_size=4)),
       kv_format=st.sampled_from(["auto", "int8", "int4"]))
def test_random_batches_equal_the_normal_path(monkeypatch, lengths, max_tokens, sizes, kv_format):
    generator = torch.Generator().manual_seed(len(lengths) * 31 + max_tokens)
    requests = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    options = dict(SMALL, kv_cache_dtype=kv_format, enforce_eager=True,
                   cudagraph_capture_sizes=None if sizes is None else sorted(sizes))
    with monkeypatch.context() as patch:
        normal, static, loads = both(patch, lambda: tiny_model("llama", num_hidden_layers=2), requests, params,
                                     **options)
    assert_same(normal, static)
    largest = max(capture_sizes(SMALL["max_num_seqs"], options["cudagraph_capture_sizes"]))
    assert all(s <= b <= largest for s, b in loads.steps)


def test_a_capture_that_fails_warns_and_the_steps_run_as_usual(monkeypatch, caplog):
    """On CPU a capture cannot work (no CUDA): forced to try, the engine warns and runs its decode steps unpadded."""
    monkeypatch.setattr(engine_module, "graph_options", lambda config, device, max_model_len: GraphOptions(
        capture_sizes(config.max_num_seqs), max_model_len, capture=True))
    with caplog.at_level(logging.WARNING, logger="paged_hf"):
        engine = PagedEngine(tiny_model("llama"), None, enforce_eager=True, **SMALL)
    assert "capturing the CUDA graphs of decode steps failed" in caplog.text
    assert engine.runner.graphs is not None and not engine.runner.graphs.graphs
    monkeypatch.delenv(STATIC_DECODE_ENV, raising=False)
    reference = outputs(PagedEngine(tiny_model("llama"), None, enforce_eager=True, **SMALL), prompts())
    loads = Loads(monkeypatch)
    assert_same(reference, outputs(engine, prompts()))
    assert not loads.steps


class StandInCuda:
    """``torch.cuda``'s graph API played on the CPU: a "graph" keeps the forward run inside its capture and replays
    it by running it again into the captured output. What it checks is the engine's side: capture after the warm-up,
    one graph per bucket, the step loaded before the replay, the output read from the captured tensor, capturing
    again (mid-serving) when the tail pools move."""

    def __init__(self, monkeypatch) -> None:
        self.capturing = None
        self.replays = 0
        self.fail = False  # the next captures raise, as one with a host sync inside would
        stand_in = self

        class Graph:
            def replay(self):
                stand_in.replays += 1
                run, bucket, out = self.captured
                out.copy_(run(bucket))

        class Stream:
            def wait_stream(self, other):
                pass

        @contextlib.contextmanager
        def graph(captured, pool=None, stream=None):
            if stand_in.fail:
                raise RuntimeError("operation not permitted when stream is capturing")
            stand_in.capturing = captured
            try:
                yield
            finally:
                stand_in.capturing = None

        api = dict(CUDAGraph=Graph, graph=graph, graph_pool_handle=lambda: None, Stream=lambda device=None: Stream(),
                   stream=lambda s: contextlib.nullcontext(), current_stream=lambda device=None: Stream(),
                   synchronize=lambda device=None: None)
        for name, value in api.items():
            monkeypatch.setattr(torch.cuda, name, value)
        forward = ModelRunner._static_forward

        def static_forward(runner, bucket):
            out = forward(runner, bucket)
            if stand_in.capturing is not None:
                stand_in.capturing.captured = (lambda b: forward(runner, b), bucket, out)
            return out

        monkeypatch.setattr(ModelRunner, "_static_forward", static_forward)


@pytest.mark.parametrize("kv_format, recapture_fails", [("auto", False), ("int4", False), ("int4", True)],
                         ids=["auto", "int4", "int4-recapture-fails"])
def test_capture_and_replay_on_a_stand_in_for_cuda(monkeypatch, caplog, kv_format, recapture_fails):
    """int4: the tail pools grow in the middle of the run, so the graphs are captured again between two decode
    steps of live sequences (whose K/V the capture's warm-up forwards must not touch); when that capture fails, the
    run goes on without graphs, with the same tokens (only int4's tail pools move)."""
    monkeypatch.delenv(STATIC_DECODE_ENV, raising=False)
    options = dict(SMALL, kv_cache_dtype=kv_format, enforce_eager=True)
    reference = outputs(PagedEngine(tiny_model("llama"), None, **options), prompts())
    stand_in = StandInCuda(monkeypatch)
    monkeypatch.setattr(engine_module, "graph_options", lambda config, device, max_model_len: GraphOptions(
        capture_sizes(config.max_num_seqs), max_model_len, capture=True))
    with caplog.at_level(logging.INFO, logger="paged_hf"):
        engine = PagedEngine(tiny_model("llama"), None, **options)
        assert "captured CUDA graphs of decode steps at batch sizes [1, 2, 4, 8]" in caplog.text
        assert sorted(engine.runner.graphs.graphs) == [1, 2, 4, 8]
        run, calls = DecodeGraphs.run, []

        def growing(graphs, *args):
            calls.append(len(calls))
            if len(calls) == 16 and kv_format == "int4":  # decode-only steps of live sequences around it
                for group in engine.kv.groups:
                    for storage in group.storages.values():
                        storage.ensure_tail_rows(64)
                stand_in.fail = recapture_fails
            return run(graphs, *args)

        monkeypatch.setattr(DecodeGraphs, "run", growing)
        assert_same(reference, outputs(engine, prompts()))
    assert stand_in.replays >= (3 if recapture_fails else 8)  # a failed recapture: no replay after it
    assert ("capturing the decode graphs again" in caplog.text) == (kv_format == "int4")
    assert ("capturing the CUDA graphs of decode steps failed" in caplog.text) == recapture_fails
    assert bool(engine.runner.graphs.graphs) != recapture_fails


def test_the_switches(monkeypatch):
    monkeypatch.delenv(STATIC_DECODE_ENV, raising=False)
    cuda = torch.device("cuda")  # only a device name here: graph_options decides without touching it
    assert graph_options(EngineConfig(max_num_seqs=20), cuda, 64) == GraphOptions((1, 2, 4, 8, 16, 20), 64, True)
    assert graph_options(EngineConfig(enforce_eager=True), cuda, 64) is None
    assert graph_options(EngineConfig(cudagraph_mode="NONE"), cuda, 64) is None
    assert graph_options(EngineConfig(), "cpu", 64) is None
    sized = EngineConfig(max_num_seqs=6, cudagraph_capture_sizes=[4, 1, 16, 4])
    assert sized.cudagraph_capture_sizes == (1, 4, 16)
    assert graph_options(sized, cuda, 64).sizes == (1, 4)
    monkeypatch.setenv(STATIC_DECODE_ENV, "1")
    assert graph_options(EngineConfig(enforce_eager=True), "cpu", 64) == GraphOptions(
        capture_sizes(256), 64, False)
    assert graph_options(EngineConfig(), cuda, 64).capture is False  # the static path alone, on any device
    monkeypatch.setenv(STATIC_DECODE_ENV, "yes")
    with pytest.raises(ValueError, match=STATIC_DECODE_ENV):
        graph_options(EngineConfig(), "cpu", 64)
    assert capture_sizes(1) == (1,) and capture_sizes(8) == (1, 2, 4, 8) and capture_sizes(9)[-2:] == (8, 9)


@pytest.mark.parametrize("options, field", [
    (dict(cudagraph_mode="FULL"), "cudagraph_mode"), (dict(cudagraph_mode=None), "cudagraph_mode"),
    (dict(cudagraph_capture_sizes=[]), "cudagraph_capture_sizes"),
    (dict(cudagraph_capture_sizes=[0, 2]), "cudagraph_capture_sizes"),
    (dict(cudagraph_capture_sizes="1,2"), "cudagraph_capture_sizes"),
    (dict(cudagraph_capture_sizes=[True]), "cudagraph_capture_sizes"),
])
def test_bad_graph_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**options)



def test_llm_takes_vllms_compilation_config_for_graphs(tmp_path):
    llm = LLM(tiny_model("llama"), skip_tokenizer_init=True, enforce_eager=True, num_blocks=16,
              compilation_config={"cudagraph_mode": "NONE", "cudagraph_capture_sizes": [2, 1]})
    assert llm.llm_engine.config.cudagraph_mode == "NONE"
    assert llm.llm_engine.config.cudagraph_capture_sizes == (1, 2)
    with pytest.raises(ValueError, match=r"compilation_config keys \['level'\]"):
        LLM(str(tmp_path), compilation_config={"level": 3})
    with pytest.raises(ValueError, match="cudagraph_mode"):
        LLM(str(tmp_path), compilation_config={"cudagraph_mode": "PIECEWISE"})
    with pytest.raises(ValueError, match=r"\['cudagraph_mode'\] given both"):
        LLM(str(tmp_path), cudagraph_mode="NONE", compilation_config={"cudagraph_mode": "NONE"})
