"""The KV store and the paged attention as ``torch.library`` custom ops, for the engine's compiled forward.

``torch.compile`` traces the stock model into one graph; these two ops are where it stops tracing (as vLLM keeps
its attention out of the graph). Their arguments are tensors and simple scalars, so dynamo neither guards on a
step's Python values nor specializes on them:

``paged_hf::store_kv(key [n, kv_heads, head_dim], value, slots [n], tail_slots?, fill_blocks?, fill_rows?,
fill_first?, fill_tail?, layer: int) -> (fresh_key, fresh_value)``
    writes one layer's new K/V into its pools (``KVStorage.write``; the five optional tensors are a tail format's
    ``StorePlan``). Returns the forward's ``FreshKV`` for a tail format, else two empty ``[0, kv_heads, head_dim]``
    tensors: either way the attention takes them as inputs, so the graph orders the store before the attention.

``paged_hf::paged_attention(query [n, heads, head_dim], fresh_key, fresh_value, block_tables [S, W], seq_lens [S],
query_start_loc [S + 1], num_decodes [1] (CPU), tail_rows?, <the StorePlan's five>?, sinks?, layer: int,
scale: float, window: int?, softcap: float?) -> out [n, heads, head_dim]``
    the decode and prefill kernels of ``attention.attend_packed`` (the eager path's own function), then, for a tail
    format, the tail writes (after the reads, as eager; none without the plan: a later layer reads the same pools). ``num_decodes`` is a CPU tensor read by the real
    implementation: it changes every step, so it must not be a graph constant.

For unquantized CPU pools in float32 or bfloat16 the graph calls ``paged_hf_cpu::store`` / ``paged_hf_cpu::attend``
instead (``kernels/csrc/paged_step.cpp``: the same store and kernels in C++, sliding windows and softcaps included,
without a Python call per layer); ``bind`` hands them the pools too. Quantized and tail formats keep the ops above.

The pools are the ops' state, not graph values: ``layer`` is the layer index, and the ``KVStorage`` is the one
``bind`` set for the forward running (as vLLM's layer names and forward context), so a pool that grows never changes
the graph, the same graph serves a warm-up's scratch pools and the engine's, and functionalization never copies a
pool. Nothing in the graph reads the pools but these ops, and each depends on the one before it through its
inputs (a layer's attention takes its store's outputs; the next layer's K/V come from that attention), so declaring
no mutation cannot reorder a read before its write, and no op is dead code.
"""

from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import torch

from .kernels import cpu_ext
from .kernels.fill_blocks import StorePlan
from .storage import FreshKV, KVStorage

_bound = threading.local()  # .pools: the BoundPools of the forward running on this thread


class BoundPools(NamedTuple):
    """What ``bind`` installs (``pools`` builds it): ``storages`` ``{layer index: KVStorage}``, and the key and value
    pools of the layers ``paged_hf_cpu`` serves, indexed by layer (empty tensors between them; empty lists: none)."""

    storages: dict
    native_keys: list
    native_values: list


_NO_POOLS = BoundPools({}, [], [])


def pools(storages: dict) -> BoundPools:
    """The ``BoundPools`` of ``storages``: a caller whose pools stay the same keeps it, so a forward's ``bind`` makes
    no pass over the layers (two passes and four lists a step, 0.02 ms on 30 layers)."""
    layers = [layer for layer, storage in storages.items() if _native(storage)]
    if not layers or not cpu_ext.loaded():
        return BoundPools(storages, [], [])
    empty = torch.empty(0)
    keys, values = [empty] * (max(layers) + 1), [empty] * (max(layers) + 1)
    for layer in layers:
        keys[layer], values[layer] = storages[layer].key_cache, storages[layer].value_cache
    return BoundPools(storages, keys, values)


@contextlib.contextmanager
def bind(bound: BoundPools):
    """Runs the block inside it with ``bound``'s storages as the ops' pools: the runner binds its own around each
    forward (and a warm-up its scratch pools), so one compiled graph serves every pool of the same model, whatever its
    size, and a pool that grows changes nothing in the graph."""
    previous = getattr(_bound, "pools", None)
    _bound.pools = bound
    native = _bind_native(bound)
    try:
        yield
    finally:
        _bound.pools = previous
        if native:
            _bind_native(previous or _NO_POOLS)


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what paged_hf_cpu's store and attention take


def _native(storage) -> bool:
    """Whether ``paged_hf_cpu``'s store and attention (``csrc/paged_step.cpp``) serve this layer's storage: unquantized
    CPU pools ("auto": no rotation, no tail) in float32 or bfloat16 (the C++ library built: the caller asks): what
    ``store_layer`` decided when dynamo traced, from ``EngineCache.native_ops`` and the states' dtype and device (for
    "auto" pools the compute dtype is the pools'). A layer the graph stores natively but that is not bound here fails
    its step with "no pools bound", never silently. Reads the tensor's own flags: ``storage.device`` makes a
    ``torch.device`` each time."""
    if type(storage) is not KVStorage:
        return False
    key = storage.key_cache
    return key.is_cpu and key.dtype in _NATIVE_DTYPES


