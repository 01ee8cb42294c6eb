"""The engine under tensor parallelism: starting the ranks, and the leader's messages (``worker`` has the
followers' loop).

Rank 0 (the leader) runs the engine: requests, scheduler, sampling. Before every forward it broadcasts the step's
``StepInput`` (token ids, attention metadata, block copies); each follower runs the same forward on its shard of
the model and KV heads. Messages, in order, on every rank:

- ``("step", StepInput)``: run this forward;
- ``("idle",)``: nothing to run (the leader says so at least every ``IDLE_MESSAGE_EVERY`` of the group's timeout,
  so a follower blocked in the broadcast never hits it while the leader waits for requests);
- ``("done", outputs)``: the leader's ``generate`` returned these outputs (followers that called ``generate`` too,
  as under ``torchrun``, return them);
- ``("stop",)``: leave.

Ranks are started by ``torchrun`` (every rank runs the user's script: followers call ``generate`` or ``follow``), or by
``start_tensor_parallel`` (``PagedEngine.from_pretrained(..., tensor_parallel_size=N)``): the calling process leads
and the followers are local processes ("mp") or Ray actors ("ray").
"""

from __future__ import annotations

import logging
import socket
import time

import torch

from ..distributed import check_tensor_parallel
from ..distributed.group import DEFAULT_TIMEOUT_S, init_group, listen
from ..distributed.launch import GroupAddress, ModelSpec, launch_workers
from .worker import run_follower

logger = logging.getLogger("paged_hf")
IDLE_MESSAGE_EVERY = 0.25  # of the group's timeout


def start_tensor_parallel(model: str, tensor_parallel_size: int, backend: str, model_kwargs: dict,
                          engine_options: dict, timeout_s: float = DEFAULT_TIMEOUT_S):
    """Starts the followers, joins the group as rank 0 and loads this rank's shard: ``(model, executor)``.

    ValueError, before any process starts, for a size that does not divide the heads or a model without a
    tensor-parallel plan."""
    from transformers import AutoConfig  # noqa: PLC0415

    config = AutoConfig.from_pretrained(model, **{k: v for k, v in model_kwargs.items() if k == "gguf_file"})
    check_tensor_parallel(config, tensor_parallel_size, type(config).__name__.replace("Config", ""))
    if torch.distributed.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists: under torchrun, load the model with "
                           "DistributedConfig(tp_size=N) on every rank and build PagedEngine(model) there instead")
    address = "127.0.0.1" if backend == "mp" else socket.gethostbyname(socket.gethostname())
    store = listen(address, tensor_parallel_size, timeout_s)
    group = GroupAddress(address, store.port, tensor_parallel_size,
                         "nccl" if torch.cuda.is_available() else "gloo", timeout_s)
    spec = ModelSpec(model, model_kwargs)
    executor = launch_workers(backend, group, run_follower, spec, engine_options)
    try:
        init_group(0, group.size, group.address, group.port, group.backend, group.timeout_s, store)
        return spec.load(group.size), executor
    except BaseException:
        executor.shutdown(timeout_s=5)
        raise


def keep_alive(runner, timeout_s: float) -> None:
    """The leader, idle: tells the followers so before their broadcast wait nears the group's timeout."""
    if runner.group is not None and time.monotonic() - runner.last_broadcast > IDLE_MESSAGE_EVERY * timeout_s:
        runner.broadcast(("idle",))
