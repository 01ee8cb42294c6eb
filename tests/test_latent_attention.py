"""Multi-head latent attention (DeepSeek V2/V3, MiniCPM3, GLM-4 MoE Lite, Kimi Linear, ...): each layer caches one
row a token, the compressed latent and the rotary key (``kv_lora_rank + qk_rope_head_dim``), one head, which its
storage's value pools share (``KVStorage(shared_values=True)``). ``generate`` with a dense attention gets the latent
and the rotary key back, as from ``DynamicCache``; the paged attention folds the up-projection into the query and
the output (``latent_attention``) and attends over the rows as one KV head.

Tokens and logprobs must equal ``generate`` on ``DynamicCache`` + sdpa (tiny random models, weights drawn 10x wider
than the default so that a wrong fold shows; values narrower than the keys' no-rotary part).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from paged_hf import PagedCache, PagedEngine, SamplingParams
from paged_hf.kv.manager import KVManager
from paged_hf.kv.model_config import block_id_bytes
from paged_hf.metadata import AttentionBypassed
from paged_hf.quant import layer_block_bytes
from models import greedy_references, token_logprobs

LATENT, ROPE, NOPE, VALUE = 32, 8, 16, 12
MLA = dict(kv_lora_rank=LATENT, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=VALUE)
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
           topk_group=1)
FAMILIES = {
    "deepseek_v3": dict(q_lora_rank=24, **MOE),
    "deepseek_v2": dict(q_lora_rank=None, **MOE),  # the query without its low-rank pair; complex rotary
    "minicpm3": dict(q_lora_rank=24),
    # MLA layers beside Kimi Delta Attention's recurrent ones
    "kimi_linear": dict(q_lora_rank=24, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                        mlp_layer_types=["dense", "sparse"] * 2, linear_head_dim=16, linear_num_heads=4, **MOE),
}
LENGTHS = (3, 9, 14, 20, 7, 17)
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
_models: dict = {}
_references: dict = {}


def tiny_latent(family: str = "deepseek_v3"):
    """A seeded random ``family`` model of three layers (four for Kimi Linear), four heads, a 32-wide latent."""
    if family not in _models:
        config = AutoConfig.for_model(family, **{**dict(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.2, **MLA), **FAMILIES[family]})
        torch.manual_seed(0)
        _models[family] = AutoModelForCausalLM.from_config(config).eval()
    return _models[family]


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in LENGTHS]


def references(family: str):
    if family not in _references:
        _references[family] = greedy_references(tiny_latent(family), prompts(), MAX_TOKENS)
    return _references[family]


def test_each_layer_stores_one_latent_row_a_token_and_its_values_share_it():
    """One head of ``kv_lora_rank + qk_rope_head_dim``; the value pools are the key pools, so a block costs half of
    what a K and V pool of that width would, and block copies and growth move one tensor."""
    config = tiny_latent().config
    kv = KVManager(config, block_size=4, num_blocks=8)
    assert kv.head_shapes == {i: (1, LATENT + ROPE) for i in range(3)}
    assert kv.latent_dims == {i: LATENT for i in range(3)}
    per_layer = layer_block_bytes("auto", 4, 1, LATENT + ROPE, torch.float32)
    assert block_id_bytes(config, 4, "auto") == 3 * per_layer // 2 == 3 * 4 * (LATENT + ROPE) * 4
    for kv_format in ("auto", "int8", "fp8"):
        cache = PagedCache(config, block_size=4, kv_cache_dtype=kv_format)
        model = tiny_latent()
        model(input_ids=torch.tensor([prompts()[2]]), cache=cache, use_cache=True)
        storage = cache.layers[0].group.storages[0]
        assert storage.value_cache is storage.key_cache and list(storage.tensors()) == \
            [name for name in storage.tensors() if name.startswith("key_")]
        storage.grow(2)
        assert storage.value_cache is storage.key_cache and getattr(storage, "value_scale", None) is \
            getattr(storage, "key_scale", None)


def test_a_format_that_quantizes_keys_and_values_differently_is_refused_by_name():
    """int4 quantizes keys per channel and values per token: one row cannot be both."""
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' quantizes keys and values differently"):
        PagedCache(tiny_latent().config, block_size=4, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'"):
        PagedEngine(tiny_latent(), None, block_size=4, num_blocks=16, kv_cache_dtype="int4")


def test_the_cache_layers_hold_the_latent_and_the_rotary_key_as_dynamic_cache_does():
    """A dense attention (sdpa) gets the latent and the rotary key of every past token back, and a layer's ``keys``
    / ``values`` equal ``DynamicCache``'s after a two-row prefill and one decode step (the first layer's bit for
    bit; a later layer's within the float32 rounding of sdpa over another mask layout)."""
    model = tiny_latent()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [0, 0, 12, 13, 14, 15, 16]])
    mask = (ids != 0).long()
    dynamic, paged = DynamicCache(config=model.config), PagedCache(model.config, block_size=4)
    for cache in (dynamic, paged):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
            model(input_ids=out.logits[:, -1].argmax(-1, keepdim=True), cache=cache, use_cache=True,
                  attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1))
    for layer in range(3):
        for part in ("keys", "values"):
            want, got = getattr(dynamic.layers[layer], part), getattr(paged.layers[layer], part)
            assert got.shape == want.shape == (2, 1, 8, LATENT if part == "keys" else ROPE)
            atol = 0 if layer == 0 else 1e-5
            torch.testing.assert_close(got[0], want[0], rtol=0, atol=atol)
            torch.testing.assert_close(got[1, :, 2:], want[1, :, 2:], rtol=0, atol=atol)  # pads: zeros in the pool


