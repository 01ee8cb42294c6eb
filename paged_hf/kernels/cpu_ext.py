"""The CPU kernels in C++ (``csrc/*.cpp``), built on first use into one library and loaded as ``paged_hf_cpu`` ops.

``paged_decode`` (``csrc/paged_decode.cpp``) reads each sequence's K/V where they lie in the block pools (no
gathered copy), in the pools' dtype (float32 or bfloat16), accumulating in float32; ``paged_prefill``
(``csrc/paged_prefill.cpp``) attends each prefill chunk to its own sequence's blocks (no padding to the longest
chunk, no mask): a flash attention of its own where the CPU has its products (oneDNN's brgemm on AMX or AVX-512,
the AVX2 linear's panel micro-kernel on AVX2; bfloat16 without AMX widened to float32 products; the K/V tiles packed
once per call and shared by each GQA group), else torch's causal flash kernel; ``store``/``attend``
(``csrc/paged_step.cpp``) are the compiled forward's KV store and attention over such pools (``paged_hf.ops``);
``packed_linear`` (``csrc/packed_linear.cpp``) is the oneDNN linear of ``paged_hf.packed_linear``, whose bfloat16
products of a few rows run ``csrc/amx_linear.cpp``'s AMX tiles where the CPU has them, and whose products on a CPU
with AVX2 but no AVX-512 run ``csrc/avx2_linear.cpp``; ``pin_threads`` (``csrc/pin_threads.cpp``) binds each of
torch's intra-op threads to its own CPU; ``greedy`` (``csrc/greedy.cpp``) is the sampler's argmax over a step's
logits; ``decode_slots`` (``csrc/decode_slots.cpp``) is a decode step's block tables and slots (``metadata.py``).
The library is compiled once per machine with the system's C++ compiler (``$CXX`` or ``c++``) against the installed
torch (``FLAGS``, with ``-march=native`` unless ``$PAGED_HF_CPU_ARCH`` names another target; ``-fopenmp`` so
``at::parallel_for`` runs on torch's own OpenMP threads: the soname resolves to torch's runtime), into
``$PAGED_HF_CACHE`` (default ``~/.cache/paged_hf``)``/cpu_kernels/<hash>/``; the hash covers the sources (and
``HEADERS``, which they include), torch's version, the compiler, the target and the CPU's flags, so a changed
kernel, torch or machine builds anew.
Concurrent processes (test workers, tensor-parallel ranks) build under one file lock, and the library appears under
its final name only once complete.

No compiler, a failed build or ``PAGED_HF_CPU_KERNELS=0``: ``decode_kernel()``, ``prefill_kernel()`` and
``pin_threads()`` return None,
once logged; the CPU attention keeps its torch path (``cpu_attention``), which computes the same attention, and the
threads stay unpinned.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger("paged_hf")

ENV_VAR = "PAGED_HF_CPU_KERNELS"
SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("paged_decode.cpp", "paged_prefill.cpp", "paged_step.cpp", "packed_linear.cpp",
                             "amx_linear.cpp", "avx2_linear.cpp", "pin_threads.cpp", "greedy.cpp", "decode_slots.cpp"))
HEADERS = tuple(Path(__file__).with_name("csrc") / name  # included by the sources: part of the build's hash
                for name in ("vec16.h", "amx.h", "amx_linear.h", "avx2_linear.h", "huge_buffer.h",
                             "paged_attention.h"))
ARCH_VAR = "PAGED_HF_CPU_ARCH"  # the -march the library is built for (default native: this machine)
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-w")

_lock = threading.Lock()
_state: dict = {}  # "loaded": whether the library is loaded (False once a build failed or was refused)


def decode_kernel():
    """``torch.ops.paged_hf_cpu.paged_decode`` (the library built and loaded on the first call), or None."""
    return torch.ops.paged_hf_cpu.paged_decode if _loaded() else None


def prefill_kernel():
    """``torch.ops.paged_hf_cpu.paged_prefill`` (the library built and loaded on the first call), or None."""
    return torch.ops.paged_hf_cpu.paged_prefill if _loaded() else None


def greedy_kernel():
    """``torch.ops.paged_hf_cpu.greedy`` (``logits [R, V]`` float32/bfloat16 -> ``[R]`` int64, argmax's index),
    or None."""
    return torch.ops.paged_hf_cpu.greedy if _loaded() else None


def decode_slots_kernel():
    """``torch.ops.paged_hf_cpu.decode_slots`` (``table [R, C]`` int32, ``rows [S]``, ``positions [S]`` int64,
    ``block_size``, ``width`` -> ``tables [S, width]`` int32, ``slots [S]`` int64), or None."""
    return torch.ops.paged_hf_cpu.decode_slots if _loaded() else None


def pin_threads():
    """``torch.ops.paged_hf_cpu.pin_threads`` (``cpus: list[int] -> list[int]``), or None."""
    return torch.ops.paged_hf_cpu.pin_threads if _loaded() else None


def loaded() -> bool:
    """Whether the library is loaded (built on the first call); False where it cannot be (logged once)."""
    return _loaded()


def _loaded() -> bool:
    if "loaded" not in _state:
        with _lock:
            if "loaded" not in _state:
                _state["loaded"] = _load()
    return _state["loaded"]


def _load() -> bool:
    if os.environ.get(ENV_VAR, "").strip().lower() in ("0", "false", "no", "off"):
        logger.info("paged_hf: %s=0, the CPU attention uses its torch path", ENV_VAR)
        return False
    compiler = _compiler()
    if compiler is None:
        logger.warning("paged_hf: no C++ compiler (set CXX or install g++): the CPU paged attention uses its torch "
                       "path, slower at decode")
        return False
    try:
        library = _build(compiler)
        torch.ops.load_library(str(library))
        _register_fakes()
        return True
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning("paged_hf: building the CPU kernels failed (%s); the CPU attention uses its torch path "
                       "and the threads stay unpinned", str(error).strip().splitlines()[-1][:300] if str(error).strip() else error)
        return False


def _register_fakes() -> None:
    """The fake (shape-only) implementations dynamo traces the library's graph-facing ops with."""
    fake = torch.library.register_fake
    fake("paged_hf_cpu::packed_linear")(lambda x, weight, bias, key: x.new_empty((*x.shape[:-1], weight.shape[0])))
    fake("paged_hf_cpu::packed_linear_group")(
        lambda x, weights, biases, keys: x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights))))
    fake("paged_hf_cpu::store")(lambda key, value, slots, layer: key.new_empty((0,)))
    # contiguous, as attend returns it, whatever the query's strides (empty_like would keep a head-major query's)
    fake("paged_hf_cpu::attend")(lambda query, *args: query.new_empty(query.shape))


