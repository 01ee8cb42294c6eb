"""PagedCache behaviour outside the generate matrix: bad input, pool sizing and exhaustion, sliding windows,
direct forward calls, registration."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

import paged_hf
from paged_hf.patches import generate_v5
from models import tiny_model
from test_generate_exact import left_padded_batch


def test_bad_cache_config_names_field_and_allowed_values():
    model = tiny_model("llama", "paged")
    batch = left_padded_batch()
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['blocksize'\].*allowed keys are \['block_size'"):
        model.generate(**batch, max_new_tokens=2, cache_implementation="paged", cache_config={"blocksize": 16})
    with pytest.raises(ValueError, match=r"block_size must be a power of two .* got 12"):
        model.generate(**batch, max_new_tokens=2, cache_implementation="paged", cache_config={"block_size": 12})
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'auto'.*got 'int3'"):
        paged_hf.PagedCache(model.config, kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        paged_hf.PagedCache(model.config, num_blocks=0)
    with pytest.raises(ValueError, match=r"block_size must be even for kv_cache_dtype='int4'.*got block_size=1"):
        model.generate(**batch, max_new_tokens=2, cache_implementation="paged",
                       cache_config={"block_size": 1, "kv_cache_dtype": "int4"})
    with pytest.raises(ValueError, match=r"give num_blocks or memory_budget, not both"):  # neither is ignored
        model.generate(**batch, max_new_tokens=2, cache_implementation="paged",
                       cache_config={"num_blocks": 64, "memory_budget": 1 << 20})
    with pytest.raises(ValueError, match=r"memory_budget must be a positive int \(bytes\) or None, got 1000000.0"):
        model.generate(**batch, max_new_tokens=2, cache_implementation="paged", cache_config={"memory_budget": 1e6})
    with pytest.raises(ValueError, match=r"cache_config must be a dict with keys from \['block_size'.* got list"):
        model.generate(**batch, max_new_tokens=2, cache_implementation="paged", cache_config=["block_size", 16])


def test_pool_too_small_for_batch_fails_before_allocation():
    model = tiny_model("llama", "paged")
    batch = left_padded_batch()  # 32 real tokens: 8 blocks of 4 at least
    with pytest.raises(ValueError, match=r"num_blocks=3 is too small for the batch: its prompts alone need 10 blocks"):
        model.generate(**batch, max_new_tokens=2, cache_implementation="paged",
                       cache_config={"block_size": 4, "num_blocks": 3})
    cache = paged_hf.PagedCache(model.config, block_size=4, num_blocks=3)
    with pytest.raises(ValueError, match=r"num_blocks=3 is too small for the batch: its prompts need 10 blocks"):
        model.generate(**batch, max_new_tokens=2, cache=cache)
    assert all(not group.storages for group in cache.kv.groups), "no pool tensor may be allocated"
    assert cache.stats().kv_cache_used == 0


def test_pool_no_device_can_hold_fails_at_construction():
    model = tiny_model("llama", "paged")
    with pytest.raises(ValueError, match=r"the KV pool needs [\d.]+ GiB \(1000000000000 blocks x 3 layers\) but cpu "
                                         r"has [\d.]+ GiB available: lower num_blocks"):
        paged_hf.PagedCache(model.config, num_blocks=10**12)
    cache = paged_hf.PagedCache(model.config, num_blocks=64)  # one that fits still builds, and allocates nothing yet
    assert cache.stats().kv_cache_total == 64 and all(not group.storages for group in cache.kv.groups)


def test_pool_exhaustion_mid_generate_says_how_to_size():
    model = tiny_model("llama", "paged")
    batch = left_padded_batch()
    cache = paged_hf.PagedCache(model.config, block_size=4, num_blocks=11)
    with pytest.raises(paged_hf.PagedCacheFullError, match=r"needs \d+ new blocks .* only \d+ of num_blocks=11"):
        model.generate(**batch, max_new_tokens=20, cache=cache)
    cache.check_invariants()
    cache.reset()
    assert cache.stats().kv_cache_used == 0


def test_memory_budget_sizes_pool():
    model = tiny_model("llama", "paged")
    per_block = 2 * 4 * 2 * 16 * 4 * model.config.num_hidden_layers  # K+V, block 4, 2 heads, dim 16, fp32
    cache = paged_hf.PagedCache(model.config, block_size=4, memory_budget=per_block * 50 + 7)
    model.generate(**left_padded_batch(), max_new_tokens=4, cache=cache)
    assert cache.stats().kv_cache_total == 50
    assert cache.stats().kv_cache_bytes == per_block * 50
    with pytest.raises(ValueError, match="memory_budget=10 bytes is below one block"):
        paged_hf.PagedCache(model.config, block_size=4, memory_budget=10)


def test_growable_pool_grows_by_a_quarter_not_by_doubling():
    model = tiny_model("llama", "paged")
    cache = paged_hf.PagedCache(model.config, block_size=4)
    model.generate(**left_padded_batch(), max_new_tokens=40, do_sample=False, cache=cache)
    stats = cache.stats()
    # the last new token is never fed back, so each row holds prompt + 39 tokens; pads take no block
    assert stats.kv_cache_used == sum(-(-(n + 39) // 4) for n in (3, 9, 14, 6))
    # doubling leaves up to half the pool idle (here 49 of 80 blocks); growing by >= 1/4 keeps >= 80% in use
    assert stats.kv_cache_used / stats.kv_cache_total >= 0.8, stats


@pytest.mark.parametrize("attention", ["paged", "sdpa"])
def test_sliding_layers_hold_only_their_window(attention):
    model = tiny_model("mistral", attention)  # window 6, every layer sliding
    batch = left_padded_batch()
    cache = paged_hf.PagedCache(model.config, block_size=2)
    out = model.generate(**batch, max_new_tokens=30, do_sample=False, pad_token_id=0, cache=cache)
    reference = tiny_model("mistral").generate(**batch, max_new_tokens=30, do_sample=False, pad_token_id=0)
    assert torch.equal(out, reference)
    (group,) = cache.kv.groups
    assert group.window == 6
    for table in (seq.tables[0] for seq in cache.rows):
        held = [b for b in table.blocks if b is not None]
        assert len(held) <= 6 // 2 + 1, "a row holds at most its window (plus the partly filled edge blocks)"
    cache.check_invariants()
    cache.reset()
    assert cache.stats().kv_cache_used == 0


def test_hybrid_model_has_one_group_per_layer_kind():
    cache = paged_hf.PagedCache(tiny_model("gemma2").config)
    assert [(g.window, g.layer_indices) for g in cache.kv.groups] == [(6, [0, 2]), (None, [1])]
    assert cache.is_sliding == [True, False, True]


@pytest.mark.parametrize("attention", ["paged", "sdpa"])
def test_direct_forward_calls_match_dynamic_cache(attention):
    """Prefill then token-by-token decode through model(...), without generate and without position_ids."""
    model = tiny_model("qwen2", attention)
    ids = left_padded_batch(lengths=(7, 7))["input_ids"]
    logits = {}
    for name, cache in (("dynamic", DynamicCache(config=model.config)), ("paged", paged_hf.PagedCache(model.config, block_size=4))):
        out = model(input_ids=ids, cache=cache, use_cache=True)
        steps = [out.logits[:, -1]]
        for _ in range(5):
            next_ids = steps[-1].argmax(-1, keepdim=True)
            steps.append(model(input_ids=next_ids, cache=cache, use_cache=True).logits[:, -1])
        logits[name] = torch.stack(steps)
    torch.testing.assert_close(logits["paged"], logits["dynamic"], atol=1e-5, rtol=1e-5)


def test_batch_size_change_needs_reset():
    model = tiny_model("llama", "paged")
    cache = paged_hf.PagedCache(model.config)
    model(input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="holds 2 sequences but the forward has batch size 1"):
        model(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True)
    cache.reset()
    model(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True)
    assert cache.get_seq_length() == 1


def test_crop_rolls_back_tokens_and_blocks():
    model = tiny_model("llama", "paged")
    cache = paged_hf.PagedCache(model.config, block_size=4)
    model(input_ids=torch.arange(3, 13).view(1, 10), cache=cache, use_cache=True)
    assert cache.stats().kv_cache_used == 3
    cache.crop(-5)
    assert cache.get_seq_length() == 5 and cache.stats().kv_cache_used == 2
    with pytest.raises(ValueError, match="negative number of tokens"):
        cache.crop(3)
    cache.check_invariants()


def test_unsupported_models_raise_not_implemented():
    t5 = transformers.T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    with pytest.raises(NotImplementedError, match="encoder-decoder"):
        paged_hf.PagedCache(t5)
    mamba = transformers.MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, state_size=4)
    with pytest.raises(NotImplementedError, match="state-space"):
        paged_hf.PagedCache(mamba)
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(mamba).eval()
    with pytest.raises(NotImplementedError, match="state-space"):
        model.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=2, cache_implementation="paged")
    # DeepSeek V3.2's sparse attention caches an indexer's keys beside its latent
    deepseek = transformers.DeepseekV32Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, kv_lora_rank=16)
    with pytest.raises(NotImplementedError, match="'deepseek_v32': its sparse attention"):
        paged_hf.PagedCache(deepseek)
    # Falcon-RW's ALiBi is its own code and needs a 2-D mask
    falcon = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                       alibi=True)
    with pytest.raises(NotImplementedError, match="Falcon with alibi=True"):
        paged_hf.PagedCache(falcon)


def test_layers_whose_kv_do_not_fit_the_pools_shapes_are_refused_by_name():
    """MiMo-V2's values are narrower than its keys (``v_head_dim``), and its sliding layers have twice the config's
    KV heads: one pool shape per group cannot hold them (a raw ``index_copy_`` error before); ``generate`` and the
    engine say which layer stores what."""
    config = transformers.AutoConfig.for_model(
        "mimo_v2_flash", vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        n_routed_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, v_head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(NotImplementedError, match="layer 0 stores keys of 2 heads x 24 dims and values of 2 heads x "
                                                  "16 dims, but its KV pool holds 2 heads x 24 dims"):
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, do_sample=False, cache_implementation="paged")
    config.v_head_dim = 24
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(NotImplementedError, match="layer 1 stores keys of 4 heads x 24 dims"):
        paged_hf.PagedEngine(model, None, num_blocks=16, block_size=4, enforce_eager=True)


def _generate_patched() -> bool:
    """Whether ``GenerationMixin.generate`` reaches paged_hf's ``_generate`` (which sits under transformers'
    keyword-deprecation wrappers, inside the function object transformers defined)."""
    cell = generate_v5._deprecation_cell(transformers.GenerationMixin.generate)
    inner = cell.cell_contents if cell is not None else transformers.GenerationMixin.generate
    return inner.__code__ is generate_v5._generate.__code__


def test_register_is_idempotent_and_unregister_restores_transformers():
    generate = transformers.GenerationMixin.generate
    prepare = transformers.GenerationMixin._prepare_cache_for_generation
    assert _generate_patched()
    paged_hf.register()
    assert transformers.GenerationMixin.generate is generate and _generate_patched()
    try:
        paged_hf.unregister()
        assert "paged" not in AttentionInterface._global_mapping
        assert "paged" not in AttentionMaskInterface._global_mapping
        assert not _generate_patched()
        assert transformers.GenerationMixin._prepare_cache_for_generation is not prepare
    finally:
        paged_hf.register()
    assert AttentionInterface._global_mapping["paged"] is paged_hf.paged_attention_forward
    assert transformers.GenerationMixin.generate is generate and _generate_patched()
    assert transformers.GenerationMixin._prepare_cache_for_generation is prepare


@pytest.mark.parametrize("paged", [False, True])
def test_generate_deprecation_warnings_name_the_callers_line(paged):
    """transformers' ``FutureWarning`` for a renamed ``generate`` keyword (``past_key_values`` -> ``cache``) names
    the line that called ``generate`` (``stacklevel=2``), with paged_hf's patch in place as without it."""
    model = tiny_model("llama")
    kwargs = {"cache_implementation": "paged"} if paged else {}
    with pytest.warns(FutureWarning, match="past_key_values") as caught:
        model.generate(torch.tensor([[3, 5, 7]]), max_new_tokens=2, do_sample=False, past_key_values=None,
                       pad_token_id=0, **kwargs)
    assert {w.filename for w in caught if "past_key_values" in str(w.message)} == {__file__}


