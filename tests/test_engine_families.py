"""The engine beyond Llama: tiny Mistral (every layer a sliding window of 6) and Gemma2 (sliding and full layers
alternate, attention and final logit softcapping), and tiny Llama as the baseline, against ``generate`` +
``DynamicCache`` + the family's dense attention (sdpa; eager for Gemma2): greedy tokens and their logprobs, with
chunked prefill and preemption.

Prompts are longer than the window, so the sliding layers free blocks while a sequence runs; a preempted sequence
is recomputed (or swapped back) past its window.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from paged_hf import PagedEngine, SamplingParams, metadata
from models import greedy_references, tiny_model, token_logprobs

FAMILIES = ("llama", "mistral", "gemma2")  # llama: the full-attention baseline of the same checks
LENGTHS = (3, 9, 14, 20, 7, 17)
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in LENGTHS]


_references: dict = {}


def references(family: str) -> list[tuple[list[int], list[float]]]:
    """(greedy tokens, their logprobs) of each prompt alone, by generate on DynamicCache with the dense attention."""
    if family not in _references:
        _references[family] = greedy_references(tiny_model(family), prompts(), MAX_TOKENS)
    return _references[family]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"block_size": 4, "max_num_batched_tokens": 5},  # prompts cross chunk, block and window boundaries
        {"block_size": 4, "num_blocks": 10, "preemption_mode": "recompute", "max_num_batched_tokens": 7},
        {"block_size": 4, "num_blocks": 10, "preemption_mode": "swap", "swap_space": 0.001},
    ],
    ids=["default", "chunked", "recompute", "swap"],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_equals_generate(family, options):
    engine = PagedEngine(tiny_model(family), None, **{"num_blocks": 128, **options})
    outs = engine.generate(prompts(), GREEDY, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outs, references(family)):
        assert out.outputs[0].token_ids == tokens
        torch.testing.assert_close(token_logprobs(out.outputs[0]), logprobs, atol=2e-5, rtol=0)
    stats = engine.get_stats()
    if options.get("preemption_mode"):
        assert stats["preemption_count"] > 0, "the tiny pool must force preemption"
    if options.get("preemption_mode") == "swap":
        assert stats["num_swapped_out"] > 0 and stats["num_swapped_in"] == stats["num_swapped_out"]
    engine.check_invariants()
    assert stats["kv_cache_used"] == 0


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("family", ["gpt_neox", "falcon"])
def test_an_attention_that_updates_its_cache_without_kwargs(family, compiled):
    """GPT-NeoX and Falcon call ``cache.update`` without kwargs, so no step reaches their attention through them:
    the engine hands it over by layer index (``metadata.hand_step``), compiled and eager; tokens and logprobs equal
    generate's, chunked."""
    engine = PagedEngine(tiny_model(family), None, num_blocks=128, block_size=4, max_num_batched_tokens=5,
                         enforce_eager=not compiled)
    assert (engine.runner.compiled is not None) == compiled
    outs = engine.generate(prompts(), GREEDY, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outs, references(family)):
        assert out.outputs[0].token_ids == tokens
        torch.testing.assert_close(token_logprobs(out.outputs[0]), logprobs, atol=2e-5, rtol=0)
    engine.check_invariants()


def test_a_handed_step_no_attention_took_fails_the_forward():
    """A layer that stored its K/V without kwargs while an attention other than the paged one ran (its output
    would ignore the blocks): the step's forward fails, by name, and the request fails alone."""
    engine = PagedEngine(tiny_model("gpt_neox"), None, num_blocks=128, block_size=4, enforce_eager=True)
    with mock.patch("paged_hf.attention.take_step", lambda layer_idx: None):
        out = engine.generate([prompts()[0]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and "never read the paged blocks" in out.error


@pytest.mark.parametrize("family, reason", [
    ("mpt", "its attention is its own code"),  # transformers cannot switch its attention
    ("xglm", "its attention is its own code"),
    ("jetmoe", r"JetMoeAttention hands its attention K/V of 4 heads x 16 dims \(values 16\) but stored 2 heads"),
    ("diffllama", "DiffLlamaAttention hands its attention K/V other than those its cache update returned"),
])
def test_a_model_whose_attention_cannot_read_the_blocks_is_refused(family, reason):
    """An attention the paged blocks cannot serve gave wrong tokens from the first one, with no error: MPT and XGLM
    compute attention in their own code (on the update's new K/V alone), JetMoE tiles its K/V heads after storing
    them (its query heads map to KV heads unlike the paged kernels' groups), DiffLlama splits its values after
    storing them (the same shapes, other contents). The engine refuses them, by name."""
    with pytest.raises(NotImplementedError, match=f"PagedEngine cannot serve .*{reason}"):
        PagedEngine(tiny_model(family), None, num_blocks=64, enforce_eager=True)


def test_longrope_warns_that_a_step_shares_its_factors(caplog):
    """Phi-3's longrope picks short or long factors from a forward's longest position (as transformers and vLLM do):
    the engine says so at start where its context reaches past ``original_max_position_embeddings``."""
    import transformers

    factors = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}
    config = transformers.Phi3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     original_max_position_embeddings=32, rope_scaling=factors, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2)
    model = transformers.Phi3ForCausalLM(config).eval()
    with caplog.at_level("WARNING", logger="paged_hf"):
        PagedEngine(model, None, num_blocks=64, block_size=4, enforce_eager=True)
    assert "once a request of a step is past 32 tokens" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="paged_hf"):
        PagedEngine(model, None, num_blocks=64, block_size=4, enforce_eager=True, max_model_len=32)
    assert "longrope" not in caplog.text


