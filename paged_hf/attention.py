"""The ``"paged"`` attention implementation: reads K/V straight from a ``PagedCache``'s blocks.

``PagedCache.update`` (and the engine's cache) puts the forward's ``AttentionMetadata`` into the layer's ``kwargs``
(the same dict transformers then passes to the attention function). Without metadata (no cache, another cache
class, or a model that calls ``update`` without ``kwargs``) the function attends densely over the K/V and mask it
was given, so a model loaded with ``attn_implementation="paged"`` works everywhere.

A format with a full-precision tail (int4) stores in two steps around the attention: ``update`` quantizes the
blocks that fill, the attention reads each query's own block exact (the tail rows as they were before the forward,
and the forward's new K/V handed over as ``storage.FreshKV``), then writes the new tail rows.
"""

from __future__ import annotations

import logging

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from . import latent_attention, ops
from .patches import masks_v5
from .kernels.attention_ref import paged_attention_core
from .metadata import METADATA_KEY, AttentionBypassed, LayerStep, take_step
from .ops import OpStep
from .rotation import rotate, unrotate

ATTENTION_NAME = "paged"
logger = logging.getLogger("paged_hf")


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention signature. ``query`` is ``[B, heads, q, head_dim]``; returns ``[B, q, heads, head_dim]``."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    step = kwargs.get(METADATA_KEY)
    handed = take_step(step.layer if step is not None else getattr(module, "layer_idx", None))
    step = step if step is not None else handed  # an update without kwargs (GPT-NeoX, Falcon): by layer index
    up = None
    if step is not None:
        if step.latent is None:
            _check_stored(module, key, value, step)
        else:  # multi-head latent attention: fold the up-projection into the query (``latent_attention``)
            up = latent_attention.up_projection(module, query.shape[1], step.latent)
            latent_attention.check_expansion(module, key, value, step, up)
        if attention_mask is not None and isinstance(step, LayerStep) and step.dense:
            step = None  # a mask the paged attention does not express: the dense attention over the layer's K/V
    if step is not None and step.latent is not None:
        return _attend_latent(step, query, up, scale, softcap, s_aux), None
    if step is None:
        if softcap is None and s_aux is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scale)
        causal = kwargs.get("is_causal")
        if attention_mask is None and query.shape[2] > 1 and (getattr(module, "is_causal", True) if causal is None
                                                              else causal):
            # sdpa's mask builder leaves out a plain causal mask (None: sdpa's ``is_causal``, aligned top-left)
            attention_mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
        return dense_attention(query, key, value, attention_mask, scale, softcap, s_aux), None
    return _attend_step(step, query, scale, softcap, s_aux), None


def _attend_latent(step, query: torch.Tensor, up: torch.Tensor, scale, softcap, sinks) -> torch.Tensor:
    """A multi-head latent attention layer's query ``[B, heads, q, nope + rope]`` -> ``[B, q, heads, v]``: the
    forward's new tokens through ``latent_attention.attend_packed`` (the compiled forward's op, or eagerly), or,
    where its layout needs the per-token torch path (generate's pad columns, a query of the last columns, a
    softcap or sinks), every query folded over the rows."""
    rope = step.stored[2]
    if softcap is None and sinks is None:
        if isinstance(step, OpStep):
            return ops.attend_latent(step, query, up, scale, rope)
        metadata = step.metadata
        if query.shape[2] == metadata.query_len and metadata.pad_queries is None and step.group.window_starts is None \
                and step.group.window is None:
            out = latent_attention.attend_packed(
                metadata.select_new_tokens(query), up, step.storage, step.group.block_tables, metadata.seq_lens,
                metadata.query_start_loc, metadata.num_decodes, scale, rope, attend_packed)
            return metadata.scatter_new_tokens(out)
    out = _attend_step(step, latent_attention.absorb_query(query, up, rope), scale, softcap, sinks)
    return latent_attention.expand_output(out, up, step.latent, query.shape[-1] - rope)


def _attend_step(step, query: torch.Tensor, scale, softcap, sinks) -> torch.Tensor:
    """The paged attention of ``query`` ``[B, heads, q, head_dim]`` over the blocks ``step`` says: ``[B, q, heads,
    head_dim]`` (the compiled forward's one custom op, or the eager kernels and a tail format's tail writes)."""
    if isinstance(step, OpStep):
        return ops.attend(step, query, scale, softcap, sinks)
    if query.shape[2] != step.metadata.query_len:  # the forward's last columns only
        out = attend_columns(query, step, scale, softcap, sinks)
    else:
        out = attend_new_tokens(query, step, scale, softcap, sinks)
    if step.fresh is not None and step.writes_tails:  # a tail format: the tail rows were read as they were before
        step.storage.write_tails(step.fresh, step.group.store_plan)
    return out


