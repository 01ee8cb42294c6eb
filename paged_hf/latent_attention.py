"""Multi-head latent attention (DeepSeek V2/V3, MiniCPM3, Kimi Linear, ...) over the paged latent rows.

Such a layer caches one row a token, ``c | k_rot``: the compressed latent ``c`` (``kv_lora_rank`` wide) and the
rotary key ``k_rot`` shared by every head (``PagedLayer.latent_dim``). The model then expands them into heads with
its ``kv_b_proj`` (weight ``W = [W_uk; W_uv]`` per head: ``k_h = [W_uk,h c | k_rot]``, ``v_h = W_uv,h c``) and
hands the attention those. Reading the blocks, the paged attention never expands them: it folds ``W_uk`` into the
query and ``W_uv`` into the output (vLLM's and DeepSeek's "absorbed" MLA),

    q_h . k_h = (W_uk,h^T q_nope,h) . c + q_rot,h . k_rot      sum_j p_j v_h,j = W_uv,h (sum_j p_j c_j)

so every head attends over the one latent head with the unchanged kernels: the query ``[W_uk^T q_nope | q_rot]``
against the rows as keys, and the same rows as values, whose first ``kv_lora_rank`` output columns are
``sum_j p_j c_j``. The scale and softmax are the model's; only the order of the float operations differs.

That costs ``2 (kv_lora_rank + rope)`` products per query, key and head (1,152 for DeepSeek) where the expanded
heads cost ``nope + rope + v`` (320): right for a decode, which reads each row once for all its heads, and for
short chunks, but a long prompt chunk attends faster over its context expanded into heads once (``expands``: a
chunk of more than ~160 tokens at DeepSeek's sizes), as vLLM's MLA prefill does. ``attend_packed`` splits a
forward's sequences that way: decodes and short chunks over the rows, long chunks through ``sdpa`` over their
context's rows expanded with the same ``kv_b_proj`` weight, as the model itself would attend.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from .metadata import AttentionBypassed
from .packed_linear import PackedLinear

# the projections whose ``weight`` is the product they compute (``PackedLinear``: a reordered copy of that weight)
_PLAIN_LINEARS = (torch.nn.Linear, PackedLinear)

_checked: weakref.WeakSet = weakref.WeakSet()  # attention modules whose expansion was checked once (eager)


def up_projection(module: torch.nn.Module, heads: int, latent_dim: int) -> torch.Tensor:
    """The module's ``kv_b_proj`` weight as ``[heads, nope + v, latent_dim]`` (a view: never stale).
    ``AttentionBypassed`` when it is not a plain bias-free ``nn.Linear`` of that shape (a quantized projection
    would need its own dequantization here; ``PackedLinear``, the engine's reordered copy, multiplies by it)."""
    proj = getattr(module, "kv_b_proj", None)
    weight = getattr(proj, "weight", None)
    if hasattr(weight, "to_local"):  # tensor parallelism: this rank's heads (``kv_b_proj`` is split by columns)
        weight = weight.to_local()
    if (type(proj) not in _PLAIN_LINEARS
            or proj.bias is not None or weight.shape[1] != latent_dim or weight.shape[0] % heads):
        raise AttentionBypassed(
            f"{type(module).__name__} caches a multi-head latent (kv_lora_rank={latent_dim}) but its up-projection "
            f"kv_b_proj is {type(proj).__name__}, not a bias-free nn.Linear of {latent_dim} inputs over its "
            f"{heads} heads: the paged attention folds that weight into its query and output, so it cannot "
            f"attend for this model. PagedEngine cannot serve it; generate runs it on the PagedCache with a dense "
            f"attention (attn_implementation='sdpa' or 'eager')")
    return weight.view(heads, weight.shape[0] // heads, latent_dim)


def check_expansion(module, key: torch.Tensor, value: torch.Tensor, step, up: torch.Tensor) -> None:
    """``AttentionBypassed`` unless the K/V ``[B, heads, q, nope + rope]`` / ``[B, heads, q, v]`` handed to the
    attention are the expansion the fold assumes of what the cache update stored (``step.key``: the latent,
    ``step.value``: the rotary key): ``k_h = [W_uk,h c | k_rot]``, ``v_h = W_uv,h c`` with ``up``'s head sizes.
    The shapes every time; the values once per module, in an eager step, within the rounding of the dtype (a
    model that scales, reorders or offsets them after expanding is off by far more)."""
    latent, rope = step.stored[1], step.stored[2]
    nope = key.shape[-1] - rope
    if nope <= 0 or up.shape[1] != nope + value.shape[-1] or up.shape[0] != key.shape[1]:
        raise AttentionBypassed(
            f"{type(module).__name__} hands its attention keys of {key.shape[-1]} dims and values of "
            f"{value.shape[-1]} over {key.shape[1]} heads, which its kv_b_proj ({tuple(up.shape)} per head) and its "
            f"cached rotary key ({rope} dims) do not make: the paged attention cannot fold its latent attention")
    if module in _checked or not isinstance(step.key, torch.Tensor) or torch.compiler.is_compiling():
        return
    with torch.no_grad():
        up_t = up.transpose(1, 2).float()  # [heads, latent, nope + v]
        expanded = torch.matmul(step.key.float(), up_t)  # [B, heads, q, nope + v]
        want_key = torch.cat((expanded[..., :nope], step.value.float().expand(-1, up.shape[0], -1, -1)), dim=-1)
        tolerance = 1e-4 if key.dtype == torch.float32 else 3e-2
        for got, want in ((key, want_key), (value, expanded[..., nope:])):
            if got.shape != want.shape or not torch.allclose(got.float(), want, rtol=tolerance,
                                                             atol=tolerance * (1 + want.abs().max().item())):
                raise AttentionBypassed(
                    f"{type(module).__name__} caches a multi-head latent (kv_lora_rank={latent}) but hands its "
                    f"attention K/V other than its expand_kv of the stored latent with kv_b_proj ([W_uk c | k_rot] "
                    f"and W_uv c): the paged attention, which folds that expansion into its query and output, "
                    f"cannot follow. PagedEngine cannot serve it; generate runs it on the PagedCache with a dense "
                    f"attention (attn_implementation='sdpa' or 'eager')")
    _checked.add(module)


def absorb_query(query: torch.Tensor, up: torch.Tensor, rope: int) -> torch.Tensor:
    """``[B, heads, q, nope + rope]`` -> ``[B, heads, q, latent + rope]``: each head's ``W_uk^T q_nope`` beside its
    ``q_rot``, the query of one latent head."""
    nope = query.shape[-1] - rope
    q_nope, q_rot = query.split([nope, rope], dim=-1)
    return torch.cat((torch.matmul(q_nope, up[:, :nope]), q_rot), dim=-1)


def expand_output(out: torch.Tensor, up: torch.Tensor, latent_dim: int, nope: int) -> torch.Tensor:
    """The attention's ``[B, q, heads, latent + rope]`` (the rows weighted) -> ``[B, q, heads, v]``: each head's
    ``W_uv`` applied to the latent part."""
    weighted = out[..., :latent_dim].transpose(1, 2)  # [B, heads, q, latent]
    return torch.matmul(weighted, up[:, nope:].transpose(1, 2)).transpose(1, 2)


def expands(num_new: int, num_context: int, latent_dim: int, rope: int, nope: int, value_dim: int) -> bool:
    """Whether a chunk of ``num_new`` query tokens over ``num_context`` tokens (its own included) attends with
    fewer products over its context expanded into heads (each row once: ``latent_dim (nope + v)`` a head, then
    ``nope + rope + v`` a query and key) than over the latent rows (``2 (latent_dim + rope)`` a query and key)."""
    expanded = num_context * latent_dim * (nope + value_dim) + num_new * num_context * (nope + rope + value_dim)
    return expanded < 2 * num_new * num_context * (latent_dim + rope)


def attend_packed(query: torch.Tensor, up: torch.Tensor, storage, tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, num_decodes: int, scale: float, rope: int,
                  attend_rows) -> torch.Tensor:
    """The latent attention of a forward's packed new tokens ``[n, heads, nope + rope]`` over their sequences'
    rows: ``[n, heads, v]``. The decodes and the chunks ``expands`` leaves to the rows attend over them with the
    folded query, through ``attend_rows`` (``attention.attend_packed``); each other chunk attends through ``sdpa``
    over its context's rows (read as stored, dequantized) expanded with ``up`` ``[heads, nope + v, latent]``."""
    latent_dim, nope = up.shape[2], query.shape[-1] - rope
    value_dim = up.shape[1] - nope
    num_seqs = seq_lens.shape[0]
    expanded = []
    if num_decodes < num_seqs:  # a decode-only step reads nothing to the host (a CUDA graph captures it)
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()  # a sync on CUDA, none on the CPU
        expanded = [i for i in range(num_decodes, num_seqs)
                    if expands(starts[i + 1] - starts[i], lens[i], latent_dim, rope, nope, value_dim)]
    if not expanded:
        return _attend_folded(query, up, rope, storage, tables, seq_lens, query_start_loc, num_decodes, scale,
                              attend_rows)
    out = query.new_empty((query.shape[0], query.shape[1], value_dim))
    folded = [i for i in range(num_seqs) if i not in expanded]
    if folded:  # their tokens packed again, decodes first as they were
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in folded]).to(query.device)
        seqs = torch.tensor(folded, device=query.device)
        counts = torch.tensor([starts[i + 1] - starts[i] for i in folded], device=query.device)
        out.index_copy_(0, rows, _attend_folded(
            query.index_select(0, rows), up, rope, storage, tables.index_select(0, seqs),
            seq_lens.index_select(0, seqs), torch.cat([counts.new_zeros(1), counts.cumsum(0)]), num_decodes, scale,
            attend_rows))
    for i in expanded:
        out[starts[i]:starts[i + 1]] = _attend_expanded(query[starts[i]:starts[i + 1]], up, storage, tables[i], lens[i],
                                                       scale, latent_dim, nope)
    return out


