"""The rotary embedding's cos/sin tables computed once per compiled step, not once per layer and head.

A stock HF decoder computes its rotary tables once per forward (``rotary_emb(hidden_states, position_ids)``:
``cos``/``sin`` ``[1, T, head_dim]``) and hands them to every layer. Inductor sees a cheap pointwise expression
with few reads and inlines it into each consumer: every layer's q and k rotation kernels evaluate ``cos`` and
``sin`` again, per head (SmolLM2 at 2,048 tokens: 30 layers x 12 heads x 2,048 x 64 of each). ``RealizeRotaryTables``
is an inductor post-grad pass that ends each table's chain at an opaque copy (``paged_hf::rotary_table``), which
inductor must compute into a buffer before it: one ``cos`` and one ``sin`` kernel per step, which every layer
then loads.

Which nodes: each ``aten.cos`` / ``aten.sin``, followed through single-user scaling and dtype casts (HF's
``* attention_scaling`` and ``.to(x.dtype)``) to the node that several consumers read; a table read by one
consumer only is left as it is. The values are the ones the model's own graph defines: the cast to the model's
dtype happens before the buffer, as in eager (inlined, inductor kept the product in float32).
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files


@torch.library.custom_op("paged_hf::rotary_table", mutates_args=())
def rotary_table(table: torch.Tensor) -> torch.Tensor:
    """A copy of ``table``: opaque to inductor, so the expression that made ``table`` is computed once."""
    return table.clone()


@rotary_table.register_fake
def _(table):
    return torch.empty_like(table)


# What HF's rotary modules apply after cos/sin: the attention scaling and the cast to the model's dtype.
_CHAIN = {torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar, torch.ops.prims.convert_element_type.default,
          torch.ops.aten._to_copy.default}


class RealizeRotaryTables(CustomGraphPass):
    """See the module docstring. A graph without ``cos``/``sin`` is left as it is."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        tables = {torch.ops.aten.cos.default, torch.ops.aten.sin.default}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in tables:
                continue
            end = node
            while len(end.users) == 1 and next(iter(end.users)).target in _CHAIN:
                end = next(iter(end.users))
            if len(end.users) < 2:
                continue
            with graph.inserting_after(end):
                copy = graph.call_function(torch.ops.paged_hf.rotary_table.default, (end,))
            copy.meta["val"] = end.meta["val"].clone()
            end.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
