"""Images in the engine (tiny random LLaVA; Qwen2-VL, whose M-RoPE positions come from its ``get_rope_index``; Gemma 3,
whose image tokens attend to each other both ways, so its images are never split across chunks):
greedy tokens and logprobs equal ``generate`` on ``DynamicCache`` + sdpa, with several images per prompt, text-only and
image requests in one step, chunked prefill through image tokens, preemption; the vision tower runs once per image;
prefix hits keyed by the pixels; hostile inputs fail alone; ``LLM``'s image prompts."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import DynamicCache

from paged_hf import PagedEngine, SamplingParams, attention
from paged_hf.engine.multimodal import request_images
from paged_hf.hashing import ContentSpans, extend_block_hashes
from models import token_logprobs
from vision_models import (IMAGE_TOKEN_ID, IMAGE_TOKENS, TILED, VISION_FAMILIES, generate_kwargs, prompt_with_images,
                           random_pixels, tiny_llava, vision_case, vision_model)

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
# (number of images, seed): a text-only prompt among prompts of one, two and three images
CASES = ((2, 1), (0, 2), (1, 3), (3, 4), (1, 5))


@pytest.fixture(scope="module")
def model():
    return tiny_llava()


_models: dict = {}


def family_model(family: str):
    if family not in _models:
        _models[family] = vision_model(family)
    return _models[family]


def case_inputs(num_images: int, seed: int, family: str = "llava"):
    return vision_case(family, num_images, seed)


_references: dict = {}


def reference(model, num_images: int, seed: int, family: str = "llava"):
    """(greedy tokens, logprobs) of one prompt alone, by generate on DynamicCache with sdpa."""
    key = (family, num_images, seed)
    if key not in _references:
        ids, images = case_inputs(num_images, seed, family)
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 **generate_kwargs(family, ids, images), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=None,
                                 pad_token_id=0, return_dict_in_generate=True, output_logits=True,
                                 cache=DynamicCache(config=model.config))
        tokens = out.sequences[0, len(ids):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
        _references[key] = (tokens, logprobs)
    return _references[key]


def encoded_units(family: str, num_images: int, seed: int) -> int:
    """What the vision tower encodes for a case: its images, or its tiles (Idefics3, SmolVLM)."""
    images = case_inputs(num_images, seed, family)[1]
    return images["pixel_values"].shape[1] if family in TILED and images else num_images


def run_cases(engine, cases, family: str = "llava"):
    inputs = [case_inputs(*case, family) for case in cases]
    return engine.generate([ids for ids, _ in inputs], GREEDY, use_tqdm=False, images=[i for _, i in inputs])


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 5},  # every image's 16 tokens split over chunks
    {"max_num_batched_tokens": 13, "enable_prefix_caching": False},
    {"num_blocks": 16, "preemption_mode": "recompute", "max_num_batched_tokens": 24},
    {"num_blocks": 16, "preemption_mode": "swap", "swap_space": 0.001, "max_num_batched_tokens": 24},
], ids=["one-step", "chunked-5", "chunked-13", "recompute", "swap"])
@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_engine_equals_generate(family, options):
    model = family_model(family)
    if family == "gemma3" and "num_blocks" in options:  # its sliding window frees blocks: a smaller pool preempts
        options = {**options, "num_blocks": 6}
    if family in ("llava_next", "llava_onevision", *TILED) and "num_blocks" in options:  # a pool that holds each
        options = {**options, "num_blocks": 20 if family in TILED else 50}
    engine = PagedEngine(model, None, **{"block_size": 4, "num_blocks": 128, "enforce_eager": True, **options})
    outs = run_cases(engine, CASES, family)
    for out, case in zip(outs, CASES):
        tokens, logprobs = reference(model, *case, family)
        assert out.error is None
        assert out.outputs[0].token_ids == tokens, case
        torch.testing.assert_close(token_logprobs(out.outputs[0]), logprobs, atol=2e-5, rtol=0)
    if options.get("preemption_mode"):
        assert engine.get_stats()["preemption_count"] > 0, "the pool must force preemption"
    else:  # the vision tower ran once per image (per tile for tiled families), whatever the chunking
        assert engine.runner.images.num_encoded_images == sum(encoded_units(family, *case) for case in CASES)
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_quantized_kv_with_images_does_not_depend_on_the_chunking(family, kv_cache_dtype):
    """A quantized block's bytes depend only on its tokens: image prompts in one step or in chunks of 7 (Gemma 3's
    widened image queries included, int4's full-precision tail too) give the same tokens."""
    model = family_model(family)
    tokens = []
    for budget in (2048, 7):
        engine = PagedEngine(model, None, block_size=4, num_blocks=128, enforce_eager=True,
                             kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=budget)
        outs = run_cases(engine, CASES[:3], family)
        assert all(o.error is None for o in outs)
        tokens.append([o.outputs[0].token_ids for o in outs])
        engine.check_invariants()
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_parallel_samples_of_an_image_request_share_its_prompt(family):
    """n=2: the second sample forks the first's blocks after the prompt (and, for Qwen2-VL, its rope delta)."""
    model = family_model(family)
    engine = PagedEngine(model, None, block_size=4, num_blocks=128, enforce_eager=True)
    ids, images = case_inputs(2, 1, family)
    out = engine.generate([ids], SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                          use_tqdm=False, images=[images])[0]
    assert [c.token_ids for c in out.outputs] == [reference(model, 2, 1, family)[0]] * 2
    assert engine.get_stats()["num_encoded_images"] == encoded_units(family, 2, 1)
    engine.check_invariants()


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_image_and_text_requests_share_a_step(family):
    model = family_model(family)
    engine = PagedEngine(model, None, block_size=4, num_blocks=128, enforce_eager=True)
    ids, images = case_inputs(2, 1, family)
    text_ids, _ = case_inputs(0, 2, family)
    engine.add_request(ids, GREEDY, request_id="image", images=images)
    engine.add_request(text_ids, GREEDY, request_id="text")
    first = engine.step()  # both prompts fit one step: both get their first token from it
    assert sorted((out.request_id, len(out.outputs[0].token_ids)) for out in first) == [("image", 1), ("text", 1)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done == {"image": reference(model, 2, 1, family)[0], "text": reference(model, 0, 2, family)[0]}
    engine.check_invariants()


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_prefix_hits_the_same_image_and_misses_another(family):
    model = family_model(family)
    engine = PagedEngine(model, None, block_size=4, num_blocks=128, enforce_eager=True)
    ids, images = case_inputs(1, 3, family)  # 4 text tokens, then the image (and its markers) from position 4
    first = engine.generate([ids], GREEDY, use_tqdm=False, images=[images])[0]
    same = engine.generate([ids], GREEDY, use_tqdm=False, images=[images])[0]
    other_pixels = {**images, "pixel_values": images["pixel_values"] + 0.5}  # the same placeholders
    other = engine.generate([ids], GREEDY, use_tqdm=False, images=[other_pixels])[0]
    assert first.metrics.num_prefix_cached_tokens == 0
    assert same.metrics.num_prefix_cached_tokens == (len(ids) - 1) // 4 * 4  # every full block but the last token's
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.metrics.num_prefix_cached_tokens == 4  # the text block before the image, nothing after it
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), **generate_kwargs(family, ids, other_pixels), do_sample=False,
                                  max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0,
                                  cache=DynamicCache(config=model.config))[0, len(ids):].tolist()
    assert other.outputs[0].token_ids == expected
    # the other pixels were read (a random Gemma 3 may keep the same greedy tokens: its logprobs still move)
    assert other.outputs[0].cumulative_logprob != pytest.approx(first.outputs[0].cumulative_logprob, abs=1e-6)
    engine.check_invariants()


