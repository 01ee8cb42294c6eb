"""CPU linears through oneDNN with the weight reordered once: bfloat16 (AMX or AVX512-BF16 where the CPU has them,
else a float32 copy) and float32.

Eager ``F.linear`` in bfloat16 already runs oneDNN, but reorders the weight into oneDNN's blocked layout at every
call: at the engine's token counts (a decode step is ``M`` = the running sequences) that reorder costs more than the
product (``benchmarks/gemm.py``). In float32 ``F.linear`` runs MKL's sgemm, which on an AVX2 AMD EPYC is 1.5-2.5x
slower than oneDNN's float32 product at decode sizes (SmolLM2's 576 x 49,152 head at 8 rows: 40 against 15 ms)
and level at prefill sizes; vLLM's CPU build runs oneDNN for both dtypes. ``pack_linears`` reorders each
``nn.Linear`` weight of a bfloat16 or float32 CPU model once (``torch.ops.mkldnn._reorder_linear_weight``) and
switches the module to ``PackedLinear``, whose forward is the custom op
``paged_hf::packed_linear(x [..., in], weight [out, in], bias?, key: 0-d int64) -> [..., out]`` over
``torch.ops.mkldnn._linear_pointwise``: opaque to dynamo, so the compiled forward and the eager one run the same
kernel.

- bfloat16 where oneDNN has bfloat16 dot products: the output usually equals ``F.linear``'s bit for bit; with two
  threads and 512 rows oneDNN splits the two layouts' work differently, and the AMX tile products below (64 rows or
  fewer) sum in another order, so a few outputs differ by one bfloat16 ulp (``benchmarks/gemm.py`` prints the
  difference).
- bfloat16 on a CPU without them (AVX2: oneDNN's and torch's bfloat16 products run 4-5x slower than float32 there):
  the weight is widened (oneDNN's copy is float32; the AVX2 panels below widen in registers), the input too, the
  product runs in float32 and is rounded to bfloat16 once, which is what a bfloat16 product with float32 sums does,
  in another summation order (``widens``).
- float32: oneDNN sums in another order than MKL: per output within ``2 K u sum|x w|`` of ``F.linear`` (tested); on
  SmolLM2 the logits move by up to 1.2e-4 at magnitude 35 (3.5e-6 relative, greedy argmax unchanged on 200 of 200
  positions), the size of the distance between the paged attention's and sdpa's sums (``README``). MKL's sgemm
  takes its fast code paths on Intel CPUs only: on an AMD EPYC (AVX2, and Zen 4 with AVX-512) oneDNN's float32
  product is 1.5-3x faster at decode sizes and SmolLM2's engine 1.34x faster end to end. On an Intel Xeon (AMX)
  MKL has a path of its own for 1-3 rows, where oneDNN runs 0.4-0.9x as fast, and oneDNN is 1.2-1.9x faster from
  4 to 64 rows (the fused q/k/v and gate/up products most), level at 256-512 (``benchmarks/gemm.py``,
  ``benchmarks/RESULTS.md``): there a product of fewer than ``MKL_ROWS`` rows stays ``F.linear`` (``dense_rows``),
  a single sequence's decoding included, unless told ``PAGED_HF_PACKED_LINEAR=all``.

A decode step's products are reads of their weights (tens of rows), which oneDNN's kernels stream at 14-17 GB/s on
a 2-core Xeon with AMX. There the C++ library keeps a second copy of each bfloat16 weight in AMX tile order
(``csrc/amx_linear.cpp``, made at the first such product) and multiplies products of at most 64 rows by tile
products over it, each thread streaming its share of the weight once (17-21 GB/s; SmolLM2's bfloat16 decode +17% end
to end): float32 sums of exact products, rounded to bfloat16 once, within the bound above of ``F.linear`` (oneDNN's
bits on most outputs, one bfloat16 ulp away on a few).

A library built for AVX2 without AVX-512 (an AMD EPYC Zen 3, an older Xeon) keeps its copy in 16-feature panels
instead of oneDNN's layout and multiplies it by its own AVX2 kernel (``csrc/avx2_linear.cpp``) at every row count:
oneDNN's inner product reaches 110-150 GFLOP/s of such a CPU's ~175 at 16-64 rows and streams a decode step's weights
well below the memory's speed; the panel product reaches 150-180 and streams at 34 GB/s (1.04-3x oneDNN's, SmolLM2's
shapes, ``benchmarks/gemm.py``). It sums each output in input order whatever the rows around it, so a row's bits do
not depend on its batch. A bfloat16 weight's panels stay bfloat16 and are widened in registers: the products of its
float32 copy, bit for bit, with half the bytes to read (a decode step's products 1.1-1.7x faster than over float32
panels).

bfloat16 engine logits are bounded, not exact (``test_cpu_bf16.py``). The packed copy is kept beside the model's
own weight (a stock model's parameters stay the user's: ``state_dict``, tied embeddings, ``.to()``): at most one
more copy of the linear weights, twice their size when widened into oneDNN's layout, and the AMX tile copy beside
it (SmolLM2-135M's bfloat16 engine, 256 MiB of linear weights, measured on AMX: 1,110 MiB of RSS unpacked, 1,360
with oneDNN's copies, 1,719 with the tile copies too; ``pack_linears`` leaves the tile copies out first when memory
is short). The op checks that the weight is still the one packed (same storage, same version counter, its dtype on
the CPU): a weight loaded or changed in place is packed again at its next call, any other dtype or device runs
``F.linear``: a packed copy is never stale.
"""

