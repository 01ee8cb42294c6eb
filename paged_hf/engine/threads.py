"""The CPU threads an engine's forward runs on (the meaning of vLLM's ``VLLM_CPU_OMP_THREADS_BIND``).

``cpu_threads_bind`` (``EngineConfig``):
- ``"auto"`` (default): in a process that already runs torch (``PagedEngine``, ``LLM``), the thread count stays as
  the program set it (``OMP_NUM_THREADS``, ``torch.set_num_threads``); with two or more, each is pinned to its own
  CPU of the process's mask while the engine steps (``StepPinning``): the thread calling ``step`` only during the
  step (its mask is restored after, so what the program starts later inherits its own), its OpenMP workers from
  the first step on. A process that starts for the engine (``paged-hf serve``) gets one pinned thread per CPU it may
  run on (its affinity mask) before torch loads;
- a CPU list, ``"0-3"`` or ``"0,2,4-5"``: those CPUs only, one intra-op thread each, each thread pinned to its own
  CPU (``kernels/cpu_ext.pin_threads``, where the CPU kernels build; else the process bound to the list);
- ``"nobind"``: torch's threads and the process's affinity are left as they are, everywhere.

Why pin: on a machine other processes share, unpinned intra-op threads were 4-5x slower than pinned ones in the same
run (SmolLM2 bf16, 2 threads on 2 busy cores: 13 vs 59 tok/s, 65 vs 18 CPU-seconds), as vLLM found (it pins). A
thread the scheduler moves onto the other thread's core makes every parallel region wait for it.

In a process that has not started torch's OpenMP runtime yet (``paged-hf serve --cpu-threads-bind``, before it
imports torch), ``paged_hf_cli`` also pins each OpenMP thread to its own CPU (``OMP_PROC_BIND`` / ``OMP_PLACES``). It
leaves the wait policy at the runtime's default (spin briefly, then sleep): ``OMP_WAIT_POLICY=PASSIVE`` made every step
of a serving workload 33% slower on a quiet Xeon, and the default-policy engine keeps about half its speed beside a
process that keeps a core busy (``benchmarks/RESULTS.md``).

One thread keeps an OpenMP team: the one that steps. Each thread that starts parallel work gets a team of its own,
kept after its work ends, and libgomp counts the threads of every team: with more of them than CPUs (the team of the
thread that loaded the model beside the engine thread's, in ``paged-hf serve``), a waiting thread spins 100 times
instead of about 300,000 before it sleeps, so each of a step's hundreds of parallel regions pays a futex wake-up. A
16-stream serving step took 110 ms instead of 80-86 ms that way. ``release_openmp_team`` ends the calling thread's
team; the server's engine loop calls it in the thread that starts it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading

import torch

from ..kernels.cpu_ext import pin_threads

logger = logging.getLogger("paged_hf")
KEYWORDS = ("auto", "nobind")
START_AFFINITY_ENV = "PAGED_HF_START_AFFINITY"  # set by paged_hf_cli._pin_openmp


def parse_cpu_list(spec: str, name: str = "cpu_threads_bind") -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]``; ValueError naming ``name`` for anything else."""
    cpus: list[int] = []
    try:
        for part in spec.split(","):
            low, _, high = part.strip().partition("-")
            first, last = int(low), int(high or low)
            if first < 0 or last < first:
                raise ValueError
            cpus.extend(range(first, last + 1))
    except ValueError:
        raise ValueError(f"{name} must be 'auto', 'nobind' or a CPU list such as '0-3' or '0,2,4-5', "
                         f"got {spec!r}") from None
    return sorted(set(cpus))


def check_cpu_threads_bind(spec) -> None:
    """ValueError unless ``spec`` is a keyword or a CPU list (the CPUs' existence is checked when binding)."""
    if not isinstance(spec, str):
        raise ValueError(f"cpu_threads_bind must be a string ('auto', 'nobind' or a CPU list), got {spec!r}")
    if spec not in KEYWORDS:
        parse_cpu_list(spec)


def _listed_cpus(spec: str) -> list[int]:
    """The CPUs a CPU-list ``spec`` names; ValueError for CPUs this process may not run on."""
    allowed = _allowed_cpus()
    cpus = parse_cpu_list(spec)
    outside = [c for c in cpus if c not in allowed]
    if outside:
        raise ValueError(f"cpu_threads_bind={spec!r} names CPUs {outside} this process may not run on "
                         f"(allowed: {allowed})")
    return cpus