@pytest.mark.parametrize("family", ["llava", "qwen3_vl", "idefics3"])
def test_an_image_two_requests_hold_is_encoded_once_in_their_step(family):
    """Two requests whose prompts differ before the same image (no prefix hit) compute its tokens in one step: the
    vision tower runs on it once and both read its embeddings (DeepStack rows too), each answer that of
    ``generate``."""
    model = family_model(family)
    ids, images = case_inputs(1, 3, family)
    other = [ids[0], (ids[1] + 1) % 500 + 3, *ids[2:]]
    engine = PagedEngine(model, None, block_size=4, num_blocks=128, enforce_eager=True)
    outs = engine.generate([ids, other], GREEDY, use_tqdm=False, images=[images, images])
    assert engine.get_stats()["num_encoded_images"] == encoded_units(family, 1, 3)
    model.set_attn_implementation("sdpa")
    for out, prompt in zip(outs, (ids, other)):
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), **generate_kwargs(family, prompt, images),
                                      do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0,
                                      cache=DynamicCache(config=model.config))[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected
    engine.check_invariants()


def test_adjacent_llava_images_are_told_apart_by_their_fixed_length(model):
    """"<image><image>": LLaVA's processor writes the two runs of placeholders with nothing between them; each
    image's tokens are a fixed count, so the run splits in two. Tokens and logprobs equal generate's."""
    ids = [1, 40, 41] + [IMAGE_TOKEN_ID] * (2 * IMAGE_TOKENS) + [42, 43]
    images = {"pixel_values": random_pixels(2, 7)}
    engine = PagedEngine(model, None, block_size=4, num_blocks=128, enforce_eager=True)
    out = engine.generate([ids], GREEDY, use_tqdm=False, images=[images])[0].outputs[0]
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), **generate_kwargs("llava", ids, images), do_sample=False,
                                  max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0,
                                  return_dict_in_generate=True, output_logits=True,
                                  cache=DynamicCache(config=model.config))
    tokens = expected.sequences[0, len(ids):].tolist()
    assert out.token_ids == tokens
    reference_logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(expected.logits, tokens)]
    assert token_logprobs(out) == pytest.approx(reference_logprobs, abs=1e-5)
    with pytest.raises(ValueError, match="runs of image placeholder"):  # 3 images cannot share 32 placeholders
        engine.add_request(ids, GREEDY, images={"pixel_values": random_pixels(3, 7)})


def test_the_engine_keeps_its_own_copy_of_a_requests_pixels(model):
    """A caller that reuses its pixel buffer after ``add_request`` changes neither that request's image nor the
    blocks its digest keys (a view of the buffer answered the new pixels under the old digest, and a later request
    of the old image hit those blocks)."""
    engine = PagedEngine(model, None, block_size=4, num_blocks=128, enforce_eager=True)
    ids, images = case_inputs(1, 3)
    first = engine.generate([ids], GREEDY, use_tqdm=False, images=[images])[0].outputs[0].token_ids
    buffer = images["pixel_values"].clone()
    fresh = PagedEngine(model, None, block_size=4, num_blocks=128, enforce_eager=True)
    fresh.add_request(ids, GREEDY, request_id="reused", images={**images, "pixel_values": buffer})
    buffer.add_(0.5)  # the caller's next image, in the same buffer
    outs = []
    while fresh.has_unfinished_requests():
        outs += [o for o in fresh.step() if o.finished]
    assert outs[0].outputs[0].token_ids == first
    again = fresh.generate([ids], GREEDY, use_tqdm=False, images=[images])[0]
    assert again.metrics.num_prefix_cached_tokens > 4 and again.outputs[0].token_ids == first


