"""The engine step's host fast paths give exactly what the general paths give: the decode admission
(``KVManager.append_decodes``) against ``try_append`` one sequence at a time, the greedy pick against
``torch.argmax``, the C++ decode slots against the torch ops, and the buffer-built index tensors against
``torch.tensor``."""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_probe import block_ids
from models import tiny_model
from paged_hf.engine.ends import BatchEnds, RequestEnds
from paged_hf.engine.sampler import greedy_draw, greedy_tokens
from paged_hf.kernels import cpu_ext
from paged_hf.kv.manager import KVManager
from paged_hf import metadata
from paged_hf.block_table_rows import BlockTableRows
from paged_hf.metadata import long_tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 17, 4099])
def test_greedy_tokens_are_argmax_with_ties_nan_and_inf(dtype, vocab):
    """The first index of the maximum wins a tie; a NaN counts as the maximum (its first one)."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randint(0, 3, (12, vocab), generator=generator).to(dtype)  # many ties
    logits[1] = float("-inf")
    logits[2, -1] = float("nan")
    logits[3, -1] = float("inf")
    logits[4] = float("nan")
    if vocab > 1:
        logits[3, 0] = float("inf")
        logits[5, vocab // 2] = float("nan")
        logits[5, 0] = float("inf")
    assert torch.equal(greedy_tokens(logits), torch.argmax(logits, dim=-1))
    assert torch.equal(greedy_tokens(logits[::2]), torch.argmax(logits[::2], dim=-1))  # strided rows


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.integers(1, 70), st.sampled_from([torch.float32, torch.bfloat16]), st.data())
def test_greedy_kernel_is_argmax_wherever_the_maximum_lies(rows, vocab, dtype, data):
    """The C++ argmax against torch's: values from a small set (ties, NaN, +-inf) at every position, lane borders
    (16) and the scalar tail included."""
    values = st.sampled_from([0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")])
    logits = torch.tensor(data.draw(st.lists(st.lists(values, min_size=vocab, max_size=vocab), min_size=rows,
                                             max_size=rows)), dtype=dtype)
    kernel = cpu_ext.greedy_kernel()
    assert kernel is not None
    assert torch.equal(kernel(logits), torch.argmax(logits, dim=-1))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 40), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       st.data())
def test_greedy_draw_is_argmax_and_fails_exactly_the_rows_without_a_finite_maximum(rows, vocab, dtype, data):
    """The sampler's greedy pick (the kernel marks the rows in its tokens; float16 takes torch's max and a gather):
    argmax's tokens, and an error for each row whose chosen logit is NaN or infinite, and for no other."""
    values = st.sampled_from([0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan")])
    logits = torch.tensor(data.draw(st.lists(st.lists(values, min_size=vocab, max_size=vocab), min_size=rows,
                                             max_size=rows)), dtype=dtype)
    token_ids, errors = greedy_draw(logits)
    expected = torch.argmax(logits, dim=-1)
    assert token_ids == expected.tolist()
    chosen = logits.gather(1, expected.unsqueeze(1)).squeeze(1)
    assert sorted(errors) == (~torch.isfinite(chosen)).nonzero().view(-1).tolist()
    assert all("no token can be drawn" in str(error) for error in errors.values())


def test_greedy_tokens_take_the_cpu_kernel(monkeypatch):
    calls = []
    kernel = cpu_ext.greedy_kernel()
    monkeypatch.setattr(cpu_ext, "greedy_kernel", lambda: lambda logits: calls.append(logits.shape) or kernel(logits))
    logits = torch.randn(3, 40)
    assert torch.equal(greedy_tokens(logits), torch.argmax(logits, dim=-1))
    assert calls == [torch.Size([3, 40])]
    assert torch.equal(greedy_tokens(logits.half()), torch.argmax(logits.half(), dim=-1))  # float16: torch's max
    assert len(calls) == 1


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(1, 5), st.sampled_from([1, 2, 4, 16]), st.data())
def test_decode_slots_kernel_is_the_torch_path(num_rows, width, block_size, data):
    """The C++ decode slots kernel and torch's ops (``metadata``'s path without it): the same tables (rows gathered,
    padding included) and slots, for any rows (repeated, out of order) and any position inside the tables; a
    position past them or a row past the table is refused."""
    table_rows = BlockTableRows(num_rows=2, width=2)  # grown by the call
    for row in range(num_rows):
        table_rows.write(row, 0, data.draw(st.lists(st.integers(0, 2**31 - 1), max_size=width)))
    num_seqs = data.draw(st.integers(0, 6))
    rows = long_tensor(data.draw(st.lists(st.integers(0, num_rows - 1), min_size=num_seqs, max_size=num_seqs)))
    positions = long_tensor(data.draw(st.lists(st.integers(0, width * block_size - 1), min_size=num_seqs,
                                               max_size=num_seqs)))
    kernel = cpu_ext.decode_slots_kernel()
    assert kernel is not None
    tables, slots = kernel(table_rows.covering(rows, width, num_rows), rows, positions, block_size, width)
    expected = table_rows.gather(rows, width, num_rows)
    columns = expected.gather(1, (positions // block_size).unsqueeze(1)).view(-1)
    assert tables.dtype == torch.int32 and torch.equal(tables, expected)
    assert slots.dtype == torch.long and torch.equal(slots, columns.long() * block_size + positions % block_size)
    if num_seqs:
        with pytest.raises(RuntimeError, match="is past the"):
            kernel(table_rows.table, rows, positions + width * block_size, block_size, width)
        with pytest.raises(RuntimeError, match="is not in"):
            kernel(table_rows.table, rows + table_rows.table.shape[0], positions, block_size, width)


def test_decode_metadata_takes_the_kernel_and_falls_back_to_torch(monkeypatch):
    """A decode step's metadata from the kernel where it is built, from torch's ops where it is not: the same."""
    kv = KVManager(tiny_model("llama").config, 4, "auto", num_blocks=32)
    seqs = [kv.new_sequence() for _ in range(3)]
    for seq, count in zip(seqs, (5, 9, 1)):
        assert kv.try_append(seq, count)
    rows, starts = long_tensor([seq.row for seq in seqs]), long_tensor([seq.num_tokens - 1 for seq in seqs])
    calls = []
    kernel = cpu_ext.decode_slots_kernel()
    monkeypatch.setattr(cpu_ext, "decode_slots_kernel", lambda: lambda *args: calls.append(1) or kernel(*args))
    native = metadata.decode_metadata(kv, rows, starts, int(starts.max()) + 1, "cpu")
    monkeypatch.setattr(cpu_ext, "decode_slots_kernel", lambda: None)
    torch_path = metadata.decode_metadata(kv, rows, starts, int(starts.max()) + 1, "cpu")
    assert calls == [1]
    for ours, theirs in zip(native.groups, torch_path.groups):
        assert torch.equal(ours.block_tables, theirs.block_tables) and torch.equal(ours.slot_mapping,
                                                                                  theirs.slot_mapping)
    assert native.groups[0].slot_mapping.tolist() == [
        block_ids(seq.tables[0])[(seq.num_tokens - 1) // 4] * 4 + (seq.num_tokens - 1) % 4 for seq in seqs]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40))
def test_long_tensor_equals_torch_tensor(values):
    out = long_tensor(values)
    assert out.dtype == torch.long and torch.equal(out, torch.tensor(values, dtype=torch.long))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.data())
def test_batch_ends_name_the_rows_the_tensor_test_names_at_every_step(num_rows, data):
    """``BatchEnds.ending_rows`` (a set test, and the margin before any row reaches its length) against the tensor
    test it skips: at every step of a batch whose rows grow one token a step, the same rows."""
    stops = data.draw(st.sets(st.integers(0, 9), max_size=3))
    positions = long_tensor(data.draw(st.lists(st.integers(0, 20), min_size=num_rows, max_size=num_rows)))
    max_len = data.draw(st.lists(st.integers(1, 30), min_size=num_rows, max_size=num_rows))
    seqs = [mock.Mock(request=mock.Mock(request_id=str(r), params=mock.Mock(logprobs=None, stop=None)), grammar=None)
            for r in range(num_rows)]
    ends = {str(r): RequestEnds(frozenset(stops), max_len[r], frozenset(), 64) for r in range(num_rows)}
    longest = int(positions.max()) + 1
    batch_ends = BatchEnds.of(seqs, ends, positions, longest)
    for _ in range(data.draw(st.integers(1, 25))):
        tokens = data.draw(st.lists(st.integers(0, 12), min_size=num_rows, max_size=num_rows))
        token_ids = long_tensor(tokens)
        expected = ((positions + 1 >= long_tensor(max_len)) | torch.isin(token_ids, long_tensor(sorted(stops))))
        assert batch_ends.ending_rows(positions, token_ids, tokens, longest) == expected.nonzero().view(-1).tolist()
        positions, longest = positions + 1, longest + 1


def _scenario(family: str, seed: int):
    """A small pool (block size 4) with sequences of random lengths, some forked (a shared, partly full tail that
    must be copied before it is written), close enough to full that some appends find no block."""
    rng = random.Random(seed)
    kv = KVManager(tiny_model(family).config, 4, "auto", num_blocks=rng.randint(6, 14))
    seqs = []
    for _ in range(rng.randint(1, 6)):
        if seqs and rng.random() < 0.3:
            seqs.append(kv.fork(rng.choice(seqs)))
            continue
        seq = kv.new_sequence()
        count = rng.randint(0, 7)
        if not kv.try_append(seq, count):
            kv.discard(seq)
            continue
        seqs.append(seq)
    rng.shuffle(seqs)
    return kv, seqs


def _held(kv: KVManager, seqs) -> tuple:
    return [(seq.num_tokens, [block_ids(t) for t in seq.tables]) for seq in seqs], kv.num_free_blocks


def _state(kv: KVManager, seqs) -> tuple:
    return (*_held(kv, seqs), kv.take_copies())


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # one layer group; a full and a sliding-window group
@pytest.mark.parametrize("grow", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_append_decodes_is_try_append_one_at_a_time(family, grow, seed):
    fast_kv, fast = _scenario(family, seed)
    slow_kv, slow = _scenario(family, seed)
    assert _state(fast_kv, fast) == _state(slow_kv, slow)
    count = fast_kv.append_decodes(fast, grow=grow)
    expected = 0
    for seq in slow:  # the definition: in turn, until one fails (without grow: until one needs a block or copy)
        if not grow and not all(table.tail_has_room() for table in seq.tables):
            break
        if not slow_kv.try_append(seq, 1):
            break
        expected += 1
    assert count == expected
    assert _state(fast_kv, fast) == _state(slow_kv, slow)
    fast_kv.check_invariants()
