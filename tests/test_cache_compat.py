"""The transformers ``Cache`` API beyond generate's tokens: direct forward calls (with and without the mask and
positions), the dense per-layer views transformers' tests and users read, and torch.compile."""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig, DynamicCache

import paged_hf
from models import tiny_model


def padded_batch(side: str, lengths=(4, 9, 7), seed=0):
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, 512, (len(lengths), width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        if side == "left":
            mask[row, width - length :] = 1
        else:
            mask[row, :length] = 1
    return ids, mask


@pytest.mark.parametrize("attention", ["paged", "dense"])
@pytest.mark.parametrize("positions", [False, True], ids=["no_position_ids", "position_ids"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_direct_forward_calls_match_dynamic_cache(family, positions, attention):
    """A left-padded prefill then three one-token steps through ``model(...)`` with the growing mask: logits within
    1e-5 of DynamicCache at every real column, and no pad stored (blocks for the real tokens only)."""
    model = tiny_model(family, None if attention == "dense" else "paged")
    reference_model = tiny_model(family)
    ids, mask = padded_batch("left")
    caches = {"dynamic": DynamicCache(config=model.config), "paged": paged_hf.PagedCache(model.config, block_size=4)}
    logits = {}
    for name, cache in caches.items():
        runner = reference_model if name == "dynamic" else model
        step_ids, step_mask, outs = ids, mask, []
        for _ in range(4):
            extra = {"position_ids": (step_mask.cumsum(-1) - 1).clamp_min(0)[:, -step_ids.shape[1]:]} if positions else {}
            out = runner(input_ids=step_ids, attention_mask=step_mask, cache=cache, use_cache=True, **extra).logits
            outs.append(out[:, -1])
            if not outs[1:]:
                prefill = out
            step_ids = out[:, -1].argmax(-1, keepdim=True)
            step_mask = torch.cat([step_mask, torch.ones_like(step_ids)], dim=1)
        logits[name] = (prefill, torch.stack(outs))
    real = mask.bool()
    torch.testing.assert_close(logits["paged"][0][real], logits["dynamic"][0][real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits["paged"][1], logits["dynamic"][1], atol=1e-5, rtol=1e-5)
    cache = caches["paged"]
    assert cache.num_tokens == [n + 3 for n in mask.sum(1).tolist()]
    full = cache.kv.groups[[g.window for g in cache.kv.groups].index(None)]
    assert full.pool.num_used_blocks == sum(-(-n // 4) for n in cache.num_tokens), "pads must take no block"
    cache.check_invariants()


@pytest.mark.parametrize("attention", ["paged", "dense"])
@pytest.mark.parametrize("case", ["4d_mask", "4d_mask_restarting_positions", "no_mask_restarting_positions"])
def test_packed_sequences_and_the_callers_own_mask_match_dynamic_cache(case, attention):
    """Two sequences packed in one row: a caller's 4D mask reaches the attention as it is (the exact dense attention,
    also under the paged one), and without a 2D mask every column is a real token, whatever the positions say (they
    restart per sequence here; transformers reads no padding from them when a cache is given)."""
    model = tiny_model("llama", None if attention == "dense" else "paged")
    reference_model = tiny_model("llama")
    first, length = 5, 11
    ids = torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(0))
    allowed = torch.tril(torch.ones(length, length, dtype=torch.bool))
    allowed[first:, :first] = False  # the second sequence does not see the first
    mask = torch.zeros(1, 1, length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)
    restarting = torch.cat([torch.arange(first), torch.arange(length - first)])[None]
    inputs = {"4d_mask": dict(attention_mask=mask),
              "4d_mask_restarting_positions": dict(attention_mask=mask, position_ids=restarting),
              "no_mask_restarting_positions": dict(position_ids=restarting)}[case]
    want = reference_model(input_ids=ids, cache=DynamicCache(config=model.config), **inputs).logits
    cache = paged_hf.PagedCache(model.config, block_size=4)
    got = model(input_ids=ids, cache=cache, **inputs).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert cache.num_tokens == [length]
    cache.check_invariants()


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_dense_layer_views_hold_what_dynamic_cache_holds(family, side):
    """``cache.layers[i].keys`` / ``.values``: DynamicCache's shapes (a sliding layer: its last window - 1 columns)
    and its values at every real column; pads read as zeros."""
    model = tiny_model(family)
    ids, mask = padded_batch(side, lengths=(6, 9, 8))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True)
    dynamic = model.generate(**kwargs).cache
    paged = model.generate(**kwargs, cache_implementation="paged", cache_config={"block_size": 4}).cache
    assert isinstance(paged, DynamicCache) and isinstance(paged, paged_hf.PagedCache)
    for layer_paged, layer_dynamic in zip(paged.layers, dynamic.layers):
        for got, want in ((layer_paged.keys, layer_dynamic.keys), (layer_paged.values, layer_dynamic.values)):
            assert got.shape == want.shape
            real = (paged.columns[:, -got.shape[2]:] >= 0)[:, None, :, None].expand_as(got)
            torch.testing.assert_close(got[real], want[real], atol=1e-6, rtol=1e-6)
            assert not got[~real].any()
    assert [k.shape for k, _, _ in paged] == [k.shape for k, _, _ in dynamic]  # DynamicCache's iteration


# gemma2: a sliding window and softcapping (the explicit-softmax path); llama: grouped-query heads through torch's
# flash kernel (whose GQA probe must run eagerly, never traced)
@pytest.mark.parametrize("family", ["gemma2", "llama"])
def test_compiled_paged_decode_has_no_graph_break_or_recompile(family):
    """``generate(..., cache_implementation="paged", compile_config=CompileConfig(fullgraph=True, dynamic=False))``,
    the call as the README writes it, compiles the decode forward on the CPU too (transformers alone skips it off
    CUDA): with the "paged" attention the step has one static shape (block tables and pool sized by the width
    bucket of generate's max length), so it runs without a graph break and gives the eager tokens, and calls whose
    lengths share a bucket never recompile; the next bucket compiles once."""
    from torch._dynamo.utils import counters

    model = tiny_model(family, "paged")
    ids, mask = padded_batch("left", lengths=(5, 8))
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                  cache_implementation="paged", cache_config={"block_size": 4})
    eager = {n: model.generate(**kwargs, max_new_tokens=n) for n in (6, 8, 12)}
    torch.compiler.reset()
    counters.clear()
    compiled = model.generate(**kwargs, max_new_tokens=8, compile_config=CompileConfig(fullgraph=True, dynamic=False))
    assert hasattr(model, "_compiled_call"), "generate must have compiled the forward"
    assert torch.equal(compiled, eager[8])
    assert counters["stats"]["unique_graphs"] == 1, "the decode step must be one graph"
    # 8 + 6 and 8 + 8 tokens: 4 blocks of 4, one width bucket; 8 + 12: 5 blocks, the next bucket (8)
    for n, graphs in ((6, 1), (8, 1), (12, 2), (6, 2)):
        again = model.generate(**kwargs, max_new_tokens=n, compile_config=CompileConfig(fullgraph=True, dynamic=False))
        assert torch.equal(again, eager[n])
        assert counters["stats"]["unique_graphs"] == graphs, (n, dict(counters["stats"]))


def test_a_deep_copied_prompt_cache_serves_each_continuation_and_keeps_the_original():
    """transformers' prompt-reuse recipe: a prompt's cache is built once and ``copy.deepcopy``'d for each
    continuation. Each copy's layers must write to that copy (a layer holds its cache weakly, so the copy's layers
    are re-pointed when copied): the continuations equal ``DynamicCache``'s tokens and the original stays the
    prompt's length."""
    import copy

    model = tiny_model("llama", "paged")
    prompt = torch.randint(3, 512, (1, 9), generator=torch.Generator().manual_seed(1))
    prompt_cache = paged_hf.PagedCache(model.config, block_size=4)
    with torch.no_grad():
        model(prompt, past_key_values=prompt_cache)
    for seed in (2, 3):
        tail = torch.randint(3, 512, (1, 5), generator=torch.Generator().manual_seed(seed))
        ids = torch.cat([prompt, tail], 1)
        cache = copy.deepcopy(prompt_cache)
        assert all(layer.source is cache for layer in cache.layers)
        got = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache, pad_token_id=0)
        want = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=DynamicCache(), pad_token_id=0)
        assert torch.equal(got, want)
        assert prompt_cache.get_seq_length() == 9


def test_a_model_that_views_its_dense_kv_gets_them_contiguous_as_dynamic_cache_gives_them():
    """GPT-NeoX-Japanese runs its own attention and ``view``s the K/V its cache returns: the paged cache hands a dense
    read over contiguous (a left-padded batch of two crashed in ``view``)."""
    import transformers

    config = transformers.GPTNeoXJapaneseConfig(vocab_size=512, hidden_size=64, intermediate_multiple_size=2,
                                                num_hidden_layers=2, num_attention_heads=4,
                                                max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                                                pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPTNeoXJapaneseForCausalLM(config).eval()
    ids = torch.tensor([[0, 0, 0, 5, 6, 7], [8, 9, 10, 11, 12, 13]])
    options = dict(attention_mask=(ids != 0).long(), max_new_tokens=8, do_sample=False, eos_token_id=None,
                   pad_token_id=0)
    reference = model.generate(input_ids=ids, **options)
    paged = model.generate(input_ids=ids, cache_implementation="paged", cache_config={"block_size": 4}, **options)
    assert torch.equal(paged, reference)
