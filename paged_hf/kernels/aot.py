"""Ahead-of-time views of a prepared kernel launch (``Launch``), without a GPU.

- ``variant_key(launch)``: the key under which triton caches the compiled kernel this launch would run on a
  CUDA device (the kernel, its constexprs, the specialization of its other arguments: dtypes, which pointers are
  None, which integers are 1 or multiples of 16, alignment; the launch options). Two launches with the same key
  run the same binary; a launch whose key was not compiled yet compiles in the middle of serving. It works under
  ``TRITON_INTERPRET=1`` too (the key is computed as the CUDA backend would, from the launch's arguments).
- ``compile_launch(launch)``: compiles the launch's variant for ``sm_90`` (ptxas included) and returns its
  registers, spills, stack and shared memory. Needs the kernels decorated in compiled mode (``TRITON_INTERPRET``
  unset before the first launch) and triton's ``ptxas``; no GPU.

Both read triton internals (``create_function_from_signature``, ``JITFunction._pack_args``: triton 3.9), so they
serve tests, ``benchmarks/compile_report.py`` and start-up checks, never the launch path. triton is imported
inside the functions only.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import time
from dataclasses import dataclass

SM90 = 90
# Largest shared memory one program may use on sm_90 (H100/H200: 227 KiB of dynamic shared memory per block).
SM90_MAX_SHARED = 227 * 1024


@dataclass(frozen=True)
class CompiledVariant:
    """What ptxas and triton report for one compiled variant."""

    kernel: str
    registers: int
    spill_stores: int  # bytes per thread
    spill_loads: int  # bytes per thread
    stack: int  # bytes of stack frame per thread
    shared: int  # bytes of (dynamic) shared memory per program
    num_warps: int
    num_stages: int
    seconds: float  # compile time here

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


@functools.cache
def _backend(arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", arch, 32)
    return target, make_backend(target)


def _jit_function(kernel):
    """The ``JITFunction`` of a launch's kernel; under the interpreter, one rebuilt from the same Python function
    with the same decorator arguments (``do_not_specialize``...), which is what the GPU would compile."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    return _rebuilt(kernel.fn, tuple(sorted((k, _freeze(v)) for k, v in getattr(kernel, "kwargs", {}).items())))


def _freeze(value):
    return tuple(value) if isinstance(value, list) else value


@functools.cache
def _rebuilt(fn, kwargs: tuple):
    from triton.runtime.jit import JITFunction

    return JITFunction(fn, **{k: list(v) if isinstance(v, tuple) else v for k, v in kwargs if v is not None})


def _bind(launch, arch: int):
    """triton's own binding of the launch's arguments for the CUDA backend: (jit function, bound arguments,
    specialization, launch options)."""
    jit = _jit_function(launch.kernel)
    binder = _binder(jit, arch)
    bound, specialization, options = binder(*launch.args, **launch.meta, **launch.options)
    return jit, bound, specialization, options


_BINDERS: dict = {}  # (id of the jit function, arch) -> (jit function, binder); not hashed: hashing a
# JITFunction compiles its dependency hash, which fails under the interpreter (its helpers stay plain Python)


def _binder(jit, arch: int):
    from triton.runtime.jit import create_function_from_signature

    key = (id(jit), arch)
    if key not in _BINDERS:
        _BINDERS[key] = jit, create_function_from_signature(jit.signature, jit.params, _backend(arch)[1])
    return _BINDERS[key][1]


def variant_key(launch, arch: int = SM90) -> tuple:
    """``(kernel name, triton's cache key)`` of the variant ``launch`` runs (see the module docstring)."""
    jit, _, specialization, options = _bind(launch, arch)
    specialization = [tuple(str(x) for x in item) if isinstance(item, tuple) else str(item) for item in specialization]
    return (jit.fn.__name__, tuple(specialization), tuple(sorted(options.items())))


_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_launch(launch, arch: int = SM90) -> CompiledVariant:
    """Compiles ``launch``'s variant for ``sm_<arch>`` (always, bypassing triton's cache, so ptxas reports)."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    jit, bound, specialization, options = _bind(launch, arch)
    target, backend = _backend(arch)
    kwargs = {**launch.meta, **launch.options}
    parsed, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
    source = ASTSource(jit, signature, constexprs, attrs)
    saved = knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log
    log = io.StringIO()
    started = time.perf_counter()
    try:
        knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = True, True
        with contextlib.redirect_stdout(log):  # triton prints the ptxas log
            compiled = triton.compile(source, target=target, options=parsed.__dict__)
    finally:
        knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = saved
    seconds = time.perf_counter() - started
    text = log.getvalue()
    registers, spills = _REGISTERS.search(text), _SPILLS.search(text)
    if registers is None or spills is None:
        raise RuntimeError(f"no ptxas report for {jit.fn.__name__}; ptxas printed:\n{text[-2000:]}")
    return CompiledVariant(
        kernel=jit.fn.__name__, registers=int(registers.group(1)), spill_stores=int(spills.group(2)),
        spill_loads=int(spills.group(3)), stack=int(spills.group(1)), shared=int(compiled.metadata.shared),
        num_warps=int(compiled.metadata.num_warps), num_stages=int(compiled.metadata.num_stages), seconds=seconds,
    )


def ptxas_available(arch: int = SM90) -> str | None:
    """None when triton finds the ptxas it compiles ``sm_<arch>`` with, else why not (a skip reason)."""
    try:
        import os

        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(arch).path
    except Exception as error:  # no triton, no NVIDIA backend, or no ptxas
        return f"triton's ptxas for sm_{arch} is not available: {error!r}"
    if not path or not os.path.exists(path):
        return f"triton's ptxas for sm_{arch} is not available (looked for {path!r})"
    return None
