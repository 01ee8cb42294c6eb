"""int4 KV (keys per channel of a block, values per token, newest partial block in full precision) through the
storage and ``PagedCache``.

1. Storage: a block's bytes are those of ``kv_quant`` on the block's own tokens (keys unrotated per channel, values
   rotated per token on the block's maximum), whichever way its tokens arrived (one chunk, decode steps, random
   chunks), also in bfloat16.
2. ``PagedCache`` + the "paged" attention against ``Int4ReferenceCache`` (full precision + fake-quantized full
   blocks, each query's own block exact: ``int4_reference.py``): the tail-to-block transition inside a chunked
   prefill and at decode, beam search forking rows with a partly full tail, and ``crop`` back into a quantized block
   (the policy: its kept tokens are dequantized into the tail); a dense attention over the same cache reads what is
   stored (the reference's "stored" policy). A one-layer stories260K: both caches then hold K/V from bit-identical
   projections, so the logits agree to float32 rounding (measured below 3e-7), while they differ from "auto" by
   far more (the quantization is really there).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import paged_hf
from kv_probe import read_blocks
from int4_reference import Int4ReferenceCache, fake_quantize_blocks, own_block_attention
from models import require_stories, story_text_ids, stories_tokenizer, tiny_model
from test_generate_exact import left_padded_batch
from paged_hf.kernels.fill_blocks import StorePlan
from paged_hf.kernels.kv_quant import quantize_block_values_ref, quantize_channels_ref
from paged_hf.quant import make_storage
from paged_hf.rotation import kv_rotation, rotate

BLOCK_SIZE = 4
HEADS, HEAD_DIM = 2, 16


# ---------------------------------------------------------------------------------------------------- storage


def store_sequence(storage, key, value, blocks: list[int], row: int, chunks: list[int]) -> None:
    """Writes one sequence's ``key``/``value`` ``[n, H, D]`` into ``blocks`` (and tail row ``row``) chunk by chunk,
    with the plans a forward of each chunk makes (built here, independently of ``metadata``)."""
    bs = storage.block_size
    start = 0
    for count in chunks:
        end = start + count
        positions = torch.arange(start, end)
        tail_slots = torch.where(positions >= end // bs * bs, row * bs + positions % bs, -1)
        filled = torch.arange(start // bs, end // bs)
        plan = StorePlan(tail_slots, torch.tensor(blocks)[filled], torch.full_like(filled, row),
                         filled * bs - start, (start - filled * bs).clamp_min(0))
        slots = torch.tensor(blocks)[positions // bs] * bs + positions % bs
        fresh = storage.write(slots, key[start:end], value[start:end], plan)
        storage.write_tails(fresh, plan)  # (a forward's attention would read between the two)
        start = end
    assert start == key.shape[0]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2 else
                                                                    torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_bytes_do_not_depend_on_how_tokens_arrive(dtype):
    gen = torch.Generator().manual_seed(0)
    n = 3 * BLOCK_SIZE + 2  # three full blocks and a partial tail
    key = torch.randn(n, HEADS, HEAD_DIM, generator=gen) + 3 * torch.randn(HEAD_DIM, generator=gen)  # channel bias
    value = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    ways = {"one chunk": [n], "decode": [1] * n, "chunks": [3, 5, 1, 4, 1]}
    storages = {}
    for i, (name, chunks) in enumerate(ways.items()):
        storage = make_storage("int4", 12, BLOCK_SIZE, HEADS, HEAD_DIM, dtype, "cpu")
        storage.ensure_tail_rows(3)
        blocks = [3 * i + b for b in range(4)][::-1]  # other blocks and rows for each way
        store_sequence(storage, key, value, blocks, row=i, chunks=chunks)
        storages[name] = (storage, blocks, i)
    first, blocks0, row0 = storages["one chunk"]
    for name, (storage, blocks, row) in storages.items():
        for pool in ("key_cache", "value_cache", "key_scale", "value_scale", "key_zero", "value_zero"):
            got, want = getattr(storage, pool)[blocks[:3]], getattr(first, pool)[blocks0[:3]]
            assert torch.equal(raw(got), raw(want)), f"{name}: {pool}"
        for tail in ("key_tail", "value_tail"):  # the partial block's two tokens, in the compute dtype
            assert torch.equal(raw(getattr(storage, tail)[row, :2]), raw(getattr(first, tail)[row0, :2])), name
    # the format: keys unrotated per channel over the block, values rotated per token (both from compute-dtype values)
    k = key[:BLOCK_SIZE].to(dtype).float()
    codes, scale, zero = quantize_channels_ref(k)
    assert torch.equal(first.key_cache[blocks0[0]], codes) and torch.equal(first.key_scale[blocks0[0]], scale)
    assert torch.equal(first.key_zero[blocks0[0]], zero)
    v = rotate(value[:BLOCK_SIZE], kv_rotation(HEAD_DIM)).to(dtype).float()
    codes, scale, zero = quantize_block_values_ref(v)
    assert torch.equal(first.value_cache[blocks0[0]], codes) and torch.equal(first.value_scale[blocks0[0]], scale)
    assert torch.equal(first.value_zero[blocks0[0]], zero)


def _no_unbacked_sizes(graph: torch.fx.GraphModule, example_inputs):
    """A dynamo backend that fails on any value whose size or number the graph learns only at run time (a boolean
    index, ``nonzero``, ``.item()``), then runs the graph as traced."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in graph.graph.nodes:
        found = free_unbacked_symbols(node.meta.get("example_value"))
        assert not found, f"{node.format_node()}: data-dependent {found}"
    return graph.forward