@pytest.mark.parametrize("attention", ["sdpa", "paged"])
@pytest.mark.parametrize("generation", [dict(), dict(num_beams=2),
                                        dict(do_sample=True, num_return_sequences=2, top_k=5)],
                         ids=["greedy", "beams", "samples"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_on_the_paged_cache_equals_dynamic_cache(family, generation, attention):
    """Left-padded rows; with the paged attention every step reads the latent rows through the folded query."""
    model = tiny_latent(family)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [0, 0, 0, 15, 16, 17, 18, 19, 20, 21]])
    inputs = dict(input_ids=ids, attention_mask=(ids != 0).long(), max_new_tokens=10, pad_token_id=0,
                  eos_token_id=None, **{"do_sample": False, **generation})
    torch.manual_seed(1)
    expected = model.generate(**inputs)
    model.set_attn_implementation(attention)
    try:
        torch.manual_seed(1)
        got = model.generate(**inputs, cache_implementation="paged", cache_config={"block_size": 4})
        assert torch.equal(got, expected)
    finally:
        model.set_attn_implementation("sdpa")


def test_the_paged_attentions_logits_stay_within_float32_rounding_of_sdpa():
    """The fold reorders the sums (the latent dot products before the heads' projections): float32 logits within
    1e-4 of sdpa over ``DynamicCache``, the prefill's and every decode step's."""
    model = tiny_latent()
    ids = torch.tensor([prompts()[3]])
    kwargs = dict(input_ids=ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    want = model.generate(**kwargs)
    model.set_attn_implementation("paged")
    try:
        got = model.generate(**kwargs, cache_implementation="paged", cache_config={"block_size": 4})
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4, rtol=0)


EAGER_OPTIONS = {
    "chunked": dict(enforce_eager=True, max_num_batched_tokens=5),
    "recompute": dict(enforce_eager=True, num_blocks=14, preemption_mode="recompute", max_num_batched_tokens=7),
    "swap": dict(enforce_eager=True, num_blocks=14, preemption_mode="swap", swap_space=0.001),
}
ENGINE_CASES = [pytest.param(family, options, id=f"{family}-{name}") for family in ("deepseek_v3", "minicpm3")
                for name, options in EAGER_OPTIONS.items()]
ENGINE_CASES += [pytest.param("deepseek_v3", dict(max_num_batched_tokens=5), id="deepseek_v3-compiled"),
                 pytest.param("deepseek_v2", dict(max_num_batched_tokens=5), id="deepseek_v2-compiled"),
                 pytest.param("kimi_linear", dict(max_num_batched_tokens=5), id="kimi_linear-hybrid")]


@pytest.mark.parametrize("family, options", ENGINE_CASES)
def test_engine_equals_generate(family, options):
    engine = PagedEngine(tiny_latent(family), None, **{"block_size": 4, "num_blocks": 128, **options})
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


def test_prefix_caching_serves_a_shared_prefix_of_latent_rows():
    model = tiny_latent()
    prefix = prompts()[3][:12]
    requests = [prefix + tail for tail in ([40, 41], [50, 51, 52], [60])]
    want = greedy_references(model, requests, MAX_TOKENS)
    engine = PagedEngine(model, None, block_size=4, num_blocks=64, enable_prefix_caching=True)
    engine.generate(requests[:1], GREEDY, use_tqdm=False)
    outs = engine.generate(requests[1:], GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == [tokens for tokens, _ in want[1:]]
    assert engine.get_stats()["prefix_cache_hits"] >= 2 * 12


def _generate_over_format(model, requests: list[list[int]], kv_format: str):
    """(greedy tokens, their logprobs) of each prompt by ``generate`` + sdpa on a ``PagedCache`` of ``kv_format``:
    the latent dequantized as stored, attended densely."""
    want = []
    for ids in requests:
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0, return_dict_in_generate=True, output_logits=True,
                             cache_implementation="paged", cache_config={"block_size": 4, "kv_cache_dtype": kv_format})
        tokens = out.sequences[0, len(ids):].tolist()
        want.append((tokens, [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.logits, tokens)]))
    return want