@settings(max_examples=40, deadline=None)
@given(offset=st.integers(0, 30), length=st.integers(1, 12), block=st.sampled_from([1, 2, 4, 8]))
def test_image_digests_key_the_blocks_from_the_image_on(offset, length, block):
    tokens = list(range(48))
    hashes = {d: extend_block_hashes([], tokens, block, ("auto", ContentSpans(None, ((offset, length, d),))))
              for d in ("a", "b")}
    first_image_block = offset // block
    assert hashes["a"][:first_image_block] == hashes["b"][:first_image_block]
    assert all(x != y for x, y in zip(hashes["a"][first_image_block:], hashes["b"][first_image_block:]))
    plain = extend_block_hashes([], tokens, block, ("auto", None))
    assert hashes["a"][:first_image_block] == plain[:first_image_block]


def test_requests_whose_images_fail_fail_alone(model):
    engine = PagedEngine(model, None, block_size=4, num_blocks=128, enforce_eager=True)
    ids, images = case_inputs(1, 3)
    small = {"pixel_values": torch.randn(1, 3, 8, 8)}  # the vision tower refuses an 8x8 image
    short = [1, 7] + [IMAGE_TOKEN_ID] * 10 + [9]  # 10 placeholders for an image of 16 embeddings
    outs = engine.generate([ids, ids, short, case_inputs(0, 2)[0]], GREEDY, use_tqdm=False,
                           images=[images, small, images, None])
    assert outs[1].error is not None and "image size" in outs[1].error
    assert outs[2].error is not None and "16 embeddings but the prompt holds 10 placeholder" in outs[2].error
    assert outs[0].outputs[0].token_ids == reference(model, 1, 3)[0]
    assert outs[3].outputs[0].token_ids == reference(model, 0, 2)[0]
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0


@pytest.mark.parametrize("ids, images, message", [
    (prompt_with_images(1, 0), None, "no images"),
    (prompt_with_images(2, 0), {"pixel_values": random_pixels(1, 0)}, "holds 2 runs .* for 1 images"),
    (prompt_with_images(1, 0), {"pixel_values": random_pixels(2, 0)}, "holds 1 runs .* for 2 images"),
    (prompt_with_images(1, 0), {"pixel_values": torch.full((1, 3, 16, 16), float("nan"))}, "NaN"),
    (prompt_with_images(1, 0), {"pixel_values": random_pixels(1, 0), "mask": torch.ones(1)}, "unsupported key"),
    (prompt_with_images(1, 0), [random_pixels(1, 0)], "mapping with 'pixel_values'"),
    (prompt_with_images(3, 0), {"pixel_values": random_pixels(3, 0)}, "at most 2 are allowed"),
])
def test_bad_images_are_refused_before_queueing(model, ids, images, message):
    engine = PagedEngine(model, None, block_size=4, num_blocks=128, enforce_eager=True,
                         limit_mm_per_prompt={"image": 2})
    with pytest.raises(ValueError, match=message) as error:
        engine.add_request(ids, GREEDY, images=images)
    assert error.value.param == "images"
    assert not engine.has_unfinished_requests()


def test_bad_qwen2_vl_grids_are_refused_before_queueing():
    model = family_model("qwen2_vl")
    engine = PagedEngine(model, None, block_size=4, num_blocks=64, enforce_eager=True)
    ids, images = case_inputs(2, 1, "qwen2_vl")  # images of 4 and 10 placeholders
    swapped = {**images, "image_grid_thw": images["image_grid_thw"].flip(0)}
    for bad, message in ((swapped, "image 0 has 10 merged patches .* holds 4 placeholder"),
                         ({**images, "image_grid_thw": images["image_grid_thw"][:1]}, "holds 2 runs .* for 1 images"),
                         ({**images, "pixel_values": images["pixel_values"][:-1]}, "rows but image_grid_thw counts")):
        with pytest.raises(ValueError, match=message):
            engine.add_request(ids, GREEDY, images=bad)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("family, longest", [("llava", IMAGE_TOKENS), ("gemma3", 4)])  # images of one size
def test_the_encoder_budget_holds_each_step_to_one_image(family, longest):
    """max_num_encoder_input_tokens of one image: prompts of two and three images encode one image per step (a chunk
    ends before the next image), and the tokens are unchanged."""
    model = family_model(family)
    engine = PagedEngine(model, None, block_size=4, num_blocks=128, enforce_eager=True,
                         max_num_encoder_input_tokens=longest)
    inputs = [case_inputs(*case, family) for case in CASES]
    for index, (ids, images) in enumerate(inputs):
        engine.add_request(ids, GREEDY, request_id=str(index), images=images)
    done, encoded = {}, [0]
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
        encoded.append(engine.get_stats()["num_encoded_images"])
    assert max(b - a for a, b in zip(encoded, encoded[1:])) == 1
    assert encoded[-1] == sum(n for n, _ in CASES)
    assert [done[i] for i in range(len(CASES))] == [reference(model, *case, family)[0] for case in CASES]
    engine.check_invariants()
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens") as error:
        PagedEngine(model, None, block_size=4, num_blocks=64, enforce_eager=True,
                    max_num_encoder_input_tokens=longest - 1).add_request(*inputs[0][:1], GREEDY, images=inputs[0][1])
    assert error.value.param == "images"


def test_limit_mm_per_prompt_is_checked():
    from paged_hf.config import EngineConfig

    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        EngineConfig(limit_mm_per_prompt={"video": 1})
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        EngineConfig(limit_mm_per_prompt={"image": -1})
    # vLLM's common spelling: no video, no audio
    assert EngineConfig(limit_mm_per_prompt={"image": 2, "video": 0, "audio": 0}).limit_mm_per_prompt["image"] == 2