def _compiler() -> str | None:
    """The C++ compiler the library is built with: ``$CXX``, else ``c++`` or ``g++`` on the PATH; None if none."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _target() -> str:
    """The ``-march`` value the library is built for: ``$PAGED_HF_CPU_ARCH``, else native."""
    return os.environ.get(ARCH_VAR, "").strip() or "native"


def _flags(compiler: str) -> tuple[str, ...]:
    """``FLAGS`` and the target: ``-march=native``, or ``-march=$PAGED_HF_CPU_ARCH``, an older instruction set than
    this machine's (e.g. ``x86-64-v3``: how the tests run the kernels' AVX2 and AVX-512 paths on an AMX machine).
    ValueError for a value that is not a ``-march`` the compiler knows, or whose instructions this CPU lacks (the
    library would die of an illegal instruction)."""
    arch = _target()
    if not arch.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"{ARCH_VAR} is a -march value such as native or x86-64-v3, not {arch!r}")
    if arch != "native":
        missing = _instruction_sets(target_macros(compiler, arch)) - _instruction_sets(target_macros(compiler))
        if missing:
            raise ValueError(f"{ARCH_VAR}={arch}: this CPU lacks {', '.join(sorted(missing))}; name an older target "
                             f"(x86-64-v3, x86-64-v2) or unset it")
    return (*FLAGS, f"-march={arch}")


def target_macros(compiler: str | None = None, arch: str | None = None) -> frozenset[str]:
    """The macros `compiler` (default: the one the library is built with) defines for ``-march=arch`` (default:
    ``$PAGED_HF_CPU_ARCH``, else native), e.g. ``__AVX512F__``: what the kernels' ``#if`` branches read."""
    compiler = compiler or _compiler()
    arch = arch or _target()
    result = subprocess.run([compiler, f"-march={arch}", "-dM", "-E", "-x", "c++", os.devnull], capture_output=True,
                            text=True, timeout=60)
    if result.returncode != 0:
        said = [line for line in result.stderr.splitlines() if "error" in line] or result.stderr.splitlines() or [""]
        raise ValueError(f"{ARCH_VAR}={arch}: {Path(compiler).name} does not take it as a -march value "
                         f"({said[0].strip()[:200]})")
    return frozenset(line.split()[1] for line in result.stdout.splitlines() if line.startswith("#define "))