def _bind_native(bound: BoundPools) -> bool:
    """Binds ``bound``'s C++-served pools for ``paged_hf_cpu`` (none: unbinds those bound); returns whether it called
    the library."""
    if not bound.native_keys and not getattr(_bound, "native", False):
        return False
    torch.ops.paged_hf_cpu.bind_pools(bound.native_keys, bound.native_values)
    _bound.native = bool(bound.native_keys)
    return True


def _storage(layer: int):
    bound = getattr(_bound, "pools", None)
    storages = None if bound is None else bound.storages
    if storages is None or layer not in storages:
        raise RuntimeError(f"paged_hf ops: no KV storage bound for layer {layer} (run the forward inside ops.bind)")
    return storages[layer]


def _plan(tail_slots, fill_blocks, fill_rows, fill_first, fill_tail) -> StorePlan | None:
    return None if tail_slots is None else StorePlan(tail_slots, fill_blocks, fill_rows, fill_first, fill_tail)


def _unaliased(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``out`` contiguous and not an input's storage: a custom op may not return its input (``FreshKV`` is the input
    itself when no rotation or cast applies), and the ops' outputs are contiguous as their fakes say. An input may
    be a strided view (a query made by ``cat``, Phi's partial rotary, is head-major once packed), and an output that
    kept its strides would be read by the compiled graph in the fake's layout: wrong values, no error."""
    if any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in inputs):
        return out.clone(memory_format=torch.contiguous_format)
    return out.contiguous()


@torch.library.custom_op("paged_hf::store_kv", mutates_args=())
def store_kv(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, tail_slots: torch.Tensor | None,
             fill_blocks: torch.Tensor | None, fill_rows: torch.Tensor | None, fill_first: torch.Tensor | None,
             fill_tail: torch.Tensor | None, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    kv = _storage(layer)
    fresh = kv.write(slots, key, value, _plan(tail_slots, fill_blocks, fill_rows, fill_first, fill_tail))
    if fresh is None:
        return key.new_empty((0, *key.shape[1:])), value.new_empty((0, *value.shape[1:]))
    return _unaliased(fresh.key, key, value), _unaliased(fresh.value, key, value)


@store_kv.register_fake
def _store_kv_fake(key, value, slots, tail_slots, fill_blocks, fill_rows, fill_first, fill_tail, layer):
    kv = _storage(layer)
    if not kv.has_tail:
        return key.new_empty((0, *key.shape[1:])), value.new_empty((0, *value.shape[1:]))
    return key.new_empty(key.shape, dtype=kv.key_tail.dtype), value.new_empty(value.shape, dtype=kv.value_tail.dtype)


@torch.library.custom_op("paged_hf::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, fresh_key: torch.Tensor, fresh_value: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    num_decodes: torch.Tensor, tail_rows: torch.Tensor | None, tail_slots: torch.Tensor | None,
                    fill_blocks: torch.Tensor | None, fill_rows: torch.Tensor | None,
                    fill_first: torch.Tensor | None, fill_tail: torch.Tensor | None, sinks: torch.Tensor | None,
                    layer: int, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    from .attention import attend_packed  # noqa: PLC0415 - attention imports this module

    kv = _storage(layer)
    fresh = FreshKV(fresh_key, fresh_value) if kv.has_tail else None
    d = int(num_decodes[0])
    out = attend_packed(query, kv, block_tables, seq_lens, query_start_loc, d, query_start_loc[d:] - d,
                        tail_rows if kv.has_tail else None, fresh, window, scale, softcap, sinks)
    if fresh is not None and tail_slots is not None:  # the tail rows were read as they were before this forward
        kv.write_tails(fresh, _plan(tail_slots, fill_blocks, fill_rows, fill_first, fill_tail))
    return _unaliased(out, query)


@paged_attention.register_fake
def _paged_attention_fake(query, *args, **kwargs):
    return query.new_empty(query.shape)  # contiguous, whatever the query's strides (``_unaliased``)


@torch.library.custom_op("paged_hf::latent_attention", mutates_args=())
def latent_attention(query: torch.Tensor, up: torch.Tensor, fresh_key: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_decodes: torch.Tensor, layer: int,
                     scale: float, rope: int) -> torch.Tensor:
    from . import latent_attention as latent  # noqa: PLC0415 - latent_attention imports packed_linear, ops' peer
    from .attention import attend_packed  # noqa: PLC0415 - attention imports this module

    out = latent.attend_packed(query, up, _storage(layer), block_tables, seq_lens, query_start_loc,
                               int(num_decodes[0]), scale, rope, attend_packed)
    return _unaliased(out, query)


@latent_attention.register_fake
def _latent_attention_fake(query, up, fresh_key, block_tables, seq_lens, query_start_loc, num_decodes, layer, scale,
                           rope):
    return query.new_empty((query.shape[0], query.shape[1], up.shape[1] - (query.shape[2] - rope)))


class OpStep(NamedTuple):
    """What a layer's cache update hands the ``"paged"`` attention in the compiled forward (``METADATA_KEY``):
    the step's tensors and the layer's index; no per-step Python value."""

    fresh_key: torch.Tensor
    fresh_value: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_decodes: torch.Tensor  # [1] int64, on the CPU
    tail_rows: torch.Tensor | None
    plan: tuple  # the StorePlan's five tensors, or five Nones
    layer: int
    window: int | None
    stored: tuple[int, int, int]  # the stored K/V's kv_heads, key head_dim, value head_dim (``LayerStep.stored``)
    native: bool = False  # stored by paged_hf_cpu::store (fresh_key, fresh_value: its empty output)
    latent: int | None = None  # a multi-head latent attention layer's latent size (``LayerStep.latent``)

    def without_tail_writes(self) -> "OpStep":
        """As ``LayerStep.without_tail_writes``: the attention op writes no tail (it gets no plan)."""
        return self._replace(plan=_NO_PLAN)


_NO_PLAN = (None,) * 5


def _packed(states: torch.Tensor) -> torch.Tensor:
    """``[1, heads, n, head_dim]`` -> ``[n, heads, head_dim]``, as ``AttentionMetadata.select_new_tokens``."""
    return states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])