def test_a_softcapped_model_keeps_its_plain_forward_after_an_engine_took_it():
    """The engine leaves the model on ``attn_implementation="paged"``; the model's own forward (no cache, no padding:
    sdpa's mask builder gives no mask, meaning causal) then attends through the dense fallback, which Gemma2's
    softcapping needs. It equals the eager forward: causal, not every token attending to the later ones."""
    model = tiny_model("gemma2", num_hidden_layers=1)
    ids = torch.tensor([prompts()[3]])
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        PagedEngine(model, None, num_blocks=16, block_size=4, enforce_eager=True)
        assert model.config._attn_implementation == "paged"
        torch.testing.assert_close(model(input_ids=ids).logits, reference)
        torch.testing.assert_close(model(input_ids=ids[:, :5]).logits, reference[:, :5])


def test_an_attention_that_never_reads_the_blocks_is_refused_at_start():
    """XGLM and MPT loaded with ``attn_implementation="paged"`` (their configs take the name, their code ignores
    it): layer 1's update finds layer 0's step untaken. ``generate`` on the ``PagedCache`` fails there instead of
    attending over the new tokens alone (with its own dense attention it equals ``DynamicCache``); the engine's
    first forward, before any request, refuses the model."""
    model = tiny_model("xglm")
    ids = torch.tensor([prompts()[2]])
    reference = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    dense = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0,
                           cache_implementation="paged")
    assert torch.equal(dense, reference)
    model.config._attn_implementation = "paged"
    with pytest.raises(metadata.AttentionBypassed, match=r"layers \[0\] stored their K/V .* never read the paged"):
        model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0,
                       cache_implementation="paged")
    mpt = tiny_model("mpt")
    mpt.config._attn_implementation = "paged"
    with pytest.raises(NotImplementedError, match=r"cannot serve MptForCausalLM: layers \[0\] stored their K/V"):
        PagedEngine(mpt, None, num_blocks=64, enforce_eager=True)


def test_generate_forgets_a_step_a_failed_forward_left_behind():
    """A forward that raised between a layer's update and its attention leaves that step handed over; the next
    forward ``PagedCache`` plans drops it, so no attention of a later forward takes it (``drop_handed_steps``)."""
    model = tiny_model("gpt_neox", "paged")
    stale = object()
    metadata.hand_step(7, stale)  # a layer index the model lacks: only the planning can drop it
    ids = torch.tensor([prompts()[0]])
    model.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="paged", pad_token_id=0)
    assert metadata.take_step(7) is None


def test_a_model_that_adds_cache_layers_in_its_forward_is_refused_by_name():
    """Dory runs its middle layers in loops and, at its first forward, appends to the cache copies of those layers'
    cache layers for the loops to write: the engine served wrong tokens from the second step on (the copies kept a
    copy of the engine's cache, its metadata stale), and ``generate`` on a paged cache failed with "used after its
    cache was dropped". Both now refuse it, by name."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415 - this test only

    config = AutoConfig.for_model("dory", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_input_layers=1,
                                  n_recurrent_layers=2, n_output_layers=1, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(NotImplementedError, match="PagedEngine cannot serve DoryForCausalLM: .*copied without its cache"):
        PagedEngine(model, None, num_blocks=64, enforce_eager=True)
    with pytest.raises(NotImplementedError, match="copied without its cache"):
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, do_sample=False, cache_implementation="paged")


def test_a_forward_that_grows_the_cache_is_refused_by_name():
    """Whatever a forward appends to the cache's layers (here a hook standing in for such a model), the engine,
    whose pools hold one layer per decoder layer, refuses the model at start."""
    from transformers.cache_utils import DummyLayer  # noqa: PLC0415

    model = tiny_model("llama")

    def grow(module, args, kwargs):
        kwargs["cache"].layers.append(DummyLayer())

    handle = model.model.register_forward_pre_hook(grow, with_kwargs=True)
    try:
        with pytest.raises(NotImplementedError, match="its forward adds layers to the cache"):
            PagedEngine(model, None, num_blocks=64, enforce_eager=True)
    finally:
        handle.remove()
