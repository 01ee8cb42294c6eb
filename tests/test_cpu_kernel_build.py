"""How the CPU kernel library is built. A failed build leaves the torch paths, logged. The library can be built for
instruction sets older than this machine's (``PAGED_HF_CPU_ARCH``), each through the
kernel tests in a process of its own: AVX2 (``x86-64-v3``: AMD Zen 2 and 3, Intel before Skylake-SP) and AVX-512
with bfloat16 dot products but no AMX (``cooperlake``, what AMD Zen 4 offers). The kernels' ``#if`` branches for
those machines would otherwise be compiled and run only on users' machines: CI's has AMX, and the library targets
``-march=native``. Each target builds the library once into the user's cache (~1.5 min), then runs the files below
(~1 min)."""

from __future__ import annotations

import os
import platform
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