def _allowed_cpus() -> list[int]:
    """The CPUs this process may run on: as it started where ``paged-hf`` pinned OpenMP before torch loaded (the
    runtime then binds this thread to one CPU of the list), else this thread's affinity."""
    started = os.environ.get(START_AFFINITY_ENV)
    if started:
        return parse_cpu_list(started, START_AFFINITY_ENV)
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))


def bind_cpu_threads(spec: str, device) -> list[int] | None:
    """Binds this process's intra-op threads as ``spec`` says (CPU devices only); returns the CPUs, logged."""
    if torch.device(device).type != "cpu":
        return None
    if spec in KEYWORDS:
        logger.info("PagedEngine: %d intra-op threads, as this process set them (cpu_threads_bind=%r)",
                    torch.get_num_threads(), spec)
        return None
    cpus = _listed_cpus(spec)
    if hasattr(os, "sched_setaffinity") and not os.sched_getaffinity(0) <= set(cpus):
        os.sched_setaffinity(0, cpus)  # (a thread OpenMP already pinned to one of them stays there)
    if torch.get_num_threads() != len(cpus):
        torch.set_num_threads(len(cpus))
    pin = pin_threads()  # each intra-op thread on its own CPU (the process's mask leaves them free to move)
    pinned = pin(cpus) if pin is not None else None
    logger.info("PagedEngine: %d intra-op threads bound to CPUs %s%s (cpu_threads_bind=%r)", len(cpus), cpus,
                ", one thread per CPU" if pinned == cpus else "", spec)
    return cpus


OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the threads end; the runtime stays initialized


@functools.cache
def _openmp_pause():
    """``omp_pause_resource_all`` of the OpenMP runtime torch loaded (libgomp, LLVM's or Intel's), or None where
    none is loaded, it lacks the call (OpenMP < 5.0), or the platform has no ``/proc/self/maps`` to find it by."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(("libgomp", "libiomp", "libomp")):
            try:
                pause = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            return pause
    return None


def release_openmp_team() -> bool:
    """Ends the calling thread's OpenMP team (its worker threads exit; parallel work the thread starts later builds
    a new one). Returns whether the runtime did; False where it cannot (see ``_openmp_pause``) or the thread is
    inside a parallel region. Torch must already be loaded (its runtime is found among the loaded libraries)."""
    pause = _openmp_pause()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0


class StepPinning:
    """One thread per CPU of ``cpus`` while the engine steps: the thread calling ``step`` on ``cpus[0]`` for the
    step's duration (its own mask restored after), its OpenMP team's workers on the others from its first step on
    (``cpu_ext.pin_threads``, once per stepping thread: each thread that starts parallel work has its own team)."""

    def __init__(self, cpus: list[int] | None) -> None:
        self.cpus = cpus
        self._pinned = threading.local()

    @classmethod
    def for_engine(cls, spec: str, device, bound: list[int] | None) -> StepPinning:
        """The pinning of an engine built with ``cpu_threads_bind=spec``: the CPUs ``bind_cpu_threads`` bound
        (``bound``), or for ``"auto"`` the first ``torch.get_num_threads()`` of the process's CPUs (none with one
        thread, under ``paged-hf serve``, which pinned OpenMP itself, or where the CPU kernels cannot be built)."""
        if bound is not None:
            return cls(bound)
        if (spec != "auto" or torch.device(device).type != "cpu" or os.environ.get(START_AFFINITY_ENV)
                or not hasattr(os, "sched_setaffinity") or torch.get_num_threads() < 2 or pin_threads() is None):
            return cls(None)
        cpus = _allowed_cpus()[: torch.get_num_threads()]
        if len(cpus) < 2:
            return cls(None)
        logger.info("PagedEngine: %d intra-op threads, each pinned to its own CPU of %s while the engine steps "
                    "(cpu_threads_bind='auto'; 'nobind' leaves them free)", len(cpus), cpus)
        return cls(cpus)

    @contextlib.contextmanager
    def during_step(self):
        if self.cpus is None:
            yield
            return
        mask = os.sched_getaffinity(0)
        if getattr(self._pinned, "team", None) != self.cpus:
            pin_threads()(self.cpus)  # this thread on cpus[0], its team's workers on the others
            self._pinned.team = self.cpus
        else:
            os.sched_setaffinity(0, (self.cpus[0],))
        try:
            yield
        finally:
            os.sched_setaffinity(0, mask)
