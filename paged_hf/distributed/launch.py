"""Starting the follower ranks of a tensor-parallel engine: local processes ("mp") or Ray actors ("ray").

The calling process becomes rank 0 (the leader); each follower runs ``target(rank, group, *args)`` (the engine's
follower: join the group, load its shard, follow the leader's steps). ``Executor.check()`` reports a follower that
died (its exit code or Ray's error) so the leader fails its requests with that error instead of waiting on a
collective until the group's timeout.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass, field

from .group import TensorParallelError

logger = logging.getLogger("paged_hf")
BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ModelSpec:
    """How every rank loads the same model: ``from_pretrained(path, **kwargs)`` plus the tensor-parallel config."""

    path: str
    kwargs: dict = field(default_factory=dict)

    def load(self, tp_size: int):
        from transformers import AutoModelForCausalLM, DistributedConfig  # noqa: PLC0415

        return AutoModelForCausalLM.from_pretrained(
            self.path, distributed_config=DistributedConfig(tp_size=tp_size), **self.kwargs
        ).eval()


@dataclass(frozen=True)
class GroupAddress:
    address: str
    port: int
    size: int
    backend: str  # the torch.distributed backend: "gloo" (CPU) or "nccl" (CUDA)
    timeout_s: float


class Executor:
    """The followers this process started; ``check`` raises if one has died, ``shutdown`` waits for them."""

    def __init__(self, backend: str, handles: list, refs: list | None = None, owns_ray: bool = False) -> None:
        self.backend = backend
        self._handles = handles  # processes ("mp") or actors ("ray")
        self._refs = refs or []  # ray: the futures of the actors' runs
        self._owns_ray = owns_ray  # ray: this executor started the local Ray runtime, so it stops it

    def check(self) -> None:
        """``TensorParallelError`` naming the rank if a follower is gone (it would leave the leader waiting on a collective)."""
        if self.backend == "mp":
            for rank, process in enumerate(self._handles, start=1):
                if not process.is_alive():
                    raise TensorParallelError(f"tensor-parallel rank {rank} exited (exit code {process.exitcode})")
            return
        import ray  # noqa: PLC0415

        done, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
        for ref in done:
            rank = self._refs.index(ref) + 1
            try:
                ray.get(ref)
            except Exception as error:  # noqa: BLE001 - reported as the rank's failure
                raise TensorParallelError(f"tensor-parallel rank {rank} (a Ray actor) failed: {error}") from error
            raise TensorParallelError(f"tensor-parallel rank {rank} (a Ray actor) stopped")

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Waits for the followers to leave (after the leader told them to stop); kills what is left."""
        if self.backend == "mp":
            for process in self._handles:
                process.join(timeout_s)
                if process.is_alive():
                    logger.warning("tensor-parallel follower pid %d did not stop: killed", process.pid)
                    process.kill()
                    process.join(5)
            return
        import ray  # noqa: PLC0415

        ray.wait(self._refs, num_returns=len(self._refs), timeout=timeout_s)
        for actor in self._handles:
            ray.kill(actor)
        if self._owns_ray:
            ray.shutdown()


def check_launch_options(backend: str, timeout_s: float) -> None:
    """ValueError naming ``distributed_executor_backend`` or ``distributed_timeout`` for a value that cannot work."""
    if backend not in BACKENDS:
        raise ValueError(f"distributed_executor_backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise ValueError(f"distributed_timeout must be a positive number of seconds, got {timeout_s!r}")


def launch_workers(backend: str, group: GroupAddress, target: Callable, *args) -> Executor:
    """Starts ranks ``1 .. group.size - 1``, each running ``target(rank, group, *args)`` (a module-level function:
    it is pickled); the caller is rank 0 and must then join the group too."""
    check_launch_options(backend, group.timeout_s)
    if backend == "mp":
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch or thread state
        processes = []
        for rank in range(1, group.size):
            process = context.Process(target=target, args=(rank, group, *args),
                                      name=f"paged-hf-tp-rank{rank}", daemon=True)
            process.start()
            processes.append(process)
        return Executor("mp", processes)
    try:
        import ray  # noqa: PLC0415
    except ImportError:
        raise ValueError(
            "distributed_executor_backend='ray' needs Ray: pip install ray (or use the default 'mp')"
        ) from None
    owns_ray = not ray.is_initialized()  # else: the caller's cluster (ray.init(address=...)) places the actors
    if owns_ray:
        ray.init(include_dashboard=False, log_to_driver=False)
    remote = ray.remote(num_gpus=1 if group.backend == "nccl" else 0)(_RayFollower)
    actors = [remote.remote() for _ in range(1, group.size)]
    refs = [actor.run.remote(target, rank, group, *args) for rank, actor in enumerate(actors, start=1)]
    return Executor("ray", actors, refs, owns_ray)


class _RayFollower:
    """A Ray actor running one follower rank (Ray places it: locally here, across machines on a cluster)."""

    def run(self, target: Callable, rank: int, group: GroupAddress, *args) -> None:
        target(rank, group, *args)