@pytest.mark.parametrize("family", ["mllama", "mistral3"])
def test_families_without_engine_images_are_refused_by_name(family):
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type=family, image_token_id=IMAGE_TOKEN_ID))
    ids = [1, 2] + [IMAGE_TOKEN_ID] * IMAGE_TOKENS
    with pytest.raises(NotImplementedError, match=family):
        request_images({"pixel_values": random_pixels(1, 0)}, ids, model, None)


# ------------------------------------------------------------------------------------------------- LLM
@pytest.fixture(scope="module")
def llm(model):
    from paged_hf import LLM
    from paged_hf.media import MediaPolicy
    from vision_models import llava_processor

    processor = llava_processor()
    return LLM(model, processor.tokenizer, processor=processor, media=MediaPolicy(max_image_pixels=64 * 64),
               enforce_eager=True, block_size=4, num_blocks=128)


def processed_reference(model, processor, text: str, images: list, add_special_tokens: bool = True):
    inputs = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=add_special_tokens)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0, cache=DynamicCache(config=model.config))
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def data_url(image, kind: str = "PNG") -> str:
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format=kind)
    return f"data:image/{kind.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def test_llm_generate_with_multi_modal_data_equals_generate(model, llm):
    from vision_models import random_image

    prompts = [("Look <image> at it", [random_image(0)]), ("A <image> and <image> too", [random_image(1),
                                                                                          random_image(2, (30, 18))])]
    outs = llm.generate([{"prompt": "Once upon a time"}] + [{"prompt": text, "multi_modal_data": {
        "image": images if len(images) > 1 else images[0]}} for text, images in prompts], GREEDY, use_tqdm=False)
    for out, (text, images) in zip(outs[1:], prompts):
        assert out.outputs[0].token_ids == processed_reference(model, llm.processor, text, images)
    assert len(outs[0].outputs[0].token_ids) == MAX_TOKENS