def store_layer(metadata, group, layer: int, key_states: torch.Tensor, value_states: torch.Tensor,
                num_decodes: torch.Tensor, native: bool = False) -> OpStep:
    """One layer's store through ``store_kv`` (``key_states``: ``[1, kv_heads, n, head_dim]``, the engine's one
    row) and the ``OpStep`` its attention reads. ``native``: the format is "auto" and ``paged_hf_cpu`` is built
    (``EngineCache.native_ops``): a CPU float32 or bfloat16 layer then stores through ``paged_hf_cpu::store``.
    Decided from the cache's flag and the states' dtype and device alone: the pools are never touched while
    dynamo traces (their sizes would become guards)."""
    plan = _NO_PLAN if group.store_plan is None else (
        group.store_plan.tail_slots, group.store_plan.fill_blocks, group.store_plan.fill_rows,
        group.store_plan.fill_first, group.store_plan.fill_tail)
    key, value = _packed(key_states), _packed(value_states)
    shapes = (key.shape[1], key.shape[2], value.shape[2])
    if native and group.store_plan is None and key.device.type == "cpu" and key.dtype in _NATIVE_DTYPES:
        stored = torch.ops.paged_hf_cpu.store(key, value, group.slot_mapping, layer)
        return OpStep(stored, stored, group.block_tables, metadata.seq_lens, metadata.query_start_loc, num_decodes,
                      metadata.tail_rows, plan, layer, group.window, shapes, native=True)
    fresh_key, fresh_value = torch.ops.paged_hf.store_kv(key, value, group.slot_mapping, *plan, layer)
    return OpStep(fresh_key, fresh_value, group.block_tables, metadata.seq_lens, metadata.query_start_loc,
                  num_decodes, metadata.tail_rows, plan, layer, group.window, shapes)


def attend_latent(step: OpStep, query: torch.Tensor, up: torch.Tensor, scale: float, rope: int) -> torch.Tensor:
    """A multi-head latent attention layer's attention through ``latent_attention``: ``query`` ``[1, heads, n, nope +
    rope]``, ``up`` the layer's ``kv_b_proj`` weight ``[heads, nope + v, latent]`` -> ``[1, n, heads, v]``. Its
    input ``fresh_key`` orders it after the layer's store."""
    packed = torch.ops.paged_hf.latent_attention(_packed(query), up, step.fresh_key, step.block_tables, step.seq_lens,
                                                 step.query_start_loc, step.num_decodes, step.layer, scale, rope)
    return packed.unsqueeze(0)


def attend(step: OpStep, query: torch.Tensor, scale: float, softcap: float | None,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """The layer's attention through ``paged_attention``: ``query`` ``[1, heads, n, head_dim]`` -> ``[1, n, heads,
    head_dim]``."""
    if step.native:  # paged_hf_cpu's decode and prefill kernels
        packed = torch.ops.paged_hf_cpu.attend(_packed(query), step.fresh_key, step.block_tables, step.seq_lens,
                                               step.query_start_loc, step.num_decodes, step.layer, scale, sinks,
                                               step.window or 0, softcap or 0.0)
        return packed.unsqueeze(0)
    packed = torch.ops.paged_hf.paged_attention(
        _packed(query), step.fresh_key, step.fresh_value, step.block_tables, step.seq_lens,
        step.query_start_loc, step.num_decodes, step.tail_rows, *step.plan, sinks, step.layer, scale,
        step.window, softcap)
    return packed.unsqueeze(0)
