"""The decompositions the engine's compiled forward uses in place of inductor's own, for the engine's graphs only
(passed to ``compile_fx``; other ``torch.compile`` calls in the process keep inductor's table).

``gelu(x, approximate="tanh")`` (Gemma 1-3, GPT-2's family through ``GELUTanh``): inductor decomposes it as
``0.5 x (1 + tanh(u))``, ``u = sqrt(2 / pi) (x + 0.044715 x^3)``, and its CPU code computes ``tanh`` by Sleef's
``tanhf16_u10``: 0.96 G elements/s on two AMX cores for a [2048, 2048] bfloat16 ``gelu(gate) * up``, 15% of a Gemma 2
shaped prefill. ``0.5 (1 + tanh(u))`` is ``sigmoid(2u)``, which inductor computes through its vectorized ``exp``:
2.6 G elements/s for the same product. The identity is exact; in float32 the two roundings differ by a few ulp, and
where ``x`` is very negative the sigmoid has the smaller error (``1 + tanh(u)`` cancels there). Computed in float32
from a bfloat16 or float16 input and rounded once, as inductor computes the original.

The same form written out in Python (GPT-2's ``NewGELUActivation``, ``FastGELUActivation``, Bloom's gelu: ``0.5 x
(1 + tanh(u))`` in the model's own code) reaches inductor as ``add(tanh(u), 1)``, past any decomposition:
``SigmoidForOnePlusTanh``, a post-grad pass of the engine's graphs, rewrites each such sum as ``2 sigmoid(2u)``
(a bfloat16 ``NewGELUActivation`` of [2048, 4096], one thread: 0.15 -> 0.46 G elements/s). A ``tanh`` with other
users stays for them; a ``tanh`` not added to 1 (a softcap) is left alone.
"""

from __future__ import annotations

import functools
import math

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.decomposition import select_decomp_table

aten = torch.ops.aten

_TWO_SQRT_2_OVER_PI = 2.0 * math.sqrt(2.0 / math.pi)  # 2 sqrt(2 / pi): sigmoid(2u) with u's own constant
_CUBIC = 0.044715


def gelu_tanh_by_sigmoid(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``aten.gelu``: ``x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))`` for ``approximate="tanh"``, inductor's own
    decomposition otherwise (``"none"``: the erf form; anything else: its error)."""
    if approximate != "tanh":
        return select_decomp_table()[aten.gelu.default](x, approximate=approximate)
    wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    inner = _TWO_SQRT_2_OVER_PI * (wide + _CUBIC * wide * wide * wide)
    return (wide * torch.sigmoid(inner)).to(x.dtype)


def _is_one(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1


def _tanh_plus_one(node: torch.fx.Node) -> torch.fx.Node | None:
    """The ``tanh`` node of ``add(tanh(u), 1)`` or ``add(1, tanh(u))``, else None."""
    if node.op != "call_function" or node.target is not aten.add.Tensor or node.kwargs or len(node.args) != 2:
        return None
    for term, other in (node.args, node.args[::-1]):
        if (isinstance(term, torch.fx.Node) and term.op == "call_function" and term.target is aten.tanh.default
                and _is_one(other)):
            return term
    return None


class SigmoidForOnePlusTanh(CustomGraphPass):
    """Post-grad pass: each ``add(tanh(u), 1)`` becomes ``mul(sigmoid(mul(u, 2)), 2)`` (the same value; inductor's
    vectorized ``exp`` instead of Sleef's ``tanh``), the ``tanh`` dropped where nothing else reads it."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            tanh = _tanh_plus_one(node)
            if tanh is None:
                continue
            inner = tanh.args[0]
            with graph.inserting_before(node):
                doubled = graph.call_function(aten.mul.Tensor, (inner, 2.0))
                doubled.meta["val"] = inner.meta["val"] * 2.0
                squashed = graph.call_function(aten.sigmoid.default, (doubled,))
                squashed.meta["val"] = torch.sigmoid(doubled.meta["val"])
                twice = graph.call_function(aten.mul.Tensor, (squashed, 2.0))
                twice.meta["val"] = squashed.meta["val"] * 2.0
            node.replace_all_uses_with(twice)
            graph.erase_node(node)
            if not tanh.users:
                graph.erase_node(tanh)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


class _Table(dict):
    """A decomposition table that pickles as the call that makes it. Inductor's compile caches pickle the table into
    their keys, and its builtin entries do not pickle (every compile would bypass the caches); what the table holds
    is in the key through this file's hash (``compile._GraphPasses.uuid``) instead."""

    def __reduce__(self):
        return (engine_decompositions, ())


@functools.cache
def engine_decompositions() -> dict:
    """Inductor's decomposition table with the engine's entries above in place of its own."""
    return _Table({**select_decomp_table(), aten.gelu.default: gelu_tanh_by_sigmoid})