from __future__ import annotations

import functools
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


# float32 on an Intel CPU: products of fewer rows than this run MKL's sgemm (F.linear), which has a fast path for 1-3
# rows (oneDNN 0.4-0.9x there on SmolLM2's shapes) and falls behind oneDNN from 4 (oneDNN 1.2-1.9x at 4-64 rows).
MKL_ROWS = 4


class _Packed(NamedTuple):
    weight: torch.Tensor  # oneDNN's opaque layout
    data_ptr: int  # the dense weight it was made from, and that weight's version counter then
    version: int
    widen: bool  # a bfloat16 weight multiplied in float32 (this copy: float32)
    dense_below: int  # fewer rows than this: F.linear on the dense weight


_packs: dict[int, _Packed] = {}  # key -> the packed weight (dropped with its module)
_keys = itertools.count()


def _pack(weight: torch.Tensor, widen: bool, dense_below: int) -> _Packed:
    dense = weight.detach().float() if widen else weight.detach()
    packed = torch.ops.mkldnn._reorder_linear_weight(dense, PACK_BATCH_HINT)
    return _Packed(packed, weight.data_ptr(), weight._version, widen, dense_below)


def _packable(weight: torch.Tensor) -> bool:
    """A plain 2-d bfloat16 or float32 CPU tensor (a tensor subclass, e.g. a tensor-parallel DTensor shard, stays
    unpacked)."""
    return (weight.dtype in (torch.bfloat16, torch.float32) and weight.device.type == "cpu" and weight.dim() == 2
            and type(weight.detach()) is torch.Tensor)


def widens(dtype: torch.dtype) -> bool | None:
    """How a CPU linear of ``dtype`` is packed: False (multiplied in that dtype), True (a bfloat16 weight multiplied
    in float32, rounded to bfloat16 once: a CPU without bfloat16 dot products, where oneDNN's bfloat16 product is
    several times slower than its float32 one; oneDNN's copy is then float32, the AVX2 panels stay bfloat16 and
    widen in registers), None (not packed)."""
    if dtype == torch.bfloat16:  # the AVX2 panels multiply float32 rows even on a CPU with bfloat16 products
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported() or (
            cpu_ext.loaded() and torch.ops.paged_hf_cpu.linear_panels())
    return False if dtype == torch.float32 else None