def test_token_id_prompts_with_images_are_expanded_as_their_text_is(model, llm):
    """vLLM's ``{"prompt_token_ids": ids, "multi_modal_data": ...}``: one placeholder token per image, each replaced
    by what the processor writes for that image (the same ids as the prompt's text gives), or ids that hold the
    expansions already; any other count of placeholders is refused, naming the field."""
    from paged_hf import LLM
    from vision_models import gemma3_processor, random_image, tiny_gemma3

    images = [random_image(1), random_image(2, (30, 18))]
    text = "A <image> and <image> too"
    tokenizer = llm.processor.tokenizer
    want = processed_reference(model, llm.processor, text, images)
    expanded = llm.processor(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()
    for ids in (tokenizer(text)["input_ids"], expanded):
        out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
        assert out[0].outputs[0].token_ids == want and out[0].prompt_token_ids == expanded
    with pytest.raises(ValueError, match="prompt_token_ids hold 1 image placeholders") as error:
        llm.generate({"prompt_token_ids": tokenizer("A <image>")["input_ids"], "multi_modal_data": {"image": images}},
                     GREEDY, use_tqdm=False)
    assert error.value.param == "multi_modal_data"
    # Gemma 3's placeholder (its begin-of-image token) expands to newlines, the image's tokens and their end
    gemma3, processor = tiny_gemma3(boi=512, eoi=513, image=514), gemma3_processor()
    gemma_llm = LLM(gemma3, processor.tokenizer, processor=processor, enforce_eager=True, block_size=4, num_blocks=64)
    # (at the text's start its SentencePiece tokenizer writes a space before them, after another image it does not)
    for text in ("Look <start_of_image> and <start_of_image> now", "<start_of_image><start_of_image> two"):
        by_text, by_ids = gemma_llm.generate([{"prompt": text, "multi_modal_data": {"image": images}},
                                              {"prompt_token_ids": processor.tokenizer(text)["input_ids"],
                                               "multi_modal_data": {"image": images}}], GREEDY, use_tqdm=False)
        assert by_ids.prompt_token_ids == by_text.prompt_token_ids, text
        assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids


def test_qwen2_vl_token_id_prompts_with_images_equal_generate():
    """Qwen2-VL's placeholder is its image token between <|vision_start|> and <|vision_end|>: one per image in the
    ids becomes the image's merged patches (as many image tokens), and the greedy tokens (M-RoPE positions from the
    expanded ids and the grids) equal ``generate``'s on the processed text."""
    from paged_hf import LLM
    from vision_models import qwen2_vl_processor, random_image, tiny_qwen2_vl

    model, processor = tiny_qwen2_vl(), qwen2_vl_processor()
    llm = LLM(model, processor.tokenizer, processor=processor, enforce_eager=True, block_size=4, num_blocks=128)
    images = [random_image(1, (28, 20)), random_image(2, (40, 12))]
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    for text in (f"Look {image} and {image} too", f"{image}{image} two"):
        ids = processor.tokenizer(text)["input_ids"]
        by_ids = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, GREEDY,
                              use_tqdm=False)[0]
        expanded = processor(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()
        assert by_ids.prompt_token_ids == expanded and expanded.count(515) > ids.count(515) == 2
        try:
            assert by_ids.outputs[0].token_ids == processed_reference(model, processor, text, images)
        finally:
            model.set_attn_implementation("paged")  # the reference ran sdpa


def test_idefics3_images_through_its_processor_are_tiles_counted_as_images():
    """Idefics3's processor cuts each image into crops plus a global view, each a run of placeholders after its
    marker: text and token-id prompts answer as generate on the processed text, and ``limit_mm_per_prompt`` counts
    images (global views), not tiles."""
    from paged_hf import LLM
    from vision_models import idefics3_processor, random_image, tiny_tiled

    model, processor = tiny_tiled("idefics3"), idefics3_processor()
    llm = LLM(model, processor.tokenizer, processor=processor, enforce_eager=True, block_size=4, num_blocks=128,
              limit_mm_per_prompt={"image": 2})
    images = [random_image(1, (40, 20)), random_image(2, (10, 10))]  # 2 and 4 crops
    text = "Look <image> and <image> too"
    want = processed_reference(model, processor, text, images)
    model.set_attn_implementation("paged")  # the reference ran sdpa
    by_text = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
    assert llm.llm_engine.get_stats()["num_encoded_images"] == 3 + 5  # every tile once
    by_ids = llm.generate({"prompt_token_ids": processor.tokenizer(text)["input_ids"],
                           "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
    assert by_text.outputs[0].token_ids == want and by_ids.outputs[0].token_ids == want
    assert by_ids.prompt_token_ids == by_text.prompt_token_ids
    with pytest.raises(ValueError, match="the request has 3 images; at most 2"):
        llm.generate({"prompt": "<image><image><image>", "multi_modal_data": {"image": images + images[:1]}},
                     GREEDY, use_tqdm=False)


def test_llm_takes_numpy_and_torch_images_as_their_pixels(model, llm):
    """vLLM's ``multi_modal_data`` takes numpy arrays and torch tensors of pixels as well as PIL images: uint8,
    channels last or first (first where both read so, as transformers' processors decide), grey without channels.
    Each gives the tokens of the same picture as a PIL image; any other array is refused, naming the field."""
    import numpy as np

    from vision_models import random_image

    image = random_image(3, (24, 20))
    pixels = np.asarray(image)  # [H, W, 3] uint8
    text = "Look <image> at it"
    want = processed_reference(model, llm.processor, text, [image])
    for form in (pixels, pixels.transpose(2, 0, 1).copy(), torch.from_numpy(pixels.transpose(2, 0, 1).copy())):
        out = llm.generate({"prompt": text, "multi_modal_data": {"image": form}}, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want, (type(form), form.shape)
    grey = np.asarray(image.convert("L"))
    assert llm.generate({"prompt": text, "multi_modal_data": {"image": grey}}, GREEDY, use_tqdm=False)[0] \
        .outputs[0].token_ids == processed_reference(model, llm.processor, text, [image.convert("L").convert("RGB")])
    for bad in (pixels.astype(np.float32) / 255, pixels[..., :2], pixels[None]):
        with pytest.raises(ValueError, match="an image array must be uint8"):
            llm.generate({"prompt": text, "multi_modal_data": {"image": bad}}, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_llm_runs_gemma3_images_through_its_processor():
    """Gemma 3's processor writes begin / image / end tokens and token_type_ids; the engine needs only the ids and
    pixels, and answers as generate does with the token types (two-way attention inside each image)."""
    from paged_hf import LLM
    from vision_models import gemma3_processor, random_image, tiny_gemma3

    model, processor = tiny_gemma3(boi=512, eoi=513, image=514), gemma3_processor()
    llm = LLM(model, processor.tokenizer, processor=processor, enforce_eager=True, block_size=4, num_blocks=64)
    text, images = "Look <start_of_image> and <start_of_image> now", [random_image(5), random_image(6)]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
    inputs = processor(text=[text], images=images, return_tensors="pt")
    assert "token_type_ids" in inputs
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                  pad_token_id=0, cache=DynamicCache(config=model.config), return_dict_in_generate=True,
                                  output_logits=True)
    tokens = expected.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    assert out.outputs[0].token_ids == tokens
    torch.testing.assert_close(token_logprobs(out.outputs[0]),
                               [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(expected.logits, tokens)],
                               atol=2e-5, rtol=0)


def test_llm_chat_reads_image_content_parts(model, llm):
    from vision_models import random_image

    image = random_image(3)
    parts = [{"type": "text", "text": "Look "}, {"type": "image_url", "image_url": {"url": data_url(image)}},
             {"type": "text", "text": " and "}, {"type": "image_pil", "image_pil": random_image(4)}]
    out = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    assert out.prompt == "user: Look <image> and <image>assistant:"
    assert out.outputs[0].token_ids == processed_reference(model, llm.processor, out.prompt,
                                                           [image, random_image(4)], add_special_tokens=False)


def test_image_detail_low_scales_the_image_down_and_high_keeps_it():
    """OpenAI's ``detail``: "low" hands the processor the image scaled to fit 512 pixels a side (aspect kept),
    "high" / "auto" / none the image as read; another value is refused naming it."""
    from vision_models import random_image

    from paged_hf.config import ParameterError
    from paged_hf.multimodal_prompts import split_chat

    big, small = random_image(5, (1030, 3)), random_image(6, (40, 30))

    def sizes(detail):
        parts = [{"type": "image_url", "image_url": {"url": image, "detail": detail}} for image in (big, small)]
        return [image.size for image in split_chat([{"role": "user", "content": parts}], lambda image: image)[1]]

    assert sizes("low") == [(512, 1), (40, 30)]
    assert sizes("high") == sizes("auto") == sizes(None) == [(1030, 3), (40, 30)]
    with pytest.raises(ParameterError, match=r"messages\.0: image_url\.detail must be one of \['auto', 'low', "
                                             r"'high'\], got 'medium'"):
        sizes("medium")


def test_a_chat_template_that_reads_content_as_a_string_gets_placeholders(model, llm):
    """A template written for plain strings (``{{ m['content'] }}``) would print the parts list: it gets the
    processor's image placeholder, a line per image, before the message's text (vLLM's "string" content format)."""
    from vision_models import random_image

    image = random_image(3)
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
    string_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    out = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False, chat_template=string_template)[0]
    assert out.prompt == "user: <image>\nWhat is this?\nassistant:"
    assert out.outputs[0].token_ids == processed_reference(model, llm.processor, out.prompt, [image],
                                                           add_special_tokens=False)


@pytest.mark.parametrize("image, message", [
    ("data:image/png;base64,not*base64", "base64 does not decode"),
    ("data:image/png;base64," + "aGVsbG8gd29ybGQ=", "could not be decoded"),  # "hello world"
    ("data:text/plain;base64,aGVsbG8=", "media type must be image"),
    ("https://example.com/cat.png", "remote image URLs are not allowed"),
    ("/etc/passwd", "local image files are not allowed"),
    ("huge", "at most 4096 pixels"),
])
def test_llm_refuses_bad_images(llm, image, message):
    from vision_models import random_image

    if image == "huge":
        image = data_url(random_image(5, (65, 64)))
    with pytest.raises(ValueError, match=message):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}], GREEDY,
                 use_tqdm=False)
    with pytest.raises(ValueError, match="multi_modal_data must be"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"video": image}}, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def gemma3_generate(model, attention: str, ids: torch.Tensor, mask: torch.Tensor, pixels: torch.Tensor, cache):
    """Greedy tokens and per-step logits of ``generate`` on a Gemma 3 with ``attention``; ``cache``: "paged" or
    "dynamic"."""
    model.set_attn_implementation(attention)
    options = dict(cache_implementation="paged") if cache == "paged" else dict(cache=DynamicCache(config=model.config))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, pixel_values=pixels, token_type_ids=(ids == 515).long(),
                             max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True, **options)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1).float()


