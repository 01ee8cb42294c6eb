"""The padded static decode path on the Triton kernels that CUDA graphs capture (``PAGED_HF_KERNELS=triton``: on a
CPU under triton's interpreter, on CUDA compiled, without graphs): padded rows store into the scratch block only,
int4's fill kernel quantizes the padded fills into it, and the tokens and logprobs equal those of the same kernels
unpadded. ``tests/test_cuda.py`` runs the graphs themselves."""

from __future__ import annotations

import pytest
import torch

from triton_kernels import require_triton_kernels

DEVICE = torch.device("cuda" if require_triton_kernels() else "cpu")

from paged_hf import PagedEngine, SamplingParams  # noqa: E402 - after the interpreter is set up
from paged_hf.engine.cuda_graphs import STATIC_DECODE_ENV  # noqa: E402
from paged_hf.kernels.dispatch import ENV_VAR  # noqa: E402
from models import tiny_model  # noqa: E402
from test_static_decode import Loads, assert_same, outputs  # noqa: E402

# The first request (it holds block 0) outlives the others: the padded steps run while it still reads its blocks.
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0) for n in (9, 3, 7, 8)]
REQUESTS = [[5, 9, 33, 2, 71, 8, 100], [41, 7], [3, 3, 90, 12, 61], [250, 17, 8, 8, 2, 40, 6, 19, 77]]


@pytest.mark.parametrize("kv_format", ["auto", "int8", "int4"])
def test_the_padded_path_on_the_triton_kernels_equals_them_unpadded(monkeypatch, kv_format):
    monkeypatch.setenv(ENV_VAR, "triton")
    options = dict(block_size=4, num_blocks=32, max_num_batched_tokens=8, max_num_seqs=4, kv_cache_dtype=kv_format,
                   enforce_eager=True)
    model = lambda: tiny_model("llama", num_hidden_layers=1).to(DEVICE)  # noqa: E731
    monkeypatch.delenv(STATIC_DECODE_ENV, raising=False)
    normal_engine = PagedEngine(model(), None, **options)
    assert normal_engine.kv.groups[0].storages[0].kernels.triton
    normal = outputs(normal_engine, REQUESTS, PARAMS)
    monkeypatch.setenv(STATIC_DECODE_ENV, "1")
    static_engine = PagedEngine(model(), None, **options)
    loads = Loads(monkeypatch)
    assert_same(normal, outputs(static_engine, REQUESTS, PARAMS))
    assert loads.padded > 0, loads.steps