@pytest.mark.parametrize("kept", ["mixed", "all", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tail_writes_compile_without_data_dependent_shapes(dtype, kept):
    """``store_tails_ref`` compiles as one graph with no data-dependent size (a compiled ``generate`` traces it; the
    boolean index of its eager path gives inductor unbacked sizes, and a bfloat16 ``generate(compile_config=...)``
    on int4 failed in inductor's reinplace pass), and the tail pools its compiled path leaves equal the eager ones
    bit for bit, whether some, all or none of the tokens keep a tail slot."""
    from paged_hf.kernels.store_kv import store_tails_ref

    gen = torch.Generator().manual_seed(0)
    slots = {"mixed": [-1, 5, -1, 2, 7], "all": [1, 5, 0, 2, 7], "none": [-1] * 5}[kept]
    plan = StorePlan(torch.tensor(slots), *(torch.zeros(0, dtype=torch.long) for _ in range(4)))
    key, value = (torch.randn(5, HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    pools = {}
    for mode in ("eager", "compiled"):
        storage = make_storage("int4", 4, BLOCK_SIZE, HEADS, HEAD_DIM, dtype, "cpu")
        storage.ensure_tail_rows(2)
        storage.key_tail.copy_(torch.randn(storage.key_tail.shape, generator=gen.manual_seed(1)))
        storage.value_tail.copy_(torch.randn(storage.value_tail.shape, generator=gen.manual_seed(2)))
        if mode == "eager":
            store_tails_ref(key, value, storage.pool_tensors(), plan)
        else:
            torch.compiler.reset()
            torch.compile(store_tails_ref, fullgraph=True, backend=_no_unbacked_sizes)(
                key, value, storage.pool_tensors(), plan)
        pools[mode] = (storage.key_tail, storage.value_tail)
    for got, want in zip(pools["compiled"], pools["eager"]):
        assert torch.equal(raw(got), raw(want))
    kept_rows = [s for s in slots if s >= 0]
    flat = pools["eager"][0].view(-1, HEADS, HEAD_DIM)
    assert torch.equal(flat[kept_rows], key[[i for i, s in enumerate(slots) if s >= 0]])


def test_read_slots_reads_full_blocks_dequantized_and_the_tail_exact():
    gen = torch.Generator().manual_seed(1)
    n = 2 * BLOCK_SIZE + 3
    key, value = torch.randn(n, HEADS, HEAD_DIM, generator=gen), torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    storage = make_storage("int4", 4, BLOCK_SIZE, HEADS, HEAD_DIM, torch.float32, "cpu")
    storage.ensure_tail_rows(2)
    store_sequence(storage, key, value, [2, 0, 3], row=1, chunks=[5, 6])
    positions = torch.arange(n)
    slots = torch.tensor([2, 0, 3])[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    full = 2 * BLOCK_SIZE
    tail_slots = torch.where(positions >= full, 1 * BLOCK_SIZE + positions % BLOCK_SIZE, -1)
    k, v = storage.read_slots(slots, tail_slots)
    want_k, want_v = fake_quantize_blocks(key[:full].permute(1, 0, 2)[None], value[:full].permute(1, 0, 2)[None],
                                          BLOCK_SIZE)
    torch.testing.assert_close(k[:full], want_k[0].permute(1, 0, 2), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v[:full], want_v[0].permute(1, 0, 2), atol=1e-6, rtol=1e-6)
    assert torch.equal(k[full:], key[full:]) and torch.allclose(v[full:], value[full:], atol=1e-6)
    assert (k[:full] - key[:full]).abs().max() > 1e-3  # the full blocks really are quantized


# --------------------------------------------------------------------------------------- PagedCache vs reference


@pytest.fixture(scope="module")
def one_layer():
    """stories260K cut to its first layer (trained weights: a peaked attention that a wrong K/V changes)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(require_stories(), num_hidden_layers=1,
                                                              dtype=torch.float32).eval()
    return model


@pytest.fixture(scope="module")
def text_ids():
    return story_text_ids(stories_tokenizer(), 40)


@torch.no_grad()
def stepwise_logits(model, ids: torch.Tensor, chunks: list[int], cache, attention: str) -> list[torch.Tensor]:
    """Logits of ``ids`` ``[n]`` fed in ``chunks`` (a 1 is a decode step) through ``cache`` with ``attention``."""
    model.set_attn_implementation(attention)
    out, start = [], 0
    for count in chunks:
        out.append(model(input_ids=ids[None, start : start + count], cache=cache, use_cache=True).logits[0])
        start += count
    return out


def paged(model, kv_format="int4"):
    return paged_hf.PagedCache(model.config, block_size=BLOCK_SIZE, kv_cache_dtype=kv_format)


def assert_same_logits(got, want, auto, atol=1e-5):
    for a, b in zip(got, want):  # measured: <= 3e-7
        torch.testing.assert_close(a, b, atol=atol, rtol=atol)
    assert max((a - b).abs().max().item() for a, b in zip(got, auto)) > 1e-3, "int4 must differ from auto"


def generate_paged_and_reference(model, prompt: torch.Tensor, **options):
    """``generate`` on an int4 PagedCache with the "paged" attention, then on the reference cache with sdpa."""
    model.set_attn_implementation("paged")
    got = model.generate(prompt, cache_implementation="paged",
                         cache_config={"block_size": BLOCK_SIZE, "kv_cache_dtype": "int4"}, **options)
    model.set_attn_implementation(own_block_attention(BLOCK_SIZE))
    return got, model.generate(prompt, past_key_values=Int4ReferenceCache(model.config, BLOCK_SIZE), **options)


def test_tail_to_block_transitions_in_chunked_prefill_and_decode(one_layer, text_ids):
    """Chunks that end mid-block, fill a block from the tail plus new tokens, span whole blocks, then decode steps
    that fill blocks one token at a time."""
    chunks = [5, 3, 7, 8, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    ids = text_ids[: sum(chunks)]
    got = stepwise_logits(one_layer, ids, chunks, paged(one_layer), "paged")
    want = stepwise_logits(one_layer, ids, chunks, Int4ReferenceCache(one_layer.config, BLOCK_SIZE),
                           own_block_attention(BLOCK_SIZE))
    auto = stepwise_logits(one_layer, ids, chunks, paged(one_layer, "auto"), "paged")
    assert_same_logits(got, want, auto)


def test_dense_attention_over_int4_reads_what_is_stored(one_layer, text_ids):
    """The gathered path (sdpa over ``PagedCache.update``'s dense K/V) reads full blocks dequantized and the rest
    from the tail rows: the reference's "stored" policy. The paged attention differs where a query's own block is
    full (it reads that block exact)."""
    chunks = [6, 5, 1, 1, 1]
    ids = text_ids[: sum(chunks)]
    got = stepwise_logits(one_layer, ids, chunks, paged(one_layer), "sdpa")
    want = stepwise_logits(one_layer, ids, chunks, Int4ReferenceCache(one_layer.config, BLOCK_SIZE, "stored"), "sdpa")
    auto = stepwise_logits(one_layer, ids, chunks, paged(one_layer, "auto"), "paged")
    assert_same_logits(got, want, auto)
    own = stepwise_logits(one_layer, ids, chunks, paged(one_layer), "paged")
    assert max((a - b).abs().max().item() for a, b in zip(got, own)) > 1e-4


@torch.no_grad()
def test_beam_search_forks_rows_with_a_partly_full_tail(one_layer, text_ids):
    """Beam search reorders rows every step: rows fork other rows whose last block is partly full (its tokens live in
    the parent's tail row, which the fork copies), then fill it."""
    prompt = text_ids[None, :10]  # 2 full blocks and a tail of 2
    options = dict(max_new_tokens=9, num_beams=3, num_return_sequences=3, do_sample=False, output_scores=True,
                   return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    got, want = generate_paged_and_reference(one_layer, prompt, **options)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.sequences_scores, want.sequences_scores, atol=1e-5, rtol=1e-5)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_crop_back_into_a_quantized_block(one_layer, text_ids):
    """``crop`` (assisted decoding's rollback) to a length inside a block that was full: the kept tokens of that block
    come back into the tail at their dequantized values, and the block is quantized again when it refills."""
    cache, reference = paged(one_layer), Int4ReferenceCache(one_layer.config, BLOCK_SIZE)
    reference_attention = own_block_attention(BLOCK_SIZE)
    got = stepwise_logits(one_layer, text_ids[:17], [11, 6], cache, "paged")  # 4 full blocks + 1 token
    want = stepwise_logits(one_layer, text_ids[:17], [11, 6], reference, reference_attention)
    cache.crop(-7)  # back to 10 tokens: block 2 (positions 8..11) was full, 8 and 9 are kept
    reference.crop(-7)
    cache.check_invariants()
    seq = cache.rows[0]
    assert seq.num_tokens == 10 and len(seq.tables[0].blocks) == 3
    rest = torch.cat([text_ids[10:13], text_ids[20:26]])  # other tokens than before the crop
    chunks = [1, 3, 1, 1, 1, 1, 1]
    got += stepwise_logits(one_layer, rest, chunks[:1], cache, "paged")  # applies the rollback, block 2 not full yet
    storage = cache.kv.groups[0].storages[0]
    k_full, _ = read_blocks(storage, torch.tensor([seq.tables[0].blocks[2].block_id]))
    assert torch.equal(storage.key_tail[seq.row, :2], k_full[0, :2]), "kept tokens: the block's dequantized keys"
    got += stepwise_logits(one_layer, rest[1:], chunks[1:], cache, "paged")
    want += stepwise_logits(one_layer, rest, chunks, reference, reference_attention)
    auto = stepwise_logits(one_layer, text_ids[:17], [11, 6], paged(one_layer, "auto"), "paged")
    assert_same_logits(got, want, auto)


@torch.no_grad()
def test_assisted_decoding_crops_an_int4_cache_like_the_reference(one_layer, text_ids):
    """Assisted decoding proposes tokens with a draft model and crops the rejected ones from the main cache."""
    draft = transformers.AutoModelForCausalLM.from_pretrained(require_stories(), dtype=torch.float32).eval()
    prompt = text_ids[None, :9]
    options = dict(max_new_tokens=14, do_sample=False, assistant_model=draft, eos_token_id=None, pad_token_id=0,
                   output_scores=True, return_dict_in_generate=True)
    got, want = generate_paged_and_reference(one_layer, prompt, **options)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_own_block_reads_with_sliding_window_and_softcap(family, text_ids):
    """The own-block policy composes with a sliding window (mistral: 6, gemma2: 6 and softcap 50): chunks across
    blocks, then decode steps, against the reference."""
    overrides = {"num_hidden_layers": 1}
    if family == "gemma2":
        overrides["layer_types"] = ["sliding_attention"]
    model = tiny_model(family, "paged", **overrides)
    chunks = [5, 7, 9, 1, 1, 1, 1, 1]
    ids = text_ids[: sum(chunks)] % model.config.vocab_size
    got = stepwise_logits(model, ids, chunks, paged(model), "paged")
    want = stepwise_logits(model, ids, chunks, Int4ReferenceCache(model.config, BLOCK_SIZE),
                           own_block_attention(BLOCK_SIZE))
    auto = stepwise_logits(model, ids, chunks, paged(model, "auto"), "paged")
    assert_same_logits(got, want, auto)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_left_padded_rows_equal_their_single_runs(family):
    """generate's padded layouts (left pads, windows over the padded timeline, pad queries) read each row's own
    block like an unpadded run of that row: the same greedy tokens and logits (one-layer models, so both runs store
    the same codes)."""
    overrides = {"num_hidden_layers": 1}
    if family == "gemma2":
        overrides["layer_types"] = ["sliding_attention"]
    model = tiny_model(family, "paged", **overrides)
    batch = left_padded_batch()
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
                   output_logits=True, cache_implementation="paged",
                   cache_config={"block_size": BLOCK_SIZE, "kv_cache_dtype": "int4"})
    together = model.generate(**batch, **options)
    width = batch["input_ids"].shape[1]
    for row in range(batch["input_ids"].shape[0]):
        real = batch["attention_mask"][row].bool()
        alone = model.generate(input_ids=batch["input_ids"][row, real][None], **options)
        assert torch.equal(alone.sequences[0, real.sum():], together.sequences[row, width:])
        for step_alone, step_together in zip(alone.logits, together.logits):
            torch.testing.assert_close(step_alone[0], step_together[row], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_per_query_path_reads_own_blocks_like_the_batched_path(family, text_ids):
    """``attention.attend_at_positions`` (the torch path for generate's padded layouts: each query with its own
    sequence row, position and window start) gives what the batched path gives for the same queries: chunks across
    blocks, decode steps, a sliding window (mistral)."""
    from paged_hf import attention as paged_attention_module
    from paged_hf.metadata import METADATA_KEY

    differences = []

    def checking_attention(module, query, key, value, attention_mask, **kwargs):
        step = kwargs[METADATA_KEY]
        metadata, group, storage, fresh = step.metadata, step.group, step.storage, step.fresh
        flat = metadata.select_new_tokens(query)
        scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
        batched = paged_attention_module.paged_attention(flat, metadata, group, storage, scale, None, None, fresh)
        starts = None if group.window is None else metadata.positions - group.window + 1
        per_query = paged_attention_module.attend_at_positions(flat, metadata.token_seqs, metadata.positions, starts,
                                                               metadata, group, storage, scale, None, None, fresh)
        differences.append((batched - per_query).abs().max().item())
        return paged_attention_module.paged_attention_forward(module, query, key, value, attention_mask, **kwargs)

    model = tiny_model(family, "paged", num_hidden_layers=1)
    chunks = [5, 7, 9, 1, 1, 1]
    ids = text_ids[: sum(chunks)] % model.config.vocab_size
    transformers.AttentionInterface.register("paged", checking_attention)  # the cache hands "paged" its metadata
    rows, cache, start = torch.stack([ids, ids.flip(0)]), paged(model), 0  # two sequences: per-row fresh K/V
    try:
        with torch.no_grad():
            for count in chunks:
                model(input_ids=rows[:, start : start + count], cache=cache, use_cache=True)
                start += count
    finally:
        paged_attention_module.register_attention()
    assert len(differences) == len(chunks) and max(differences) < 1e-5, differences