def gemma3_batch():
    """Two Gemma 3 prompts of three and two images, the second left-padded by two (``[2, 25]`` ids and mask, and the
    five images' pixels)."""
    image = [513] + [515] * 4 + [514]
    first = [1, 5, 6, *image, 7, *image, 8, 9, *image, 10]
    second = [0, 0, 1, 5, *image, 7, *image, 8, 9, 10, 11, 12, 13, 14, 15]
    ids = torch.tensor([first, second])
    mask = (torch.arange(ids.shape[1]) >= torch.tensor([[0], [2]])).long()
    return ids, mask, random_pixels(5, 9)


def test_gemma3_images_through_generate_with_the_paged_attention_match_sdpa(caplog, monkeypatch):
    """The image tokens attend to each other both ways (transformers' or-mask from token_type_ids): generate with the
    "paged" attention answers those prefills with the exact dense attention over the PagedCache, warning once,
    and its tokens and logprobs equal sdpa on DynamicCache."""
    from vision_models import tiny_gemma3

    monkeypatch.setattr(attention, "_DENSE_WARNED", set())
    model = tiny_gemma3()
    ids, mask, pixels = gemma3_batch()
    tokens, logits = gemma3_generate(model, "sdpa", ids, mask, pixels, "dynamic")
    with caplog.at_level("WARNING", logger="paged_hf"):
        paged_tokens, paged_logits = gemma3_generate(model, "paged", ids, mask, pixels, "paged")
        gemma3_generate(model, "paged", ids, mask, pixels, "paged")
    assert paged_tokens.tolist() == tokens.tolist()
    torch.testing.assert_close(torch.log_softmax(paged_logits, -1), torch.log_softmax(logits, -1), atol=1e-5, rtol=0)
    assert sum("non-causal part" in r.getMessage() for r in caplog.records) == 1


def test_a_gemma3_image_must_fit_one_step():
    engine = PagedEngine(family_model("gemma3"), None, block_size=4, num_blocks=64, enforce_eager=True,
                         max_num_batched_tokens=3)
    ids, images = case_inputs(1, 3, "gemma3")
    with pytest.raises(ValueError, match="an image of 4 tokens must be computed in one step") as error:
        engine.add_request(ids, GREEDY, images=images)
    assert error.value.param == "images"


@pytest.mark.parametrize("budget", [5, 6, 7])
def test_gemma3_images_are_never_split_across_chunks(budget):
    """Chunks of 5-7 tokens would cut the 4-token images in the middle; the scheduler ends a chunk before an image
    it cannot finish, and every step's image queries see their whole image."""
    model = family_model("gemma3")
    engine = PagedEngine(model, None, block_size=4, num_blocks=128, enforce_eager=True,
                         max_num_batched_tokens=budget)
    outs = run_cases(engine, CASES, "gemma3")
    for out, case in zip(outs, CASES):
        tokens, logprobs = reference(model, *case, "gemma3")
        assert out.outputs[0].token_ids == tokens
        torch.testing.assert_close(token_logprobs(out.outputs[0]), logprobs, atol=2e-5, rtol=0)
    engine.check_invariants()


def test_a_compiled_engine_runs_image_steps_eagerly_and_the_rest_compiled():
    """torch.compile serves the steps without image tokens; the steps with them run eagerly on inputs_embeds (one
    engine, both kinds of step, the same tokens)."""
    model = family_model("llava")
    engine = PagedEngine(model, None, block_size=4, num_blocks=128, max_num_batched_tokens=13)
    assert engine.runner.compiled is not None
    outs = run_cases(engine, CASES[:3])
    assert [o.outputs[0].token_ids for o in outs] == [reference(model, *case)[0] for case in CASES[:3]]
    engine.check_invariants()