@pytest.mark.parametrize("kv_format", ["int8", "fp8"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_quantized_rows_give_what_generate_reads_from_the_same_format(kv_format, compiled):
    """int8 / fp8 rows (keys and values quantized alike, so one row serves as both): the engine's folded attention
    over them gives the tokens of ``generate`` + sdpa over the same format's dequantized latent, logprobs within
    float32 rounding."""
    model = tiny_latent()
    want = _generate_over_format(model, prompts(), kv_format)
    engine = PagedEngine(model, None, block_size=4, num_blocks=128, kv_cache_dtype=kv_format,
                         max_num_batched_tokens=5, enforce_eager=not compiled)
    outs = engine.generate(prompts(), GREEDY, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outs, want):
        assert out.outputs[0].token_ids == tokens
        torch.testing.assert_close(token_logprobs(out.outputs[0]), logprobs, atol=1e-4, rtol=0)


def test_an_attention_whose_expansion_is_not_the_folded_one_is_refused():
    """The fold assumes the model expands the stored latent with ``kv_b_proj`` as ``expand_kv`` does; a model that
    changes its K/V after expanding (here: values scaled) fails the engine's start by name, never silently."""
    model = AutoModelForCausalLM.from_config(tiny_latent().config).eval()
    attention = model.model.layers[1].self_attn
    expand = attention.expand_kv
    attention.expand_kv = lambda kv_nope, k_rot: (expand(kv_nope, k_rot)[0], 2 * expand(kv_nope, k_rot)[1])
    with pytest.raises(NotImplementedError, match="hands its attention K/V other than its expand_kv"):
        PagedEngine(model, None, block_size=4, num_blocks=16, enforce_eager=True)
    attention.expand_kv = expand
    attention.kv_b_proj.bias = torch.nn.Parameter(torch.zeros(attention.kv_b_proj.out_features))
    with pytest.raises(AttentionBypassed, match="not a bias-free nn.Linear"):
        model.set_attn_implementation("paged")
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, cache_implementation="paged")


LONG_PROMPTS = (30, 45, 3, 60, 26)  # chunks of more than 20 tokens attend over their context expanded (tiny sizes)


def _long_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in LONG_PROMPTS]


@pytest.fixture
def expanded_calls(monkeypatch):
    """How many chunks attended over their context expanded into heads (``latent_attention._attend_expanded``)."""
    from paged_hf import latent_attention

    calls = []
    original = latent_attention._attend_expanded
    monkeypatch.setattr(latent_attention, "_attend_expanded",
                        lambda query, *args: calls.append(query.shape[0]) or original(query, *args))
    return calls


@pytest.mark.parametrize("kv_format", ["auto", "int8"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_long_chunks_attend_over_their_context_expanded(kv_format, compiled, expanded_calls):
    """Steps that mix decodes, short chunks (over the latent rows, folded) and long ones (over their context's rows
    expanded with ``kv_b_proj``, through sdpa; a second chunk's context includes its first): tokens equal
    ``generate`` + sdpa over the same format, logprobs within float32 rounding."""
    from paged_hf.latent_attention import expands

    model = tiny_latent()
    assert not expands(20, 60, LATENT, ROPE, NOPE, VALUE) and expands(21, 60, LATENT, ROPE, NOPE, VALUE)
    want = _generate_over_format(model, _long_prompts(), kv_format)
    engine = PagedEngine(model, None, block_size=4, num_blocks=256, kv_cache_dtype=kv_format, max_num_seqs=3,
                         max_num_batched_tokens=48, enforce_eager=not compiled)
    outs = engine.generate([{"prompt_token_ids": ids} for ids in _long_prompts()], GREEDY, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outs, want):
        assert out.outputs[0].token_ids == tokens
        torch.testing.assert_close(token_logprobs(out.outputs[0]), logprobs, atol=1e-4, rtol=0)
    assert len(expanded_calls) >= 3 * 3 and min(expanded_calls) > 20  # three layers, at least three long chunks
    engine.check_invariants()


@pytest.mark.parametrize("generation", [dict(), dict(num_beams=2)], ids=["greedy", "beams"])
def test_generate_expands_a_long_prefill_with_the_paged_attention(generation, expanded_calls):
    """A left-padded batch of 30 / 26 real tokens: the prefill attends over its rows expanded, the decodes over the
    latent rows; tokens equal ``DynamicCache`` + sdpa."""
    model = tiny_latent()
    prompts = _long_prompts()
    ids = torch.tensor([prompts[0], [0] * 4 + prompts[4]])
    inputs = dict(input_ids=ids, attention_mask=(ids != 0).long(), max_new_tokens=8, pad_token_id=0,
                  eos_token_id=None, do_sample=False, **generation)
    expected = model.generate(**inputs)
    model.set_attn_implementation("paged")
    try:
        got = model.generate(**inputs, cache_implementation="paged", cache_config={"block_size": 4})
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(got, expected)
    assert set(expanded_calls) == {30, 26}  # the prefill of each row (each beam), in every layer; no decode