# The instruction sets a compiler uses on its own (vectorizing, bit manipulation) once the target has them; the rest
# (SGX, PKU, WAITPKG, ...) it emits only where code asks by intrinsics, which these kernels do not.
_CODEGEN_SETS = ("__SSE", "__AVX", "__AMX", "__FMA", "__F16C", "__BMI", "__LZCNT", "__POPCNT", "__MOVBE", "__ABM")


def _instruction_sets(macros: frozenset[str]) -> frozenset[str]:
    """The macros among `macros` that name an instruction set the compiler may emit unasked (``_CODEGEN_SETS``)."""
    return frozenset(m for m in macros if m.endswith("__") and m.startswith(_CODEGEN_SETS))


def _build(compiler: str) -> Path:
    """The library for these sources, torch, compiler, target and CPU: built now unless already in the cache."""
    flags = _flags(compiler)
    source = b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(), compiler.encode(), " ".join(flags).encode(),
                                      _compiler_version(compiler), _cpu_flags(), str(abi).encode()])).hexdigest()[:16]
    folder = Path(os.environ.get("PAGED_HF_CACHE", Path.home() / ".cache" / "paged_hf")) / "cpu_kernels" / key
    library = folder / "paged_hf_cpu.so"
    if library.is_file():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it
        if library.is_file():
            return library
        begin = time.perf_counter()
        logger.info("paged_hf: building the CPU kernels (once per machine, into %s)", folder)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            partial = Path(scratch) / library.name
            compile_library(compiler, SOURCES, partial, Path(scratch))
            os.replace(partial, library)
        logger.info("paged_hf: built the CPU kernels in %.1f s", time.perf_counter() - begin)
    return library


def compile_library(compiler: str, sources, library: Path, scratch: Path) -> None:
    """`sources` compiled with this library's flags and target (each to an object in `scratch`, as many at once as
    this process may use CPUs) and linked against the installed torch into `library`; RuntimeError if a step fails.
    The library's own build, and ``benchmarks/prefill_ab.py``'s variants of a kernel."""
    from torch.utils.cpp_extension import include_paths  # noqa: PLC0415 - only when building

    flags = _flags(compiler)
    torch_lib = Path(torch.__file__).parent / "lib"
    compile_flags = [*flags, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                     *(f"-I{path}" for path in include_paths())]
    objects = [scratch / f"{Path(source).stem}.o" for source in sources]
    commands = [[compiler, *compile_flags, "-c", str(source), "-o", str(obj)] for source, obj in zip(sources, objects)]
    jobs = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(jobs, len(commands))) as pool:
        for future in [pool.submit(_run, command) for command in commands]:
            future.result()
    _run([compiler, *flags, *map(str, objects), "-o", str(library), f"-L{torch_lib}", "-ltorch_cpu", "-lc10",
          f"-Wl,-rpath,{torch_lib}"])


def _run(command: list[str]) -> None:
    """One compiler call; RuntimeError with the end of its messages if it fails."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} exited {result.returncode}: {result.stderr[-2000:]}")


def _compiler_version(compiler: str) -> bytes:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return b""


def _cpu_flags() -> bytes:
    """The CPU's feature flags (``-march=native`` depends on them); the platform where /proc has none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return sys.platform.encode()
