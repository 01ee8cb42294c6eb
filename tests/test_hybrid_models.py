"""Hybrid models: attention layers beside recurrent ones (Qwen3.5 and Qwen3-Next's gated DeltaNet, LFM2's short
convolutions, the Mamba2 mixers of Granite 4, Bamba, NemotronH and Falcon-H1, Jamba's and Zamba's Mamba), on tiny
random models.

The engine packs a step's sequences into one row; each recurrent layer runs its decodes as one batch and every other
sequence alone, on the state row of each sequence (``engine/recurrent_mixers.py``, ``kv/recurrent.py``). Its tokens
and logprobs must equal ``generate`` on ``DynamicCache`` + sdpa whatever the chunking and preemption; a request
whose forward raises must leave every other request's states as they were; ``generate`` on a ``PagedCache`` keeps
the recurrent states as ``DynamicCache`` does.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from paged_hf import PagedCache, PagedEngine, SamplingParams
from models import greedy_references, token_logprobs

MIXER = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=8)
DELTANET = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
FAMILIES = {
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"] * 2, **DELTANET),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"] * 2, **DELTANET),
    "lfm2": dict(layer_types=["conv", "full_attention"] * 2),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"] * 2, **MIXER),
    "bamba": dict(attn_layer_indices=[1, 3], **MIXER),
    "falcon_h1": dict(mamba_d_ssm=128, **MIXER),  # every layer attends and runs a Mamba2 mixer ("hybrid")
    "nemotron_h": dict(layers_block_type=["mamba", "attention", "mamba", "mlp"], mamba_num_heads=8,
                       mamba_head_dim=16, n_groups=1, ssm_state_size=16, chunk_size=8),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_d_state=8, mamba_expand=2, mamba_dt_rank=8),
    # a shared attention block beside two of the Mamba layers ("hybrid")
    "zamba": dict(layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=8, n_mamba_heads=2,
                  mamba_dt_rank=8, attention_head_dim=16),
}
LENGTHS = (3, 9, 14, 20, 7, 17)
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
_models: dict = {}
_references: dict = {}


def tiny_hybrid(family: str):
    """A seeded random ``family`` model: 64 wide, four layers (two recurrent, at least one attending). Its weights
    are drawn 10x wider than transformers' default (``initializer_range=0.2``): at the default, the recurrent
    states move the logits by about 1e-4, so a layer that loses its state at a chunk boundary still passes."""
    if family not in _models:
        config = AutoConfig.for_model(
            family, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            tie_word_embeddings=False, initializer_range=0.2, **FAMILIES[family])
        for name, value in (("head_dim", 16), ("moe_intermediate_size", 64), ("num_experts", 4),
                            ("num_local_experts", 4), ("num_experts_per_tok", 2)):
            if hasattr(config, name):
                setattr(config, name, value)
        torch.manual_seed(0)
        _models[family] = AutoModelForCausalLM.from_config(config).eval()
    return _models[family]


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in LENGTHS]


def references(family: str) -> list[tuple[list[int], list[float]]]:
    """(greedy tokens, their logprobs) of each prompt alone: ``generate`` on ``DynamicCache`` with sdpa."""
    if family not in _references:
        _references[family] = greedy_references(tiny_hybrid(family), prompts(), MAX_TOKENS)
    return _references[family]


def assert_equal_to_references(outs, refs) -> None:
    """Equal tokens; logprobs within 1e-4 (a scan over a prompt split in chunks sums in another order than over the
    whole prompt: about 1e-5; a lost or wrong state moves them by 0.1 and more, and the tokens)."""
    for out, (tokens, logprobs) in zip(outs, refs):
        assert out.error is None
        assert out.outputs[0].token_ids == tokens
        torch.testing.assert_close(token_logprobs(out.outputs[0]), logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", [
    {},
    {"block_size": 4, "max_num_batched_tokens": 5},  # prompts in chunks: a state carried from chunk to chunk
    {"block_size": 4, "num_blocks": 10, "max_num_batched_tokens": 7},  # recompute preemption: states rebuilt
], ids=["default", "chunked", "preempted"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_equals_generate(family, options):
    engine = PagedEngine(tiny_hybrid(family), None, **{"num_blocks": 128, **options})
    assert engine.kv.recurrent is not None and engine.runner.compiled is None
    assert_equal_to_references(engine.generate(prompts(), GREEDY, use_tqdm=False), references(family))
    stats = engine.get_stats()
    if "num_blocks" in options:
        assert stats["preemption_count"] > 0, "the tiny pool must force preemption"
    engine.check_invariants()
    assert stats["kv_cache_used"] == 0


@pytest.mark.parametrize("family", ["qwen3_5_text", "granitemoehybrid"])
def test_requests_joining_a_running_batch_and_forked_samples_continue_their_own_states(family):
    """Requests added while others decode (their prompts beside the decodes of a step), and ``n=2``: each sample is
    a fork that starts from a copy of its prompt's states (a fork reading zeros, or its parent's row after the
    parent moved on, gives other tokens)."""
    engine = PagedEngine(tiny_hybrid(family), None, num_blocks=128, block_size=4, max_num_batched_tokens=8)
    refs = references(family)
    ids = {}
    for i, prompt in enumerate(prompts()):
        ids[engine.add_request(prompt, SamplingParams(n=2 if i % 2 else 1, **_greedy()))] = i
        engine.step()
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out
    for i, out in done.items():
        assert len(out.outputs) == (2 if i % 2 else 1)
        assert_equal_to_references([_single(out, sample) for sample in out.outputs], [refs[i]] * len(out.outputs))
    engine.check_invariants()


def _greedy() -> dict:
    return dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)


def _single(out, sample):
    """``out`` as a one-sample output (``assert_equal_to_references`` reads ``outputs[0]``)."""
    return type("One", (), {"error": out.error, "outputs": [sample]})


@contextlib.contextmanager
def raising_after_the_recurrent_layers(model, poison: int):
    """The forward raises after every layer ran (the recurrent layers' states already computed) whenever ``poison``
    is among its input ids: a failure that, unless the staged states are dropped, corrupts the states of every
    sequence of the step when it runs again in parts."""
    seen = {}
    embed = model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: seen.update(poisoned=bool((args[0] == poison).any())))

    def final(module, args, output):
        if seen.get("poisoned"):
            raise RuntimeError(f"poisoned input: token {poison}")

    hook = model.model.layers[-1].register_forward_hook(final)
    try:
        yield
    finally:
        embed.remove()
        hook.remove()


@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2"])
def test_a_forward_that_raises_after_the_recurrent_layers_fails_its_request_alone(family):
    model = tiny_hybrid(family)
    refs = references(family)
    poison = next(t for t in range(3, 512) if all(t not in p + r[0] for p, r in zip(prompts(), refs)))
    bad = prompts()[1][:4] + [poison] + prompts()[1][4:]
    engine = PagedEngine(model, None, num_blocks=128, block_size=4, max_num_batched_tokens=16)
    with raising_after_the_recurrent_layers(model, poison):
        outs = engine.generate(prompts()[:3] + [bad] + prompts()[3:], GREEDY, use_tqdm=False)
    assert outs[3].outputs[0].finish_reason == "error" and "poisoned" in outs[3].error
    assert_equal_to_references(outs[:3] + outs[4:], refs)
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0


def test_options_the_recurrent_states_rule_out_are_refused_by_name(caplog):
    model = tiny_hybrid("qwen3_5_text")
    for options, field in (({"preemption_mode": "swap"}, "preemption_mode"),
                           ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                    "prompt_lookup_max": 3}}, "speculative_config"),
                           ({"kv_offloading_size": 1.0}, "kv_offloading_size")):
        with pytest.raises(ValueError, match=field):
            PagedEngine(model, None, num_blocks=32, **options)
    with caplog.at_level(logging.WARNING, logger="paged_hf"):
        engine = PagedEngine(model, None, num_blocks=32)
    assert "prefix caching is off" in caplog.text and not engine.kv.prefix_caching
    engine = PagedEngine(model, None, num_blocks=32, enable_prefix_caching=False, preemption_mode="recompute")
    assert not engine.kv.can_swap_out(engine.kv.new_sequence())


def test_a_model_without_attention_layers_is_refused():
    config = AutoConfig.for_model("mamba2", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_heads=8,
                                  head_dim=16, n_groups=1, state_size=16)
    with pytest.raises(NotImplementedError, match="state-space model"):
        PagedCache(config)


@pytest.mark.parametrize("attention", ["sdpa", "paged"])
@pytest.mark.parametrize("generation", [dict(), dict(num_beams=2),
                                        dict(do_sample=True, num_return_sequences=2, top_k=5)],
                         ids=["greedy", "beams", "samples"])
@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2", "falcon_h1", "nemotron_h"])
def test_generate_on_the_paged_cache_equals_dynamic_cache(family, generation, attention):
    """Left-padded rows; the recurrent layers' states are ``DynamicCache``'s (selected for beams, repeated for
    samples), the attention layers' K/V paged."""
    model = tiny_hybrid(family)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [0, 0, 12, 13, 14, 15, 16]])
    inputs = dict(input_ids=ids, attention_mask=(ids != 0).long(), max_new_tokens=8, pad_token_id=0,
                  eos_token_id=None, **{"do_sample": False, **generation})
    torch.manual_seed(1)
    expected = model.generate(**inputs)
    model.set_attn_implementation(attention)
    try:
        torch.manual_seed(1)
        assert torch.equal(model.generate(**inputs, cache_implementation="paged"), expected)
    finally:
        model.set_attn_implementation("sdpa")


