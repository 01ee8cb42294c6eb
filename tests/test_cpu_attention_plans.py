"""The production CPU attention builds what depends on the step alone (block ids, masks, sequence groups) once per
step and every layer reuses it (``cpu_attention._StepPlans``), found by the values of the step's tensors: so a
plan is reused across layers, and a change of the tables or lengths (in place, or a new step) never reads a stale
one."""

from __future__ import annotations

import pytest
import torch

from paged_hf.kernels import cpu_attention
from paged_hf.kernels.cpu_attention import paged_decode_attention_cpu, paged_prefill_attention_cpu
from paged_hf.kernels.paged_decode_attention import paged_decode_attention_ref
from paged_hf.kernels.paged_prefill_attention import paged_prefill_attention_ref
from pools import kernel_args
from test_cpu_attention import GROUP, HEAD_DIM, NUM_KV_HEADS, _fresh, _pools

LENGTHS, CHUNKS = (30, 9, 47, 16), (5, 9, 12, 1)


def _counting(monkeypatch) -> dict:
    """Counts the plans built (on the torch path: the in-place decode kernel plans nothing)."""
    monkeypatch.setattr(cpu_attention, "decode_kernel", lambda: None)
    built = {"decode": 0, "prefill": 0}
    for kind in built:
        real = getattr(cpu_attention, f"_{kind}_plan")

        def counted(*args, kind=kind, real=real):
            built[kind] += 1
            return real(*args)

        monkeypatch.setattr(cpu_attention, f"_{kind}_plan", counted)
    return built


@pytest.mark.parametrize("kv_format", ["auto", "int4"])
def test_layers_of_a_step_share_one_plan_and_a_changed_table_builds_another(kv_format, monkeypatch):
    monkeypatch.setattr(cpu_attention, "_STEP", cpu_attention._StepPlans())
    built = _counting(monkeypatch)
    pools, tables, gen = _pools(kv_format, torch.float32, LENGTHS, seed=5)
    seq_lens = torch.tensor(LENGTHS)
    query = torch.randn(len(LENGTHS), NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    operands = dict(block_tables=tables, seq_lens=seq_lens, scale=0.3, sliding_window=20, **pools,
                    **_fresh(pools, len(LENGTHS), torch.float32, gen))
    with torch.inference_mode():  # the engine's tensors: no version counter to catch an in-place change
        for _ in range(3):  # three layers of one step
            torch.testing.assert_close(paged_decode_attention_cpu(query, **kernel_args(operands)),
                                       paged_decode_attention_ref(query, **kernel_args(operands)), atol=1e-5, rtol=1e-5)
        assert built["decode"] == 1
        tables[:, [0, 1]] = tables[:, [1, 0]].clone()  # in place: the same tensor, other blocks
        seq_lens[2] -= 5
        torch.testing.assert_close(paged_decode_attention_cpu(query, **kernel_args(operands)),
                                   paged_decode_attention_ref(query, **kernel_args(operands)), atol=1e-5, rtol=1e-5)
        assert built["decode"] == 2

        cu = torch.tensor([0, *torch.tensor(CHUNKS).cumsum(0).tolist()])
        prefill_query = torch.randn(int(cu[-1]), NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen)
        prefill = dict(operands, cu_query_lens=cu, **_fresh(pools, int(cu[-1]), torch.float32, gen))
        for copy in range(3):  # a new tensor of the same values per layer (the compiled op slices its offsets)
            prefill["cu_query_lens"] = cu.clone()
            torch.testing.assert_close(paged_prefill_attention_cpu(prefill_query, **kernel_args(prefill)),
                                       paged_prefill_attention_ref(prefill_query, **kernel_args(prefill)), atol=1e-5, rtol=1e-5)
        assert built["prefill"] == 1