@pytest.mark.parametrize("family", ["llava", "idefics3"])
def test_llm_loads_a_vision_language_folder_with_its_processor(tmp_path, model, family):
    from paged_hf import LLM
    from vision_models import idefics3_processor, llava_processor, random_image, tiny_tiled

    model, processor = (tiny_tiled("idefics3"), idefics3_processor()) if family == "idefics3" else \
        (model, llava_processor())
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", enforce_eager=True, block_size=4, num_blocks=64)
    assert type(llm.model).__name__ == type(model).__name__ and type(llm.processor) is type(processor)
    text, image = "Look <image> at it", random_image(0, (40, 20))
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == processed_reference(model, processor, text, [image])


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_a_generated_image_token_stays_text_beside_deepstack_image_rows(family, caplog):
    """A DeepStack model writes its image rows at every token of the image token's id: a generated one (which
    ``generate`` embeds as text) in a step with image rows, another request's decode or a recomputed output after
    preemption, takes its own embedding and no DeepStack rows. Before, the forward raised (features 14, tokens 15):
    the mixed step ran again in parts, and the preempted request failed."""
    model = family_model(family)
    ids, images = case_inputs(2, 1, family)
    text_ids, _ = case_inputs(0, 2, family)
    forced = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0,
                            allowed_token_ids=[model.config.image_token_id])
    outs = []
    for options in ({}, {"num_blocks": 17, "preemption_mode": "recompute", "enable_prefix_caching": False}):
        engine = PagedEngine(model, None, **{"block_size": 4, "num_blocks": 128, "enforce_eager": True, **options})
        with caplog.at_level("WARNING", logger="paged_hf"):
            engine.add_request(text_ids, forced, request_id="text")
            engine.step()  # the text request's first token is the image token: it decodes beside the image prefills
            outs.append(engine.generate([ids, ids], forced, use_tqdm=False, images=[images, images]))
        assert not [r.getMessage() for r in caplog.records if "in parts" in r.getMessage()]
        assert all(out.error is None for out in outs[-1])
        engine.check_invariants()
        assert engine.get_stats()["kv_cache_used"] == 0
    assert engine.get_stats()["preemption_count"] > 0
    for out in outs[1]:
        assert out.outputs[0].token_ids == outs[0][0].outputs[0].token_ids
        torch.testing.assert_close(token_logprobs(out.outputs[0]), token_logprobs(outs[0][0].outputs[0]), atol=2e-5,
                                   rtol=0)


@pytest.mark.parametrize("family, change, message", [
    ("llava_next", lambda i: {"pixel_values": i["pixel_values"]}, r"llava_next images need images\['image_sizes'\]"),
    ("llava_onevision", lambda i: {**i, "image_sizes": -i["image_sizes"]}, "integer tensor .images, 2. of positive"),
    ("llava_next", lambda i: {**i, "image_sizes": torch.ones(2, 3, dtype=torch.long)}, r"image_sizes'\] must be"),
    ("llava_next", lambda i: {**i, "pixel_values": i["pixel_values"][:, 0]}, "images, patches, channels, height"),
    ("llava_onevision", lambda i: {**i, "pixel_values": i["pixel_values"][:, :2]}, "takes 5 patches but"),
    ("qwen3_vl", lambda i: {"pixel_values": i["pixel_values"]}, r"qwen3_vl images need images\['image_grid_thw'\]"),
    ("qwen2_5_vl", lambda i: {**i, "image_grid_thw": i["image_grid_thw"].float()}, "integer tensor .images, 3."),
    ("qwen3_vl_moe", lambda i: {**i, "pixel_values": i["pixel_values"][:, :-1]}, r"must be \[patches, 96\]"),
], ids=["next-no-sizes", "onevision-negative-sizes", "next-sizes-3-wide", "next-4d-pixels", "onevision-few-patches",
        "qwen3-no-grid", "qwen2.5-float-grid", "qwen3-moe-patch-width"])
def test_bad_tensors_of_the_sized_families_are_refused_naming_the_field(family, change, message):
    """LLaVA-NeXT / -OneVision need ``image_sizes`` and a patch row per image, the Qwen models an integer
    ``image_grid_thw`` and patches of the tower's width: each is refused at ``add_request``, naming the field (before,
    most passed, and the request failed in its first forward on a TypeError or a RuntimeError from the tower, after
    a failed step)."""
    ids, images = case_inputs(2, 1, family)
    engine = PagedEngine(family_model(family), None, block_size=4, num_blocks=128, enforce_eager=True)
    with pytest.raises(ValueError, match=message) as error:
        engine.add_request(ids, GREEDY, images=change(images))
    assert error.value.param == "images"
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("family", ["llava_next", "llava_onevision"])
def test_adjacent_images_of_the_packed_families_are_split_by_their_sizes(family):
    """"<image><image>": LLaVA-NeXT's and -OneVision's processors write the two images' runs with nothing between
    them, each as long as its image_sizes make it (88 and 34 tokens here). The engine splits the run by those
    lengths (before, it refused the prompt: "1 runs of image placeholder tokens for 2 images"); tokens and logprobs
    equal generate's."""
    from vision_models import NEXT_SIZES, llava_next_processor, llava_onevision_processor, random_image

    model = family_model(family)
    processor = llava_next_processor() if family == "llava_next" else llava_onevision_processor()
    inputs = processor(text=["Look <image><image> now"], images=[random_image(i, NEXT_SIZES[i]) for i in (1, 2)],
                       return_tensors="pt")
    ids, images = inputs["input_ids"][0].tolist(), {k: inputs[k] for k in ("pixel_values", "image_sizes")}
    engine = PagedEngine(model, None, block_size=4, num_blocks=128, enforce_eager=True)
    out = engine.generate([ids], GREEDY, use_tqdm=False, images=[images])[0]
    assert [(s.offset, s.length) for s in request_images(images, ids, model, None).spans] == [(5, 88), (93, 34)]
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        expected = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None,
                                  pad_token_id=0, return_dict_in_generate=True, output_logits=True,
                                  cache=DynamicCache(config=model.config))
    tokens = expected.sequences[0, len(ids):].tolist()
    assert out.error is None and out.outputs[0].token_ids == tokens
    torch.testing.assert_close(token_logprobs(out.outputs[0]),
                               [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in
                                zip(expected.logits, tokens)], atol=2e-5, rtol=0)
    engine.check_invariants()