def attend_new_tokens(query: torch.Tensor, step: LayerStep, scale, softcap, sinks) -> torch.Tensor:
    """The attention of the forward's query ``[B, heads, q, head_dim]`` (every column) over the blocks: ``[B, q,
    heads, head_dim]``, the pad columns after real tokens (``pad_queries``) attended at their bounds."""
    metadata, group, storage, fresh = step.metadata, step.group, step.storage, step.fresh
    flat = metadata.select_new_tokens(query)  # [n, heads, head_dim], packed by sequence
    if group.window_starts is None:
        packed = paged_attention(flat, metadata, group, storage, scale, softcap, sinks, fresh)
    else:  # a window over a padded timeline: per-token bounds
        packed = attend_at_positions(flat, metadata.token_seqs, metadata.positions, group.window_starts, metadata,
                                     group, storage, scale, softcap, sinks, fresh)
    out = metadata.scatter_new_tokens(packed)
    if metadata.pad_queries is not None and metadata.pad_queries.widen(step.group_index):
        pads = metadata.pad_queries
        queries = query.transpose(1, 2).reshape(-1, query.shape[1], query.shape[3]).index_select(0, pads.index)
        result = attend_at_positions(queries, pads.rows, pads.positions, pads.window_starts[step.group_index],
                                     metadata, group, storage, scale, softcap, sinks, fresh)
        out = out.reshape(-1, *out.shape[2:]).index_copy(0, pads.index, result.to(out.dtype)).view(out.shape)
    return out


def attend_columns(query: torch.Tensor, step, scale, softcap, sinks) -> torch.Tensor:
    """The attention of a query ``[B, heads, k, head_dim]`` of the last ``k`` of the forward's ``q`` columns of each
    row, as the full query's would be: Gemma 3n and Gemma 4 run the layers that read another layer's K/V over the
    kept logits' columns alone in ``generate``'s prefill (``_maybe_slice_kv_shared_inputs``). Returns ``[B, k,
    heads, head_dim]``, zeros in a pad column before its row's first token. Each column attends at its position
    (``attend_at_positions``): the torch path, once per prefill of such a layer."""
    metadata, batch, heads, kept, head_dim = step.metadata, *query.shape
    if kept > metadata.query_len:
        raise ValueError(f"a query of {kept} columns in a forward of {metadata.query_len}")
    rows, positions, starts = metadata.column_targets(step.group_index)
    device = rows.device
    columns = (torch.arange(batch, device=device)[:, None] * metadata.query_len
               + torch.arange(metadata.query_len - kept, metadata.query_len, device=device)[None, :]).flatten()
    rows, positions = rows.index_select(0, columns), positions.index_select(0, columns)
    attending = (rows >= 0).nonzero().squeeze(1)
    flat = query.transpose(1, 2).reshape(batch * kept, heads, head_dim)
    result = attend_at_positions(
        flat.index_select(0, attending), rows.index_select(0, attending), positions.index_select(0, attending),
        None if starts is None else starts.index_select(0, columns).index_select(0, attending), metadata,
        step.group, step.storage, scale, softcap, sinks, step.fresh)
    out = flat.new_zeros(flat.shape).index_copy_(0, attending, result.to(flat.dtype))
    return out.view(batch, kept, heads, head_dim)


def _check_stored(module, key: torch.Tensor, value: torch.Tensor, step) -> None:
    """``AttentionBypassed`` when the K/V handed to the attention are not the ones the layer stored: the model changed
    them after its cache update (JetMoE tiles its heads, DeepSeek's MLA caches a latent it expands, DiffLlama hands
    each half of its values to an attention call of its own), and the blocks the paged attention reads do not hold
    them. Their shapes are checked against ``step.stored`` (kv_heads, key and value head_dim); an eager step also
    knows the very tensors the update returned (a change that keeps the shapes)."""
    stored = step.stored
    if (key.shape[1], key.shape[-1], value.shape[-1]) != stored:
        raise AttentionBypassed(
            f"{type(module).__name__} hands its attention K/V of {key.shape[1]} heads x {key.shape[-1]} dims (values "
            f"{value.shape[-1]}) but stored {stored[0]} heads x {stored[1]} dims (values {stored[2]}) in the cache: "
            f"it changes its K/V after storing them, which the paged attention, reading the stored blocks, cannot "
            f"follow. PagedEngine cannot serve it; generate runs it on the PagedCache with a dense attention "
            f"(attn_implementation='sdpa' or 'eager')")
    if isinstance(step, LayerStep) and (key is not step.key or value is not step.value):
        raise AttentionBypassed(
            f"{type(module).__name__} hands its attention K/V other than those its cache update returned: it changes "
            f"its K/V after storing them, which the paged attention, reading the stored blocks, cannot follow. "
            f"PagedEngine cannot serve it; generate runs it on the PagedCache with a dense attention "
            f"(attn_implementation='sdpa' or 'eager')")


