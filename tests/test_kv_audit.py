"""The KV manager's audit raises ``KVInvariantError`` on broken bookkeeping, under ``python -O`` too (an ``assert``
would vanish there), and stays quiet on sound bookkeeping."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest
from transformers import LlamaConfig

from paged_hf.kv.audit import KVInvariantError
from paged_hf.kv.manager import KVManager


def small_manager() -> KVManager:
    config = LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                         intermediate_size=32, vocab_size=32)
    return KVManager(config, 4, "auto", num_blocks=8)


def test_a_row_that_differs_from_its_table_fails_the_audit():
    kv = small_manager()
    seq = kv.new_sequence()
    kv.append(seq, 6)  # blocks 0, 1
    kv.check_invariants()
    kv.groups[0].rows.table[seq.row, 1] = 7
    with pytest.raises(KVInvariantError, match=r"row 0 holds \[0, 7\], its table \[0, 1\]"):
        kv.check_invariants()


def test_a_ref_count_no_table_explains_fails_the_audit():
    kv = small_manager()
    seq = kv.new_sequence()
    kv.append(seq, 4)
    seq.tables[0].pool.touch([seq.tables[0].blocks[0]])  # a reference nobody holds
    with pytest.raises(KVInvariantError, match=r"block 0 has ref_cnt 2 but 1 tables hold it"):
        kv.check_invariants()


def test_the_audit_raises_under_python_O():
    script = textwrap.dedent("""
        import sys
        sys.path[:0] = [{root!r}, {tests!r}]
        from test_kv_audit import small_manager
        from paged_hf.kv.audit import KVInvariantError
        kv = small_manager()
        seq = kv.new_sequence()
        kv.append(seq, 6)
        kv.groups[0].rows.table[seq.row, 1] = 7
        try:
            kv.check_invariants()
        except KVInvariantError:
            print("raised")
    """)
    tests = pathlib.Path(__file__).parent
    code = script.format(root=str(tests.parent), tests=str(tests))
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "raised"
