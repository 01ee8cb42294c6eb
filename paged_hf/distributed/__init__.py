"""Tensor parallelism for the engine: the process group of a sharded model, and launching its ranks.

transformers splits a model's attention heads (and so its KV heads) across the ranks of a tensor-parallel group
(``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))``). Every rank runs every forward on its
shard; rank 0 (the leader) owns the requests, the scheduler and sampling, and before each forward broadcasts the
step's inputs (token ids, the attention metadata, block copies) to the others (followers).
"""

from .group import TensorParallelGroup, check_tensor_parallel, tensor_parallel_group
from .launch import Executor, launch_workers

__all__ = ["Executor", "TensorParallelGroup", "check_tensor_parallel", "launch_workers", "tensor_parallel_group"]
