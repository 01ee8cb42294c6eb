"""How the CPU kernel library is built. A failed build leaves the torch paths, logged. The library can be built for
instruction sets older than this machine's (``PAGED_HF_CPU_ARCH``), each through the
kernel tests in a process of its own: AVX2 (``x86-64-v3``: AMD Zen 2 and 3, Intel before Skylake-SP) and AVX-512
with bfloat16 dot products but no AMX (``cooperlake``, what AMD Zen 4 offers). The kernels' ``#if`` branches for
those machines would otherwise be compiled and run only on users' machines: CI's has AMX, and the library targets
``-march=native``. Each target builds the library once into the user's cache (~1.5 min), then runs the files below
(~1 min). The AVX2 build's machine code is read as well: no loop compares floats one lane at a time."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_target import cpu_flags
from paged_hf.kernels import cpu_ext

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {  # -march value: CPU flags it needs
    "x86-64-v3": {"avx2", "fma", "bmi2", "f16c", "movbe"},
    "cooperlake": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"},
}
FILES = ("tests/test_cpu_decode_kernel.py", "tests/test_cpu_prefill_kernel.py", "tests/test_packed_linear.py",
         "tests/test_compiled_cpu_ops.py", "tests/test_cpu_bf16.py")


@pytest.fixture
def compiler():
    found = cpu_ext._compiler()
    if found is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86-64 machine with a C++ compiler")
    return found


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_the_kernel_tests_pass_with_the_library_built_for(arch):
    if platform.machine() not in ("x86_64", "AMD64") or not cpu_ext.loaded():
        pytest.skip("an x86-64 machine with the C++ kernels")
    missing = TARGETS[arch] - cpu_flags()
    if missing:
        pytest.skip(f"this CPU cannot run {arch} code (no {', '.join(sorted(missing))})")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST_", "PAGED_HF_CPU_KERNELS"))}
    env[cpu_ext.ARCH_VAR] = arch
    # the real-model bound of test_cpu_bf16 is the slow half of that file; stories260K keeps its check
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                             "-k", "not smollm2", *FILES], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=1500)
    assert result.returncode == 0, f"built for {arch}:\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
    assert " passed" in result.stdout.splitlines()[-1], result.stdout[-2000:]


HEADER = re.compile(r"^([0-9a-f]+) <(.+)>:$")  # objdump -d: a function's first line
INSTRUCTION = re.compile(r"^\s+([0-9a-f]+):\s+(\S+)\s*(.*)$")  # address, mnemonic, operands
SCALAR_COMPARES = {"comiss", "ucomiss", "vcomiss", "vucomiss"}


def innermost_loops(disassembly: str) -> list[tuple[str, int]]:
    """(function, scalar float compares) for each innermost loop of ``objdump -d`` output: the span from a backward
    jump's target to the jump that contains no other such span."""
    found, name, body = [], None, []

    def close():
        spans = set()
        for address, mnemonic, operands in body:
            target = operands.split()[0] if mnemonic.startswith("j") and operands else ""
            if re.fullmatch(r"[0-9a-f]+", target) and int(target, 16) <= address:
                spans.add((int(target, 16), address))
        for first, last in spans:
            if not any((a, b) != (first, last) and first <= a and b <= last for a, b in spans):
                found.append((name, sum(first <= address <= last and mnemonic in SCALAR_COMPARES
                                        for address, mnemonic, _ in body)))

    for line in disassembly.splitlines():
        if header := HEADER.match(line):
            if name is not None:
                close()
            name, body = header.group(2), []
        elif (instruction := INSTRUCTION.match(line)) and name is not None:
            body.append((int(instruction.group(1), 16), instruction.group(2), instruction.group(3)))
    if name is not None:
        close()
    return found


