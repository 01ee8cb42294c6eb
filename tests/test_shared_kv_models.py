"""Gemma 3n and Gemma 4: their last ``num_kv_shared_layers`` layers store no K/V and attend over the K/V of the last
earlier layer of their own type (``kv_sharing_modes``: "store" / "reuse"), and Gemma 4's full-attention layers are
wider than its sliding ones, with fewer KV heads (``global_head_dim``, ``num_global_key_value_heads``).

The paged cache gives each storing layer pools of its own shape, none to a reading layer, and hands the reading
layers the step of the layer they read (``PagedLayer.readers``): the blocks they attend over are their source's.
Tokens and logprobs must equal ``generate`` on ``DynamicCache`` + sdpa (tiny random models, weights drawn 10x wider
than the default so that a reader attending over the wrong K/V shows); with int4, a reader must see the tail rows
as its source saw them, before the forward's tail writes.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, DynamicCache

from paged_hf import PagedCache, PagedEngine, SamplingParams
from paged_hf.kv.manager import KVManager
from paged_hf.kv.model_config import block_id_bytes
from paged_hf.quant import layer_block_bytes
from int4_reference import Int4ReferenceCache, own_block_attention
from models import greedy_references, token_logprobs

PER_LAYER_INPUTS = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=512)
FAMILIES = {
    # full layers: 1 KV head of 32 dims (keys and values from one projection), sliding ones: 2 of 16
    "gemma4_text": dict(global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, **PER_LAYER_INPUTS),
    "gemma3n_text": dict(laurel_rank=4, altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 6, **PER_LAYER_INPUTS),
}
LENGTHS = (3, 9, 14, 20, 7, 17)
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
_models: dict = {}
_references: dict = {}


def tiny_shared(family: str, num_kv_shared_layers: int = 2):
    """A seeded random ``family`` model of six layers, sliding (window 6) and full alternating; the last
    ``num_kv_shared_layers`` read layers 2 (sliding) and 3 (full)."""
    key = (family, num_kv_shared_layers)
    if key not in _models:
        config = AutoConfig.for_model(
            family, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, initializer_range=0.2, sliding_window=6,
            layer_types=["sliding_attention", "full_attention"] * 3, num_kv_shared_layers=num_kv_shared_layers,
            **FAMILIES[family])
        torch.manual_seed(0)
        _models[key] = AutoModelForCausalLM.from_config(config).eval()
    return _models[key]


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in LENGTHS]


def references(family: str):
    if family not in _references:
        _references[family] = greedy_references(tiny_shared(family), prompts(), MAX_TOKENS)
    return _references[family]


def test_each_storing_layer_gets_pools_of_its_own_shape_and_a_reading_layer_none():
    """Gemma 4: sliding layers 2 KV heads x 16, full layers 1 x 32; layers 4 and 5 read layers 2 and 3. A block id
    costs what each storing layer's block costs (four layers, not six), and a KV-head count a tensor-parallel size
    cannot split is refused naming it."""
    config = tiny_shared("gemma4_text").config
    kv = KVManager(config, block_size=4, num_blocks=8)
    assert kv.head_shapes == {0: (2, 16), 1: (1, 32), 2: (2, 16), 3: (1, 32)}
    assert kv.readers == {2: (4,), 3: (5,)}
    assert sorted(kv.group_of) == [0, 1, 2, 3]
    sliding, full = (layer_block_bytes("auto", 4, heads, dim, torch.float32) for heads, dim in ((2, 16), (1, 32)))
    assert block_id_bytes(config, 4, "auto") == 2 * sliding + 2 * full
    cache = PagedCache(config, block_size=4)
    assert [type(layer).__name__ for layer in cache.layers] == ["PagedLayer"] * 4 + ["DummyLayer"] * 2
    assert cache.layers[2].readers == (4,) and cache.layers[0].readers == ()
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's num_key_value_heads=1"):
        KVManager(config, block_size=4, num_blocks=8, tp_size=2)


def test_a_model_whose_layers_all_read_another_models_cache_is_refused():
    """An assistant model (every layer reads its target model's K/V) has nothing of its own to page."""
    config = tiny_shared("gemma4_text").config.__class__(**{**tiny_shared("gemma4_text").config.to_dict(),
                                                            "num_kv_shared_layers": 6})
    with pytest.raises(NotImplementedError, match="reads the K/V of a 'sliding_attention' layer that no layer"):
        PagedCache(config)


@pytest.mark.parametrize("attention", ["sdpa", "paged"])
@pytest.mark.parametrize("generation", [dict(), dict(num_beams=2),
                                        dict(do_sample=True, num_return_sequences=2, top_k=5)],
                         ids=["greedy", "beams", "samples"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_on_the_paged_cache_equals_dynamic_cache(family, generation, attention):
    """Left-padded rows longer than the window. With the paged attention, the reading layers of the prefill get the
    last column's query alone (transformers' ``_maybe_slice_kv_shared_inputs``): ``attention.attend_columns``."""
    model = tiny_shared(family)
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


EAGER_OPTIONS = {
    "chunked": dict(enforce_eager=True, max_num_batched_tokens=5),  # prompts cross chunk, block and window boundaries
    "recompute": dict(enforce_eager=True, num_blocks=14, preemption_mode="recompute", max_num_batched_tokens=7),
    "swap": dict(enforce_eager=True, num_blocks=14, preemption_mode="swap", swap_space=0.001),
}
ENGINE_CASES = [pytest.param(family, options, id=f"{family}-{name}") for family in sorted(FAMILIES)
                for name, options in EAGER_OPTIONS.items()]
# one compiled family: the compiled forward's ops are the same for both
ENGINE_CASES.append(pytest.param("gemma4_text", dict(max_num_batched_tokens=5), id="gemma4_text-compiled"))


@pytest.mark.parametrize("family, options", ENGINE_CASES)
def test_engine_equals_generate(family, options):
    engine = PagedEngine(tiny_shared(family), None, **{"block_size": 4, "num_blocks": 128, **options})
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


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_n_samples_of_a_model_with_sliding_and_full_layers(family):
    """``n=2``: the second sample forks the first's blocks after the prompt, sharing its partial tail block. Once
    the first copied that tail (copy-on-write), the fork's tail is its own again, but its table's cached flag
    (``_tail_private``) still said shared: with more than one layer group (sliding and full), ``append_decodes``
    took ``tail_has_room()`` (True) and then ignored ``append_in_tail()``'s False, so the fork's tables never grew
    and the scheduler raised IndexError in the prefix cache. Both samples equal the greedy reference."""
    engine = PagedEngine(tiny_shared(family), None, block_size=4, num_blocks=128, enforce_eager=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0, n=2)
    outs = engine.generate(prompts(), params, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outs, references(family)):
        assert len(out.outputs) == 2
        for sample in out.outputs:
            assert sample.token_ids == tokens
            assert token_logprobs(sample) == pytest.approx(logprobs, abs=2e-5)
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0


def test_prefix_caching_serves_a_shared_prefix_to_the_reading_layers():
    """Requests sharing a 12-token prefix hit its cached blocks; the reading layers attend over them as their
    sources do."""
    model = tiny_shared("gemma4_text")
    prefix = prompts()[3][:12]
    requests = [prefix + tail for tail in ([40, 41], [50, 51, 52], [60])]
    want = greedy_references(model, requests, MAX_TOKENS)
    engine = PagedEngine(model, None, block_size=4, num_blocks=64, enable_prefix_caching=True, enforce_eager=True)
    engine.generate(requests[:1], GREEDY, use_tqdm=False)
    outs = engine.generate(requests[1:], GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == [tokens for tokens, _ in want[1:]]
    assert engine.get_stats()["prefix_cache_hits"] >= 2 * 12


def _int4_reference(model, prompt: list[int]):
    """The int4 reference (each query reads its own block exact, the blocks before it as int4 stores them, whatever
    the chunking): greedy tokens and their logprobs by generate, and each prompt token's logprob after the tokens
    before it, from one forward."""
    model.set_attn_implementation(own_block_attention(4))
    try:
        out = model.generate(torch.tensor([prompt]), past_key_values=Int4ReferenceCache(model.config, 4),
                             max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt]), cache=Int4ReferenceCache(model.config, 4)).logits[0]
    finally:
        model.set_attn_implementation("sdpa")
    tokens = out.sequences[0, len(prompt):].tolist()
    prompt_logprobs = torch.log_softmax(logits[:-1].float(), -1).gather(1, torch.tensor(prompt[1:])[:, None])
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)], \
        prompt_logprobs.squeeze(1).tolist()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_int4_readers_see_the_tail_rows_as_their_source_did(compiled):
    """A chunk that starts inside a block and ends in the next one fills that block and writes the next one's tokens
    into the tail row: a reading layer that attended after its source's tail writes would read another block's
    tokens in place of the filled block's. Its queries in that block are the ones that read the tail row, and only
    the prompt's logprobs keep their outputs (a reading layer stores nothing for later positions): chunks of 5 in
    blocks of 4 do it at every chunk. Prompt logprobs, tokens and logprobs equal the reference's."""
    model = tiny_shared("gemma4_text")
    prompt = prompts()[3]
    tokens, logprobs, prompt_logprobs = _int4_reference(model, prompt)
    engine = PagedEngine(model, None, block_size=4, num_blocks=64, kv_cache_dtype="int4", max_num_batched_tokens=5,
                         enforce_eager=not compiled)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    out = engine.generate([prompt], params, use_tqdm=False)[0]
    got = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])]
    torch.testing.assert_close(got, prompt_logprobs, atol=1e-4, rtol=0)
    assert out.outputs[0].token_ids == tokens
    torch.testing.assert_close(token_logprobs(out.outputs[0]), logprobs, atol=1e-4, rtol=0)