def _attend_folded(query: torch.Tensor, up: torch.Tensor, rope: int, storage, tables: torch.Tensor,
                   seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_decodes: int, scale: float,
                   attend_rows) -> torch.Tensor:
    """Packed queries ``[m, heads, nope + rope]`` of these sequences (decodes first) over their rows, the
    up-projection folded in: ``[m, heads, v]``."""
    folded = absorb_query(query.unsqueeze(0).transpose(1, 2), up, rope).transpose(1, 2)[0]
    out = attend_rows(folded, storage, tables, seq_lens, query_start_loc, num_decodes,
                      query_start_loc[num_decodes:] - query_start_loc[num_decodes], None, None, None, scale, None,
                      None)
    return expand_output(out.unsqueeze(0), up, up.shape[2], query.shape[-1] - rope)[0].to(query.dtype)


def _attend_expanded(query: torch.Tensor, up: torch.Tensor, storage, table: torch.Tensor, length: int, scale: float,
                     latent_dim: int, nope: int) -> torch.Tensor:
    """One chunk's queries ``[t, heads, nope + rope]`` (the last ``t`` of its ``length`` tokens) over its context
    expanded into heads: ``[t, heads, v]``."""
    positions = torch.arange(length, device=query.device)
    slots = table.long().index_select(0, positions // storage.block_size) * storage.block_size \
        + positions % storage.block_size
    rows = storage.read_slots(slots)[0][:, 0].to(query.dtype)  # [length, latent + rope]
    heads = up.shape[0]
    expanded = torch.matmul(rows[:, :latent_dim], up.transpose(1, 2))  # [heads, length, nope + v]
    key = torch.cat((expanded[..., :nope], rows[:, latent_dim:].expand(heads, -1, -1)), dim=-1)
    num_new = query.shape[0]
    mask = None if num_new == length else \
        positions[None, :] <= (positions[length - num_new:])[:, None]  # [t, length]: each query up to itself
    out = F.scaled_dot_product_attention(query.transpose(0, 1), key, expanded[..., nope:], attn_mask=mask,
                                         is_causal=mask is None, scale=scale)
    return out.transpose(0, 1)