def test_no_loop_of_the_avx2_build_compares_floats_one_lane_at_a_time(monkeypatch, compiler):
    """GCC 12 lowers a compare or select of a vector wider than the target's registers (vec16.h's sixteen-float
    f16v on AVX2) to one scalar compare per lane, with no warning: the greedy scan, the decode softmax and the
    softcap once ran so at a fraction of their speed. In the AVX2 build, every innermost loop has fewer scalar float
    compares than a vector has lanes (a sixteen-lane select in the greedy scan put 96 there; the scalar tails have
    at most 5)."""
    objdump = shutil.which("objdump")
    missing = TARGETS["x86-64-v3"] - cpu_flags()
    if objdump is None or missing:
        pytest.skip("objdump, and a CPU that runs x86-64-v3 code")
    monkeypatch.setenv(cpu_ext.ARCH_VAR, "x86-64-v3")
    library = cpu_ext._build(compiler)
    disassembly = subprocess.run([objdump, "-d", "--no-show-raw-insn", "-C", str(library)], capture_output=True,
                                 text=True, check=True, timeout=300).stdout
    loops = innermost_loops(disassembly)
    assert any("greedy" in name for name, _ in loops), "the greedy scan's loops were not found"
    lane_by_lane = sorted({(count, name[:160]) for name, count in loops if count >= 8}, reverse=True)
    assert not lane_by_lane, f"loops comparing floats one lane at a time (compares, function): {lane_by_lane}"


def test_a_target_that_is_not_a_march_value_is_refused(monkeypatch, compiler):
    monkeypatch.setenv(cpu_ext.ARCH_VAR, "native; rm -rf /")
    with pytest.raises(ValueError, match="PAGED_HF_CPU_ARCH is a -march value"):
        cpu_ext._flags(compiler)
    monkeypatch.setenv(cpu_ext.ARCH_VAR, "no-such-cpu")
    with pytest.raises(ValueError, match="PAGED_HF_CPU_ARCH=no-such-cpu: .* does not take it as a -march value"):
        cpu_ext._flags(compiler)
    monkeypatch.setenv(cpu_ext.ARCH_VAR, " ")
    assert cpu_ext._flags(compiler)[-1] == "-march=native"


def test_a_target_with_instructions_this_cpu_lacks_is_refused(monkeypatch, compiler):
    """A library built for more than the CPU has would die of an illegal instruction: refused before building,
    naming what is missing (here the CPU is made to look like an SSE4.2 machine, x86-64-v2)."""
    real = cpu_ext.target_macros
    monkeypatch.setattr(cpu_ext, "target_macros",
                        lambda compiler=None, arch=None: real(compiler, "x86-64-v2" if arch is None else arch))
    monkeypatch.setenv(cpu_ext.ARCH_VAR, "x86-64-v3")
    with pytest.raises(ValueError, match=r"PAGED_HF_CPU_ARCH=x86-64-v3: this CPU lacks .*__AVX2__.*__FMA__"):
        cpu_ext._flags(compiler)
    monkeypatch.setenv(cpu_ext.ARCH_VAR, "x86-64-v2")
    assert cpu_ext._flags(compiler)[-1] == "-march=x86-64-v2"


def test_a_failed_build_leaves_the_torch_paths_and_says_why(tmp_path):
    compiler = tmp_path / "broken-c++"
    compiler.write_text("#!/bin/sh\necho 'fatal error: vec16.h: No such file' >&2\nexit 1\n")
    compiler.chmod(0o755)
    env = {**os.environ, "CXX": str(compiler), "PAGED_HF_CACHE": str(tmp_path / "cache")}
    env.pop(cpu_ext.ARCH_VAR, None)
    script = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
              "from paged_hf.kernels import cpu_ext\n"
              "print(cpu_ext.loaded(), cpu_ext.decode_kernel(), cpu_ext.pin_threads())")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False", "None", "None"]
    assert "building the CPU kernels failed" in result.stderr and "vec16.h: No such file" in result.stderr
    assert not list((tmp_path / "cache").rglob("*.so")), "a failed build leaves no library behind"
