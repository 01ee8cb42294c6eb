"""The tensor-parallel group a sharded model runs in, and the few collectives the engine needs."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0  # a collective that waits longer means a rank died: the engine reports it


class TensorParallelError(RuntimeError):
    """The tensor-parallel group is broken (a rank died, or a collective failed or timed out): no forward can run
    any more on this engine."""


@dataclass(frozen=True)
class TensorParallelGroup:
    """``rank`` of ``size`` in the default process group; rank 0 leads."""

    rank: int
    size: int

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def broadcast(self, message=None):
        """The leader's ``message`` on every rank (pickled; tensors travel on the CPU). ``TensorParallelError`` if
        the group is broken."""
        box = [message if self.is_leader else None]
        try:
            dist.broadcast_object_list(box, src=0)
        except (dist.DistError, RuntimeError) as error:
            raise TensorParallelError(f"tensor-parallel broadcast failed on rank {self.rank}: {error}") from error
        return box[0]

    def min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (every rank must size its pool alike)."""
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        tensor = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())


def tensor_parallel_group(model) -> TensorParallelGroup | None:
    """The group ``model`` is sharded over (transformers' ``model.tp_size``), or None for a model on one process."""
    size = getattr(model, "tp_size", None) or 1
    if size <= 1:
        return None
    if not dist.is_initialized():
        raise RuntimeError(f"{type(model).__name__} has tp_size={size} but no torch.distributed process group exists")
    return TensorParallelGroup(dist.get_rank(), size)


def check_tensor_parallel(config, tensor_parallel_size: int, model_class: str = "the model") -> None:
    """ValueError before any process-group work: a size that does not divide the KV (and query) heads, or a model
    whose config has no tensor-parallel plan."""
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
    if tensor_parallel_size == 1:
        return
    text = config.get_text_config(decoder=True)
    # each layer's own where the config sets them per layer (Gemma 4's full layers have fewer KV heads)
    layers = text.per_layer_config if getattr(text, "is_heterogeneous", False) else [text]
    kv_heads = {getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads for layer in layers}
    query_heads = {layer.num_attention_heads for layer in layers}
    for name, heads in [*(("num_key_value_heads", n) for n in sorted(kv_heads)),
                        *(("num_attention_heads", n) for n in sorted(query_heads))]:
        if heads % tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} does not divide the model's {name}={heads}: each rank "
                f"must hold whole heads"
            )
    if not getattr(text, "base_model_tp_plan", None):
        raise ValueError(
            f"{model_class} ({text.model_type}) has no tensor-parallel plan in its config (base_model_tp_plan), so "
            f"transformers cannot shard it: tensor_parallel_size must be 1"
        )


def listen(address: str, size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store for a group of ``size`` ranks, listening on a free port of ``address`` (``store.port``) from
    now on: the followers start after it, so nothing started in between (Ray's local instance binds ports of its own)
    can take the port, as a port probed free and bound later could lose it (``EADDRINUSE``)."""
    return dist.TCPStore(address, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


# What init_group sets for transformers' tensor-parallel loading (it reads the rank and world size from them), and
# leave_group gives back: a process that ran a tensor-parallel engine and then starts torchrun must not hand its
# children a port its own (destroyed) group once listened on.
_GROUP_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_env_before: dict[str, str | None] = {}


def init_group(rank: int, size: int, address: str, port: int, backend: str, timeout_s: float,
               store: dist.TCPStore | None = None) -> None:
    """Joins the default process group (every rank calls it with the same address, port, size and backend; rank 0
    with the store ``listen`` made, the others connect to it). No rank waits in the store's own count of its
    clients (rank 0's store was made before any follower started): the process group's rendezvous is the wait."""
    _env_before.clear()
    _env_before.update({name: os.environ.get(name) for name in _GROUP_ENV})
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if store is None:
        store = dist.TCPStore(address, port, size, False, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s),
                            store=store)


def leave_group() -> None:
    """Destroys the default process group and restores the variables ``init_group`` set (unset where they were)."""
    dist.destroy_process_group()
    for name, value in _env_before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _env_before.clear()
