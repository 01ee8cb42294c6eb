"""Run under ``torchrun --nproc-per-node N`` (or plainly): the engine on a paged cache, every rank calling
``generate`` (rank 0 leads, the others follow); prints rank 0's tokens as one JSON line.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed/tp_engine.py DIR [SETUP ...]

SETUPs: names of ``SETUPS`` to run (default: all of them).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers
from transformers import DistributedConfig

from paged_hf import PagedEngine, SamplingParams

SETUPS = {  # name -> engine options
    "prefix_hits": dict(block_size=4, max_num_batched_tokens=16),
    "recompute": dict(block_size=4, num_blocks=18, preemption_mode="recompute", enable_prefix_caching=False),
    "swap": dict(block_size=4, num_blocks=18, preemption_mode="swap", swap_space=0.001, enable_prefix_caching=False),
    # int4 keeps each sequence's newest partial block in a full-precision tail row: rows, tail copies, tail swaps
    "int4_swap": dict(block_size=4, num_blocks=18, preemption_mode="swap", swap_space=0.001,
                      kv_cache_dtype="int4"),
}


def prompts() -> list[list[int]]:
    shared = [1] + [(5 * i) % 500 + 3 for i in range(12)]  # three blocks every prompt shares
    return [shared + [(7 * i + j) % 500 + 3 for j in range(3 + 2 * i)] for i in range(6)]


def aborts(model) -> dict:
    """The leader adds requests, steps, aborts one mid-decode and runs the rest out; followers follow until the
    leader's shutdown. The survivors' tokens, and the blocks left in use (none)."""
    engine = PagedEngine(model, None, block_size=4, num_blocks=40)
    if engine.group is not None and not engine.group.is_leader:
        engine.follow()
        return {}
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt, greedy) for prompt in prompts()[:4]]
    for _ in range(4):
        engine.step()
    engine.abort(ids[1])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    used = engine.get_stats().kv_cache_used
    engine.shutdown()
    return {"tokens": [finished.get(i) for i in ids], "used_after": used}


def main(folder: str, setups: list[str]) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    extra = {"distributed_config": DistributedConfig(tp_size=world)} if world > 1 else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="paged", **extra)
    results = {}
    for name in setups or SETUPS:
        options = SETUPS[name]
        engine = PagedEngine(model, None, **options)
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True, logprobs=2)
        outs = engine.generate(prompts(), [greedy, seeded] * 3, use_tqdm=False)
        stats = engine.get_stats()
        results[name] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                         for o in outs[1::2]],
            "tp": stats.tensor_parallel_size, "preemptions": stats.preemption_count,
            "swapped": stats.num_swapped_out, "hit_rate": stats.prefix_cache_hit_rate,
            "used_after": stats.kv_cache_used,
        }
    results["abort"] = aborts(model)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    try:
        main(sys.argv[1], sys.argv[2:])
    finally:  # a gloo group left to the interpreter's exit can abort it ("terminate called without an active exception")
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