def paged_attention(flat_query, metadata, group, storage, scale, softcap, sinks, fresh=None) -> torch.Tensor:
    """Attention of a forward's packed new tokens ``[n, heads, head_dim]`` over their sequences' blocks.

    The first ``num_decodes`` sequences (one token each) go through the batched decode kernel, the rest through
    the varlen prefill kernel: two slices of the packed batch, no per-layer index building. The storage's kernel
    set (Triton on CUDA, the torch references elsewhere) was chosen when its pool was made. A storage whose keys
    are stored rotated gets the query rotated the same way (scores are unchanged), one whose values are stored
    rotated gets the output rotated back; both rotations run in float32 and their results return to the query's
    dtype, so a bf16/fp16 model attends with bf16/fp16 queries (the kernels' tensor-core path) in every format, and
    a float32 model stays float32 throughout. A format with a full-precision tail reads each query's own block in
    full precision in the same kernel call: its older tokens from the sequence's tail row (``metadata.tail_rows``),
    the forward's own from ``fresh`` (``storage.FreshKV``).
    """
    return attend_packed(flat_query, storage, group.block_tables, metadata.seq_lens, metadata.query_start_loc,
                         metadata.num_decodes, metadata.prefill_query_start_loc, _tail_rows(metadata, storage), fresh,
                         group.window, scale, softcap, sinks)


def attend_packed(flat_query, storage, tables, seq_lens, query_start_loc, num_decodes: int, prefill_query_start_loc,
                  tail_rows, fresh, window, scale, softcap, sinks) -> torch.Tensor:
    """``paged_attention`` on plain tensors and ints (what the ``paged_hf::paged_attention`` op runs too): the first
    ``num_decodes`` of the ``seq_lens.shape[0]`` sequences decode, the rest prefill (``prefill_query_start_loc``:
    their ``query_start_loc``, from 0); ``tail_rows``: a tail format's rows, else None."""
    query = flat_query
    if storage.key_rotation is not None:
        query = rotate(flat_query, storage.key_rotation).to(flat_query.dtype)
    kernels, pools = storage.kernels, storage.pool_tensors()
    options = dict(scale=scale, sliding_window=window, softcap=softcap, sinks=sinks)
    fresh_kv = (None, None) if tail_rows is None else (fresh.key, fresh.value)
    if num_decodes == seq_lens.shape[0]:
        out = kernels.decode_attention(query, pools, tables, seq_lens, tail_rows=tail_rows, fresh_key=fresh_kv[0],
                                       fresh_value=fresh_kv[1], **options)
    elif num_decodes == 0:
        out = kernels.prefill_attention(query, pools, tables, seq_lens, query_start_loc, tail_rows=tail_rows,
                                        fresh_key=fresh_kv[0], fresh_value=fresh_kv[1], **options)
    else:  # mixed engine step: decodes first, then prefill chunks
        d = num_decodes
        out = torch.empty_like(query)
        rows = (None, None) if tail_rows is None else (tail_rows[:d], tail_rows[d:])
        head = [None if t is None else t[:d] for t in fresh_kv]
        rest = [None if t is None else t[d:] for t in fresh_kv]
        out[:d] = kernels.decode_attention(query[:d], pools, tables[:d], seq_lens[:d], tail_rows=rows[0],
                                           fresh_key=head[0], fresh_value=head[1], **options)
        out[d:] = kernels.prefill_attention(query[d:], pools, tables[d:], seq_lens[d:], prefill_query_start_loc,
                                            tail_rows=rows[1], fresh_key=rest[0], fresh_value=rest[1], **options)
    return out if storage.value_rotation is None else unrotate(out, storage.value_rotation).to(flat_query.dtype)