def test_qwen3_5_checkpoints_class_serves_text():
    """Qwen3.5 checkpoints load as ``Qwen3_5ForConditionalGeneration`` (a vision tower beside the hybrid text model,
    M-RoPE positions): its text requests equal ``generate``'s, chunked or not."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration  # noqa: PLC0415 - this test only

    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                layer_types=["linear_attention", "full_attention"] * 2, **DELTANET)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=500, video_token_id=501,
                           vision_start_token_id=502, vision_end_token_id=503)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(ids):].tolist() for ids in prompts()]
    for options in ({}, {"block_size": 4, "max_num_batched_tokens": 5}):
        outs = PagedEngine(model, None, num_blocks=64, **options).generate(prompts(), params, use_tqdm=False)
        assert [out.outputs[0].token_ids for out in outs] == expected


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_images_equal_generate(moe):
    """Qwen3.5's images through the engine (the Qwen family's M-RoPE path; the hybrid text model's recurrent layers
    over the image rows): one, two and no images, with ``n=2``, whole or in chunks (an image is never split)."""
    from vision_models import generate_kwargs, tiny_qwen3_5, vision_case  # noqa: PLC0415 - Pillow: this test only

    model = tiny_qwen3_5(moe=moe)
    cases = [vision_case("qwen3_vl", num_images, seed) for num_images, seed in ((1, 0), (2, 1), (0, 2), (1, 3))]
    expected = [model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                               pad_token_id=0, **generate_kwargs("qwen3_vl", ids, images))[0, len(ids):].tolist()
                for ids, images in cases]
    for options in ({}, {"block_size": 4, "max_num_batched_tokens": 24}):
        engine = PagedEngine(model, None, num_blocks=128, **options)
        ids = [engine.add_request(prompt, SamplingParams(n=1 + i % 2, max_tokens=8, temperature=0, ignore_eos=True),
                                  images=images) for i, (prompt, images) in enumerate(cases)]
        done = {}
        while engine.has_unfinished_requests():
            done.update((out.request_id, out) for out in engine.step() if out.finished)
        for request_id, tokens in zip(ids, expected):
            assert [sample.token_ids for sample in done[request_id].outputs] == \
                [tokens] * len(done[request_id].outputs)
        engine.check_invariants()


def test_the_states_are_allocated_up_front_out_of_the_kv_memory_budget():
    """Each running sequence's states (and the queue head's) are allocated at start, out of ``kv_cache_memory``:
    the pool and the states fit it together; a budget the states alone fill is refused naming the options."""
    from paged_hf.engine.recurrent_mixers import state_shapes  # noqa: PLC0415
    from paged_hf.kv.recurrent import state_bytes  # noqa: PLC0415

    model = tiny_hybrid("qwen3_5_text")
    per_sequence = state_bytes(state_shapes(model))
    assert per_sequence == 2 * (4 * 16 * 16 * 4 + (2 * 2 * 16 + 4 * 16) * 4 * 4)  # recurrent + conv, float32
    budget = 0.001  # GiB
    engine = PagedEngine(model, None, kv_cache_memory=budget, max_num_seqs=8)
    assert engine.kv.recurrent.nbytes == 9 * per_sequence == engine.get_stats()["recurrent_state_bytes"]
    assert engine.kv.stats().kv_cache_bytes + engine.kv.recurrent.nbytes <= budget * 2**30
    with pytest.raises(ValueError, match="lower max_num_seqs or raise kv_cache_memory"):
        PagedEngine(model, None, kv_cache_memory=budget, max_num_seqs=1000)
    outs = engine.generate(prompts(), GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == [tokens for tokens, _ in references("qwen3_5_text")]


@pytest.mark.parametrize("family, continues", [("qwen3_5_text", True), ("lfm2", True), ("granitemoehybrid", True),
                                               ("jamba", False), ("zamba", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_start_probe_finds_the_mixers_whose_chunks_restart_from_zeros(family, continues, dtype):
    """Only Jamba's and Zamba's Mamba layers run continuing chunks a token at a time (a layer taken for one that
    loses its state would make every chunked prompt crawl), in float32 and bfloat16 alike."""
    from paged_hf.engine.recurrent_mixers import continues_chunks, find_mixers  # noqa: PLC0415
    from paged_hf.kv.recurrent import recurrent_layers  # noqa: PLC0415

    model = tiny_hybrid(family)
    mixers = find_mixers(model, recurrent_layers(model.config))
    copies = {idx: copy.deepcopy(mixer).to(dtype) for idx, mixer in mixers.items()}
    assert [continues_chunks(mixer, model.config.hidden_size) for mixer in copies.values()] == \
        [continues] * len(mixers)


def test_a_recurrent_module_that_gives_no_hidden_states_back_is_refused_by_name():
    """Zaya's recurrent part is its attention's q/k/v projection (a convolution and a recurrent value state, the
    cache passed by position, q/k/v returned): the engine, which runs a mixer per sequence and stitches its hidden
    states back, refuses it at start, naming the module (it failed at the first forward with a TypeError)."""
    config = AutoConfig.for_model("zaya", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(NotImplementedError, match="cannot serve ZayaForCausalLM: layer 0: .*ZayaCCAProjection "
                                                  "returned tuple"):
        PagedEngine(model, None, num_blocks=32)
    with pytest.raises(NotImplementedError, match="ZayaCCAProjection"):  # and again: nothing was half wrapped
        PagedEngine(model, None, num_blocks=32)


def test_a_deep_copy_of_a_model_an_engine_took_runs_its_own_mixers():
    """The engine wraps each recurrent layer's mixer; a deep copy of the model (to move it to another device, or to
    keep a reference) must run the copy's mixers. A wrapper closing over the original's bound forward ran the
    original's module, weights and device, from the copy."""
    from paged_hf.engine.recurrent_mixers import find_mixers  # noqa: PLC0415
    from paged_hf.kv.recurrent import recurrent_layers  # noqa: PLC0415

    model = tiny_hybrid("lfm2")
    PagedEngine(model, None, num_blocks=32)  # wraps the mixers
    copied = copy.deepcopy(model)
    for mixer in find_mixers(copied, recurrent_layers(copied.config)).values():
        assert mixer.forward.__self__ is mixer and mixer._paged_hf_mixer_forward.__self__ is mixer
    outs = PagedEngine(copied, None, num_blocks=128).generate(prompts(), GREEDY, use_tqdm=False)
    assert_equal_to_references(outs, references("lfm2"))