@pytest.mark.parametrize("family", TILED)
def test_bad_tile_tensors_are_refused_naming_the_field(family):
    """A ``pixel_attention_mask`` that is not ``[1, tiles, H, W]`` of the pixels (before: a RuntimeError from the
    tower's first forward, after a failed step), and tiles that do not match the prompt's runs (counted as tiles)."""
    ids, images = case_inputs(2, 1, family)  # 6 tiles
    engine = PagedEngine(family_model(family), None, block_size=4, num_blocks=128, enforce_eager=True)
    mask = images["pixel_attention_mask"]
    fewer = {"pixel_values": images["pixel_values"][:, :-1]}
    for bad, message in (({**images, "pixel_attention_mask": mask[:, :, :8]}, r"must be \[1, tiles, height, width\]"),
                         ({**images, "pixel_attention_mask": mask[:, :-1]}, "got .1, 5, 16, 16."),
                         (fewer, "6 runs .* for 5 tiles: .* one run per tile")):
        with pytest.raises(ValueError, match=message) as error:
            engine.add_request(ids, GREEDY, images=bad)
        assert error.value.param == "images"
    assert not engine.has_unfinished_requests()


def test_an_empty_image_list_is_refused_naming_the_field():
    """``{"image": []}``: Idefics3's processor raised IndexError on it (a text prompt), and token ids read the
    expansion of no image (IndexError, or "max() arg is an empty sequence" with LLaVA-NeXT's); it is refused, naming
    ``multi_modal_data``, and nothing is queued."""
    from paged_hf import LLM
    from vision_models import idefics3_processor, tiny_tiled

    processor = idefics3_processor()
    llm = LLM(tiny_tiled("idefics3"), processor.tokenizer, processor=processor, enforce_eager=True, block_size=4,
              num_blocks=64)
    for prompt in ({"prompt": "Look <image>"}, {"prompt_token_ids": [1, 5, 6]}):
        with pytest.raises(ValueError, match=r"multi_modal_data\['image'\] is an empty list") as error:
            llm.generate({**prompt, "multi_modal_data": {"image": []}}, GREEDY, use_tqdm=False)
        assert error.value.param == "multi_modal_data"
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_string_chat_template_gets_qwens_image_between_its_vision_markers():
    """Qwen-VL's placeholder for a template that reads content as a string is its image token between
    <|vision_start|> and <|vision_end|>, as its own templates write it and vLLM's string format does (before: a bare
    <|image_pad|>, an image the model never saw without its markers); greedy tokens equal generate's on that text."""
    from paged_hf import LLM
    from vision_models import qwen2_vl_processor, random_image

    model, processor = family_model("qwen3_vl"), qwen2_vl_processor()
    llm = LLM(model, processor.tokenizer, processor=processor, enforce_eager=True, block_size=4, num_blocks=64)
    image = random_image(1, (28, 20))
    parts = [{"type": "text", "text": "What?"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    try:
        out = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False, chat_template=template)[0]
        assert out.prompt == "user: <|vision_start|><|image_pad|><|vision_end|>\nWhat?\nassistant:"
        assert out.outputs[0].token_ids == processed_reference(model, processor, out.prompt, [image],
                                                               add_special_tokens=False)
    finally:
        model.set_attn_implementation("paged")  # the reference ran sdpa


@pytest.mark.parametrize("family", ["llava_next", "llava_onevision"])
def test_an_image_hits_the_prefix_cache_whatever_the_prompts_other_images_pad_it_to(family):
    """The processor pads every image's patch rows to the prompt's longest; an image's digest is of its own rows, so
    the same first image hits its blocks in a prompt whose second image takes more patches (before: 3 patches alone,
    5 padded: another digest, only the text before it hit). Tokens equal generate's on the padded tensors."""
    from vision_models import llava_next_processor, llava_onevision_processor, random_image

    model = family_model(family)
    processor = llava_next_processor() if family == "llava_next" else llava_onevision_processor()
    first, second = random_image(1, (40, 20)), random_image(2, (30, 30))  # 3 and 5 patches
    engine = PagedEngine(model, None, block_size=4, num_blocks=256, enforce_eager=True)
    outs = []
    for text, images in (("Look <image> then", [first]), ("Look <image> then <image> x", [first, second])):
        inputs = processor(text=[text], images=images, return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        outs.append(engine.generate([ids], GREEDY, use_tqdm=False, images=[
            {k: inputs[k] for k in ("pixel_values", "image_sizes")}])[0])
    assert inputs["pixel_values"].shape[1] == 5
    tensors = {k: inputs[k] for k in ("pixel_values", "image_sizes")}
    first_end = request_images(tensors, ids, model, None).spans[0].end
    assert outs[1].metrics.num_prefix_cached_tokens >= first_end // 4 * 4  # every block of the first image
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        expected = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None,
                                  pad_token_id=0, cache=DynamicCache(config=model.config))[0, len(ids):].tolist()
    assert outs[1].outputs[0].token_ids == expected
    engine.check_invariants()