@torch.library.custom_op("paged_hf::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight packed under ``key`` (packed again when ``weight`` changed)."""
    entry = _packs.get(int(key))
    if entry is None or x.dtype != weight.dtype or x.numel() < entry.dense_below * x.shape[-1]:
        return F.linear(x, weight, bias)
    if entry.data_ptr != weight.data_ptr() or entry.version != weight._version:  # the packed weight is not this one
        if not _packable(weight):  # moved to another dtype or device: the plain product
            return F.linear(x, weight, bias)
        entry = _packs[int(key)] = _pack(weight, bool(widens(weight.dtype)), entry.dense_below)
    rows = x.reshape(-1, x.shape[-1])
    if entry.widen:
        out = torch.ops.mkldnn._linear_pointwise(rows.float(), entry.weight, None if bias is None else bias.float(),
                                                 "none", [], "").to(x.dtype)
    else:
        out = torch.ops.mkldnn._linear_pointwise(rows, entry.weight, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


@packed_linear.register_fake
def _(x, weight, bias, key):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward is ``paged_hf_cpu::packed_linear`` (``_cpp``) or ``paged_hf::packed_linear``
    (made by ``pack_linears``, never directly)."""

    # 0-d int64, a non-persistent buffer (not in state_dict or parameters()): an int attribute would be a constant of
    # the compiled graph, and each new model's keys would compile it again. The buffer holds an nn.Parameter
    # (requires_grad False) because dynamo checks a parameter once by its dict's tag, where a plain tensor buffer
    # joins the guards checked at every forward (its metadata and no aliasing with every other such tensor): a
    # SmolLM2 engine's 211 keys cost 0.68 ms a decode step that way (_key_tensor).
    _pack_key: torch.Tensor
    _cpp: bool

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self._cpp:
            return torch.ops.paged_hf_cpu.packed_linear(input, self.weight, self.bias, self._pack_key)
        return packed_linear(input, self.weight, self.bias, self._pack_key)


def _key_tensor(key: int) -> torch.Tensor:
    """A pack key as ``PackedLinear._pack_key`` holds it: a 0-d int64 ``nn.Parameter`` that asks for no gradient."""
    return torch.nn.Parameter(torch.tensor(key, dtype=torch.int64), requires_grad=False)


class FusePackedLinears(CustomGraphPass):
    """Inductor's post-grad pass of the engine's compiled forward: the ``paged_hf_cpu::packed_linear`` calls on one
    input (a layer's q/k/v projections, its gate/up) become one ``packed_linear_group`` over their weights
    concatenated, and each former output a contiguous copy of a slice of it (inductor fuses the copy into the
    next kernel; a bare slice is strided, and inductor's re-propagation of the view after it guards on ``T == 1``,
    so the warm-up compiled a second graph), as vLLM's fused QKV and gate-up linears: at decode sizes
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
                    view = graph.call_function(torch.ops.aten.slice.Tensor, (fused, -1, start, start + width))
                    view.meta["val"] = fused.meta["val"][..., start : start + width]
                    part = graph.call_function(torch.ops.aten.clone.default, (view,),
                                               {"memory_format": torch.contiguous_format})
                    part.meta["val"] = view.meta["val"].clone(memory_format=torch.contiguous_format)
                    node.replace_all_uses_with(part)
                    start += width
            for node in nodes:
                graph.erase_node(node)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def enabled() -> bool:
    """``PAGED_HF_PACKED_LINEAR`` is not ``0``; ValueError for a value other than ``0``, ``1`` and ``all``."""
    return _setting() != "0"


def _setting() -> str:
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1", "all"):
        raise ValueError(f"{ENV} must be 0, 1 or all, got {value!r}")
    return value


def packs_dtype(dtype: torch.dtype) -> bool:
    """Whether ``pack_linears`` packs linears of ``dtype``: bfloat16 and float32 unless ``PAGED_HF_PACKED_LINEAR=0``."""
    return _setting() != "0" and widens(dtype) is not None


def dense_rows(dtype: torch.dtype) -> int:
    """How few rows a packed linear of ``dtype`` multiplies with ``F.linear`` instead: ``MKL_ROWS`` (products of 1-3
    rows) for float32 where MKL's sgemm is on its native CPU, unless ``PAGED_HF_PACKED_LINEAR=all``; else 0."""
    return MKL_ROWS if dtype == torch.float32 and _setting() == "1" and mkl_sgemm_is_native() else 0


@functools.cache
def mkl_sgemm_is_native() -> bool:
    """Whether this CPU is Intel's (``vendor_id`` of ``/proc/cpuinfo``), where MKL's sgemm, ``F.linear``'s float32
    product, takes its fast paths. True where the vendor cannot be read (not Linux): float32 products of a few rows
    stay MKL's there."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip() == "GenuineIntel"
    except OSError:
        pass
    return True


def pack_linears(model: torch.nn.Module, available_bytes: int | None = None) -> int:
    """Packs every bfloat16 or float32 CPU ``nn.Linear`` of ``model`` once (idempotent; ``widens`` says how): into
    oneDNN's layout, or the AVX2 panels where the C++ library is built for AVX2 without AVX-512;
    returns how many were packed now. Nothing where ``PAGED_HF_PACKED_LINEAR=0``, or where the packed copies would
    take more than half of ``available_bytes`` (the memory free now, as the caller measured it; None: no bound),
    which is logged; no AMX tile copies where only they would cross that line."""
    if not enabled():
        return 0
    linears = [m for m in model.modules()
               if type(m) is torch.nn.Linear and _packable(m.weight) and packs_dtype(m.weight.dtype)]
    cpp = bool(linears) and cpu_ext.loaded()
    panels = cpp and torch.ops.paged_hf_cpu.linear_panels()
    # widened into oneDNN's layout, a bfloat16 weight's copy is float32; the AVX2 panels keep bfloat16
    needed = sum(m.weight.numel() * (4 if widens(m.weight.dtype) and not panels else m.weight.element_size())
                 for m in linears)
    tile_bytes = sum(m.weight.numel() * 2 for m in linears if m.weight.dtype == torch.bfloat16) \
        if cpp and torch.ops.paged_hf_cpu.linear_tile_copies() else 0  # the AMX tile copies of bfloat16 weights
    dtypes = "/".join(sorted({str(m.weight.dtype).removeprefix("torch.") for m in linears}))
    # the copies must not crowd out the KV pool the engine sizes next: the tile copies are left out first
    tiles = tile_bytes > 0 and (available_bytes is None or needed + tile_bytes <= available_bytes // 2)
    if tile_bytes and not tiles:
        logger.info("no AMX tile copies of %d bfloat16 linear weights (%.0f MiB): with them the packed copies would "
                    "take over half the available memory (%.0f MiB); decode-sized products run oneDNN's",
                    len(linears), tile_bytes / 2**20, available_bytes / 2**20)
    needed += tile_bytes if tiles else 0
    if linears and available_bytes is not None and needed > available_bytes // 2:
        logger.warning("not packing %d %s linear weights: their copy (%.0f MiB) is over half the "
                       "available memory (%.0f MiB); they run through F.linear", len(linears), dtypes,
                       needed / 2**20, available_bytes / 2**20)
        return 0
    for module in linears:
        key, widen, dense = next(_keys), bool(widens(module.weight.dtype)), dense_rows(module.weight.dtype)
        if cpp:
            torch.ops.paged_hf_cpu.pack_linear(module.weight.detach(), key, PACK_BATCH_HINT, widen, dense, tiles)
            weakref.finalize(module, torch.ops.paged_hf_cpu.unpack_linear, key)
        else:
            _packs[key] = _pack(module.weight, widen, dense)
            weakref.finalize(module, _packs.pop, key, None)
        module.register_buffer("_pack_key", _key_tensor(key), persistent=False)
        module._cpp = cpp
        module.__class__ = PackedLinear
    if linears:
        how = "once"
        if any(widens(m.weight.dtype) for m in linears):
            how = ("widened to float32 in the product (the AVX2 panels multiply float32)" if panels
                   else "as float32 copies: this CPU has no bfloat16 dot products")
        if any(dense_rows(m.weight.dtype) for m in linears):
            how += f" (float32 products of fewer than {MKL_ROWS} rows stay MKL's)"
        layout = "AVX2 panels" if panels else "oneDNN"
        logger.info("packed %d %s linear weights for %s %s (at most %.0f MiB more; %s=0 turns it off)",
                    len(linears), dtypes, layout, how, needed / 2**20, ENV)
    return len(linears)
