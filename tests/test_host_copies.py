"""The host tier's asynchronous copies (``kv.copies``: OFFLOAD / LOAD on a side stream), on CPU with a fake stream.

A CPU has no streams, so ``FakeSide`` runs every copy inline and checks the order the copies keep the two streams in:
the side stream uses a tensor made on the compute stream only after waiting for it, the compute stream uses one
made on the side stream only after waiting for it. With it the asynchronous code path runs here end to end:

- an offload, an immediate overwrite of the device blocks (their reuse), then a load into other blocks gives back
  the original bytes, in every format's pool tensors (``offload_reuse_load``: ``tests/test_cuda.py`` runs it on CUDA
  with a real stream and the compute stream kept busy);
- a host-tier hit through that path gives the tokens and logprobs of a device-pool hit;
- a host storage that grows waits for the side stream first (the grow reads it on the CPU);
- without a side stream (CPU), nothing is pinned and the copies run inline, as before.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paged_hf.kv.copies import BlockCopy, CopyKind, CopyLog, apply_copy, id_runs
from paged_hf.kv.host_tier import HostTier
from paged_hf.quant import make_storage
from test_prefix_tiers import host_run
from models import tiny_model, token_logprobs

HEADS, HEAD_DIM, BLOCK = 2, 32, 4


class FakeSide:
    """A side stream that runs everything inline and asserts the stream order of ``kv.copies``."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.on_side = self.side_waited = self.compute_waited = False

    def waits_for_compute(self) -> None:
        self.events.append("side waits")
        self.side_waited = True

    def compute_waits(self) -> None:
        self.events.append("compute waits")
        self.compute_waited = True

    @contextmanager
    def active(self):
        self.events.append("enter")
        self.on_side, self.compute_waited = True, False  # what the side queues now, the compute stream has not seen
        yield
        self.on_side, self.side_waited = False, False  # what the compute stream queues next, the side has not seen
        self.events.append("exit")

    def lend(self, tensor: torch.Tensor, to_side: bool) -> None:
        if to_side:
            assert self.on_side and self.side_waited, "the side stream used a compute tensor before waiting for it"
        else:
            assert not self.on_side and self.compute_waited, "the compute stream used a side tensor before waiting"
        self.events.append("lend to side" if to_side else "lend to compute")

    def synchronize(self) -> None:
        self.events.append("sync")


@given(st.lists(st.integers(0, 40), max_size=20, unique=True))
def test_id_runs_cover_the_ids_in_maximal_consecutive_runs(ids):
    runs = id_runs(tuple(ids))
    assert [first + i for first, _, n in runs for i in range(n)] == ids
    assert [at for _, at, _ in runs] == [sum(n for _, _, n in runs[:k]) for k in range(len(runs))]
    assert all(a[0] + a[2] != b[0] for a, b in zip(runs, runs[1:]))  # maximal: no run continues the previous one


def offload_reuse_load(kv_format: str, device: torch.device, side_factory, stall=None) -> HostTier:
    """Offloads device blocks (3, 1, 2) of a 2-layer pool to host blocks (0, 1, 5), overwrites them at once (their
    reuse), loads the host blocks into device blocks (6, 7, 8) and checks every pool tensor holds the original
    bytes there. ``stall(host, kind)`` runs before each copy (CUDA: keeps a stream busy, so a missing wait shows)."""
    gen = torch.Generator().manual_seed(0)
    storages = {idx: make_storage(kv_format, 9, BLOCK, HEADS, HEAD_DIM, torch.float32, device) for idx in (0, 1)}
    for storage in storages.values():  # random bytes in every pool tensor (codes, scales, ...) of every block
        for tensor in storage.tensors().values():
            raw = tensor.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen).to(device))
    def raw(idx, name, blocks):  # bytes: random bits include NaNs, which never compare equal as floats
        return storages[idx].tensors()[name][blocks].view(torch.uint8).cpu()

    original = {(idx, name): raw(idx, name, [3, 1, 2]) for idx, s in storages.items() for name in s.tensors()}
    host = HostTier(6, 1, kv_format, CopyLog())
    host.side_factory = side_factory
    stall = stall or (lambda host, kind: None)
    stall(host, CopyKind.OFFLOAD)
    apply_copy(BlockCopy(0, (3, 1, 2), (0, 1, 5), CopyKind.OFFLOAD), storages, None, host)
    for storage in storages.values():
        for tensor in storage.tensors().values():
            tensor[[3, 1, 2]] = tensor[[0]]  # the evicted blocks are reused at once
    stall(host, CopyKind.LOAD)
    apply_copy(BlockCopy(0, (0, 1, 5), (6, 7, 8), CopyKind.LOAD), storages, None, host)
    for (idx, name), expected in original.items():
        assert torch.equal(raw(idx, name, [6, 7, 8]), expected), (idx, name)
    return host


@pytest.mark.parametrize("kv_format", ["auto", "int8", "int4"])
def test_offload_then_immediate_reuse_then_load_is_exact_on_the_side_path(kv_format):
    side = FakeSide()
    offload_reuse_load(kv_format, torch.device("cpu"), lambda device: side)
    pools = len(make_storage(kv_format, 1, BLOCK, HEADS, HEAD_DIM, torch.float32, "cpu").tensors())
    per_copy = 2 * pools  # one staging tensor per pool tensor of each of the 2 layers
    assert side.events == (["side waits", "enter", *["lend to side"] * per_copy, "exit"]  # offload
                           + ["enter", "exit", "compute waits", *["lend to compute"] * per_copy])  # load


def test_a_growing_host_storage_waits_for_the_side_stream():
    side = FakeSide()
    storages = {0: make_storage("auto", 9, BLOCK, HEADS, HEAD_DIM, torch.float32, "cpu")}
    host = HostTier(8, 1, "auto", CopyLog())
    host.side_factory = lambda device: side
    apply_copy(BlockCopy(0, (0,), (0,), CopyKind.OFFLOAD), storages, None, host)  # made: nothing to wait for
    apply_copy(BlockCopy(0, (1,), (1,), CopyKind.OFFLOAD), storages, None, host)  # grows from 1 block to 2
    assert side.events.count("sync") == 1 and side.events.index("sync") > side.events.index("exit")
    apply_copy(BlockCopy(0, (2,), (1,), CopyKind.OFFLOAD), storages, None, host)  # fits: no wait
    assert side.events.count("sync") == 1


def test_without_a_side_stream_nothing_is_pinned_and_copies_run_inline():
    host = offload_reuse_load("int8", torch.device("cpu"), HostTier.side_factory)
    assert host.side_stream(torch.device("cpu")) is None
    assert not any(t.is_pinned() for t in host.space.storage(0, 0).tensors().values())


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_host_tier_hit_through_the_side_path_equals_pool_hit(monkeypatch, kv_cache_dtype):
    sides: list[FakeSide] = []

    def fake_side(device):
        sides.append(FakeSide())
        return sides[-1]

    monkeypatch.setattr(HostTier, "side_factory", staticmethod(fake_side))
    model = tiny_model("llama")
    pool_hit, _ = host_run(model, kv_cache_dtype, tiered=False)
    host_hit, stats = host_run(model, kv_cache_dtype, tiered=True)
    assert stats["prefix_cache_host_hits"] > 0 and len(sides) == 1
    assert "side waits" in sides[0].events and "compute waits" in sides[0].events  # offloads and a load ran there
    assert host_hit.outputs[0].token_ids == pool_hit.outputs[0].token_ids
    assert token_logprobs(host_hit.outputs[0]) == token_logprobs(pool_hit.outputs[0])