VISION = dict(image_size=20, patch_size=5, num_channels=3, hidden_size=32, num_key_value_heads=1, num_hidden_layers=2,
              num_attention_heads=4, intermediate_size=37, pooling_kernel_size=2)


def tiny_gemma4_with_images():
    """Gemma 4's image-text class over the tiny text model, its image tokens (5 placeholders a row, as transformers'
    own tests give them) attending to each other both ways in the sliding layers (``use_bidirectional_attention=
    "vision"``); and inputs for a batch of two, the second left-padded."""
    text = {**tiny_shared("gemma4_text").config.to_dict(), "use_bidirectional_attention": "vision"}
    config = AutoConfig.for_model("gemma4", text_config=text, vision_config=VISION, image_token_id=4,
                                  video_token_id=7, audio_token_id=8, boi_token_id=5, eoi_token_id=6,
                                  mm_tokens_per_image=2)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    ids = torch.tensor([[4] * 5 + [20, 21, 22, 23, 24, 25, 26], [0, 0] + [4] * 5 + [30, 31, 32, 33, 34]])
    side = int(VISION["image_size"] ** 0.5)
    grid = torch.stack([torch.arange(VISION["image_size"] // side).repeat(side),
                        torch.arange(side).repeat_interleave(VISION["image_size"] // side)], dim=-1)
    inputs = dict(input_ids=ids, attention_mask=(ids != 0).long(), mm_token_type_ids=(ids == 4).long(),
                  pixel_values=torch.rand(2, VISION["image_size"], VISION["patch_size"] ** 2 * 3,
                                          generator=torch.Generator().manual_seed(0)),
                  image_position_ids=grid[None].repeat(2, 1, 1))
    return model, inputs


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int4"])
def test_images_mix_paged_and_dense_layers_in_one_forward(kv_cache_dtype):
    """Gemma 4's full layers get a plain causal mask (left to the paged attention) and, in the same prefill, its
    sliding layers a mask where image tokens see each other both ways, which only a dense attention expresses.
    Each layer attends as its mask says (``PagedCache.mixed_masks``): tokens equal ``DynamicCache`` + sdpa's and
    logits agree within 1e-5 (the image tokens' two-way attention moves them by 0.2, which the tokens of this tiny
    model do not show; before, the second mask raised). int4 is refused by name there: a dense read writes the tails
    the paged layers read."""
    model, inputs = tiny_gemma4_with_images()
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
                   return_dict_in_generate=True)
    expected = model.generate(**inputs, **options)
    model.set_attn_implementation("paged")
    cache_config = {"block_size": 4, "kv_cache_dtype": kv_cache_dtype}
    if kv_cache_dtype == "int4":
        with pytest.raises(NotImplementedError, match="for every kv_cache_dtype but 'int4'"):
            model.generate(**inputs, **options, cache_implementation="paged", cache_config=cache_config)
        return
    got = model.generate(**inputs, **options, cache_implementation="paged", cache_config=cache_config)
    assert torch.equal(got.sequences, expected.sequences)
    for step, want in zip(got.logits, expected.logits):
        torch.testing.assert_close(step, want, atol=1e-5, rtol=0)


def _image_request(num_images: int, seed: int):
    """A prompt of ``num_images`` images (5 placeholder tokens each, between text) and its processor tensors."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 512, (3,), generator=generator).tolist()
    for _ in range(num_images):
        ids += [4] * 5 + torch.randint(10, 512, (4,), generator=generator).tolist()
    if not num_images:
        return ids, None
    _, inputs = tiny_gemma4_with_images()
    pixels = torch.rand(num_images, *inputs["pixel_values"].shape[1:], generator=generator)
    return ids, dict(pixel_values=pixels, image_position_ids=inputs["image_position_ids"][:1].repeat(num_images, 1, 1))


def _image_reference(model, ids, images):
    kwargs = {} if images is None else dict(images, mm_token_type_ids=(torch.tensor([ids]) == 4).long())
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), **kwargs,
                         max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True, cache=DynamicCache(config=model.config))
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]


@pytest.mark.parametrize("options", [
    dict(),
    dict(max_num_batched_tokens=7),  # an image (5 tokens, attended both ways) never splits: chunks end before it
    dict(num_blocks=10, preemption_mode="recompute", max_num_batched_tokens=12),
], ids=["one-step", "chunked", "recompute"])
def test_gemma4_images_in_the_engine_equal_generate(options):
    """Gemma 4's image prompts in the engine: the step hands the model its token ids with the image rows
    (``mm_encoder_outputs``), and the image queries are widened in the sliding layers only (its full layers stay
    causal over the images). Tokens and logprobs equal generate's on DynamicCache + sdpa, beside a text-only
    request; the tower runs once per image."""
    model, _ = tiny_gemma4_with_images()
    requests = [_image_request(n, seed) for n, seed in ((1, 1), (0, 2), (2, 3))]
    want = [_image_reference(model, ids, images) for ids, images in requests]
    engine = PagedEngine(model, None, **{"block_size": 4, "num_blocks": 64, "enforce_eager": True, **options})
    outs = engine.generate([ids for ids, _ in requests], GREEDY, use_tqdm=False,
                           images=[images for _, images in requests])
    for out, (tokens, logprobs) in zip(outs, want):
        assert out.error is None
        assert out.outputs[0].token_ids == tokens
        torch.testing.assert_close(token_logprobs(out.outputs[0]), logprobs, atol=2e-5, rtol=0)
    if options.get("preemption_mode"):
        assert engine.get_stats()["preemption_count"] > 0, "the pool must force preemption"
    else:
        assert engine.runner.images.num_encoded_images == 3
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0


def test_gemma4_images_without_their_patch_positions_are_refused_before_queueing():
    """The tower places each patch by ``image_position_ids``: a request without them, or with another shape or
    dtype, is refused at ``add_request`` naming the field (``images``), and nothing is queued."""
    model, _ = tiny_gemma4_with_images()
    ids, images = _image_request(1, 1)
    engine = PagedEngine(model, None, block_size=4, num_blocks=64, enforce_eager=True)
    for bad, message in (({"pixel_values": images["pixel_values"]}, r"need images\['image_position_ids'\]"),
                         ({**images, "image_position_ids": images["image_position_ids"][:, :7]}, "integer"),
                         ({**images, "image_position_ids": images["image_position_ids"].float()}, "integer")):
        with pytest.raises(ValueError, match=message) as error:
            engine.add_request(ids, GREEDY, images=bad)
        assert error.value.param == "images"
    assert not engine.has_unfinished_requests()
