"""bfloat16 linears on a CPU through oneDNN with the weight reordered once (AMX where the CPU has it).

Eager ``F.linear`` in bfloat16 already runs oneDNN, but reorders the weight into oneDNN's blocked layout at every
call: at the engine's token counts (a decode step is ``M`` = the running sequences) that reorder costs more than the
product (``benchmarks/gemm.py``). ``pack_linears`` reorders each ``nn.Linear`` weight of a bfloat16 CPU model once
(``torch.ops.mkldnn._reorder_linear_weight``) and switches the module to ``PackedLinear``, whose forward is the custom
op ``paged_hf::packed_linear(x [..., in], weight [out, in], bias?, key: int) -> [..., out]`` over
``torch.ops.mkldnn._linear_pointwise``: opaque to dynamo, so the compiled forward and the eager one run the same
kernel. The output equals ``F.linear``'s bit for bit at one thread (tested) and at the decode sizes; with two
threads and 512 rows oneDNN splits the two layouts' work differently and a few outputs differ by one bfloat16 ulp
(``benchmarks/gemm.py`` prints the difference): bfloat16 engine logits are bounded, not exact (``test_cpu_bf16.py``).

The packed copy is kept beside the model's own weight (a stock model's parameters stay the user's: ``state_dict``,
tied embeddings, ``.to()``): at most one more copy of the linear weights (SmolLM2-135M, measured: +82 MiB of RSS
for 256 MiB of linear weights; where oneDNN's layout is the plain one the copy is not made). The op checks that the weight is still
the one packed (same storage, same version counter, bfloat16 on the CPU): a weight loaded or changed in place is
packed again at its next call, any other dtype or device runs ``F.linear``: a packed copy is never stale.
Off with ``PAGED_HF_PACKED_LINEAR=0``. float32 stays on MKL's sgemm (oneDNN's float32 rounds differently).
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .kernels import cpu_ext

logger = logging.getLogger("paged_hf")

ENV = "PAGED_HF_PACKED_LINEAR"
# oneDNN picks its blocked layout for a batch size: the engine's decode steps run tens of tokens.
PACK_BATCH_HINT = 32


class _Packed(NamedTuple):
    weight: torch.Tensor  # oneDNN's opaque layout
    data_ptr: int  # the dense weight it was made from, and that weight's version counter then
    version: int


_packs: dict[int, _Packed] = {}  # key -> the packed weight (dropped with its module)
_keys = itertools.count()


def _pack(weight: torch.Tensor) -> _Packed:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
    return _Packed(packed, weight.data_ptr(), weight._version)


def _packable(weight: torch.Tensor) -> bool:
    """A plain 2-d bfloat16 CPU tensor (a tensor subclass, e.g. a tensor-parallel DTensor shard, stays unpacked)."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and type(weight.detach()) is torch.Tensor)


@torch.library.custom_op("paged_hf::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight packed under ``key`` (packed again when ``weight`` changed)."""
    entry = _packs.get(key)
    if entry is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    if entry.data_ptr != weight.data_ptr() or entry.version != weight._version:  # the packed weight is not this one
        if not _packable(weight):  # moved to another dtype or device: the plain product
            return F.linear(x, weight, bias)
        entry = _packs[key] = _pack(weight)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), entry.weight, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


@packed_linear.register_fake
def _(x, weight, bias, key):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward is ``paged_hf_cpu::packed_linear`` (``_cpp``) or ``paged_hf::packed_linear``
    (made by ``pack_linears``, never directly)."""

    _pack_key: int
    _cpp: bool

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self._cpp:
            return torch.ops.paged_hf_cpu.packed_linear(input, self.weight, self.bias, self._pack_key)
        return packed_linear(input, self.weight, self.bias, self._pack_key)


class FusePackedLinears(CustomGraphPass):
    """Inductor's post-grad pass of the engine's compiled forward: the ``paged_hf_cpu::packed_linear`` calls on one
    input (a layer's q/k/v projections, its gate/up) become one ``packed_linear_group`` over their weights
    concatenated, and each former output a slice of it, as vLLM's fused QKV and gate-up linears: at decode sizes
    one product of the summed width costs about what its largest part did (SmolLM2, 32 rows: q/k/v 80 -> 40 us,
    gate/up 121 -> 96 us). Members must agree on having a bias. A graph without packed linears is left as it is."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        if not cpu_ext.loaded():
            return
        single, group = torch.ops.paged_hf_cpu.packed_linear.default, torch.ops.paged_hf_cpu.packed_linear_group.default
        by_input: dict = {}
        for node in graph.nodes:
            if node.op == "call_function" and node.target is single and not node.kwargs:
                by_input.setdefault(node.args[0], []).append(node)
        for x, nodes in by_input.items():
            if len(nodes) < 2 or len({node.args[2] is None for node in nodes}) > 1:
                continue
            first = nodes[0]
            with graph.inserting_before(first):
                fused = graph.call_function(group, (x, [n.args[1] for n in nodes], [n.args[2] for n in nodes],
                                                    [n.args[3] for n in nodes]))
                fused.meta["val"] = torch.cat([n.meta["val"] for n in nodes], dim=-1)
                start = 0
                for node in nodes:
                    width = node.meta["val"].shape[-1]
                    part = graph.call_function(torch.ops.aten.slice.Tensor, (fused, -1, start, start + width))
                    part.meta["val"] = fused.meta["val"][..., start : start + width]
                    node.replace_all_uses_with(part)
                    start += width
            for node in nodes:
                graph.erase_node(node)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def enabled() -> bool:
    """``PAGED_HF_PACKED_LINEAR`` is unset or ``1`` (``0`` turns packing off); ValueError for another value."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def pack_linears(model: torch.nn.Module, available_bytes: int | None = None) -> int:
    """Packs every bfloat16 CPU ``nn.Linear`` of ``model`` (idempotent) where oneDNN runs bfloat16; returns how many
    were packed now. Nothing where ``PAGED_HF_PACKED_LINEAR=0``, the model is not bfloat16 or not on a CPU, or the
    packed copy would take more than half of ``available_bytes`` (the memory free now, as the caller measured it;
    None: no bound), which is logged."""
    if not enabled() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return 0
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and _packable(m.weight)]
    needed = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    # the copy must not crowd out the KV pool the engine sizes next
    if linears and available_bytes is not None and needed > available_bytes // 2:
        logger.warning("not packing %d bfloat16 linear weights for oneDNN: their copy (%.0f MiB) is over half the "
                       "available memory (%.0f MiB); they run through F.linear", len(linears), needed / 2**20,
                       available_bytes / 2**20)
        return 0
    cpp = bool(linears) and cpu_ext.loaded()
    for module in linears:
        key = next(_keys)
        if cpp:
            torch.ops.paged_hf_cpu.pack_linear(module.weight.detach(), key, PACK_BATCH_HINT)
            weakref.finalize(module, torch.ops.paged_hf_cpu.unpack_linear, key)
        else:
            _packs[key] = _pack(module.weight)
            weakref.finalize(module, _packs.pop, key, None)
        module._pack_key, module._cpp = key, cpp
        module.__class__ = PackedLinear
    if linears:
        logger.info("packed %d bfloat16 linear weights for oneDNN once (at most %.0f MiB more; %s=0 turns it off)",
                    len(linears), needed / 2**20, ENV)
    return len(linears)