def _tail_rows(metadata, storage) -> torch.Tensor | None:
    return metadata.tail_rows if storage.has_tail else None


def attend_at_positions(queries, rows, positions, window_starts, metadata, group, storage, scale, softcap,
                        sinks, fresh=None) -> torch.Tensor:
    """``[E, heads, head_dim]`` queries, each of sequence ``rows[e]`` seeing its keys at positions
    ``<= positions[e]`` (and ``>= window_starts[e]`` when given): the torch path for generate's padded layouts
    (pad columns after real tokens, windows over a padded timeline), which the kernels' contiguous-query layout
    does not express. Rare, and small: one query per row."""
    queries = rotate(queries, storage.key_rotation)
    tail_rows = _tail_rows(metadata, storage)
    fresh_kv = {}
    if tail_rows is not None:  # each query's sequence's new tokens, [E, max new, heads, head_dim]
        starts = metadata.query_start_loc.index_select(0, rows)
        num_fresh = metadata.query_start_loc.index_select(0, rows + 1) - starts
        index = (starts[:, None] + torch.arange(metadata.max_query_len, device=starts.device)[None, :])
        index = index.clamp_max(fresh.key.shape[0] - 1)
        fresh_kv = dict(fresh_keys=fresh.key[index], fresh_values=fresh.value[index], num_fresh=num_fresh)
    out = paged_attention_core(
        queries.unsqueeze(2), positions.unsqueeze(1), storage.pool_tensors(), group.block_tables.index_select(0, rows),
        metadata.seq_lens.index_select(0, rows), scale, group.window, softcap, sinks,
        window_starts=None if window_starts is None else window_starts.unsqueeze(1),
        tail_rows=None if tail_rows is None else tail_rows.index_select(0, rows), **fresh_kv,
    ).squeeze(2)
    return unrotate(out, storage.value_rotation)


def dense_attention(query, key, value, attention_mask, scale, softcap=None, sinks=None) -> torch.Tensor:
    """Plain attention over dense K/V with an HF mask (bool: True = attend; float: additive), softcap and sinks."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    if sinks is not None:
        sink = sinks.view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1).to(scores.dtype)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def paged_mask(*args, **kwargs):
    """Mask builder registered for ``"paged"``. Without a ``PagedCache`` prefill (``masks_v5.take_mask_cache``) the
    attention is the dense fallback, which needs sdpa's mask: that one. A ``PagedCache`` prefill whose mask is plain
    (causal, its window, padding) gets None: the paged attention derives it from its metadata. One whose mask adds a
    part the metadata does not say (an ``or_mask_function`` / ``and_mask_function`` / ``block_sequence_ids``, see
    ``_has_overlay``: Gemma 3's image tokens attending to each other both ways, a prefix-LM's prefix) gets sdpa's
    exact mask, and the cache answers the forward densely (``PagedCache.answer_densely``, one warning per model
    type): the exact attention, never a causal approximation."""
    cache = masks_v5.take_mask_cache()
    if cache is None:
        return sdpa_mask(*args, **kwargs)
    if not _has_overlay(kwargs):
        if cache.leave_mask_to_paged():
            return None
    elif cache.answer_densely():
        _warn_dense_once(kwargs.get("config"))
    return sdpa_mask(*args, **kwargs)


def _has_overlay(kwargs) -> bool:
    """Whether a prefill's mask adds a part to its causal (or sliding) one: transformers sets ``use_vmap`` for an
    or/and mask function and refuses the causal skip for block ids; a plain causal mask that a model materializes on
    purpose (``allow_is_causal_skip=False``: Falcon) is ``causal_mask_function`` itself."""
    if kwargs.get("use_vmap", False):
        return True
    return not kwargs.get("allow_is_causal_skip", True) and kwargs.get("mask_function") is not causal_mask_function


def _warn_dense_once(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in _DENSE_WARNED:
        _DENSE_WARNED.add(model_type)
        logger.warning("%s: a prefill whose attention mask adds a non-causal part (image tokens attending to each "
                       "other both ways, a prefix-LM's prefix) runs the exact dense attention over the PagedCache; "
                       "the paged attention does not express such a mask", model_type)


_DENSE_WARNED: set = set()  # the model types warned about once


def register_attention() -> None:
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, paged_mask)


def unregister_attention() -> None:
    AttentionInterface._global_mapping.pop(ATTENTION_NAME, None)
    AttentionMaskInterface._global_mapping.pop(ATTENTION_NAME, None)
