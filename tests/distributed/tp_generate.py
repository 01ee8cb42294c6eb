"""Run under ``torchrun --nproc-per-node N`` (or plainly, for one process): generate on a paged cache for each
(family, mode) of the model folders given, printing one JSON line of results from rank 0.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/tp_generate.py DIR [DIR ...]
"""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers
from transformers import DistributedConfig

import paged_hf  # noqa: F401 - takes back cache_implementation="paged"

MODES = ("greedy", "beams", "sample")


def run(folder: str, attention: str, mode: str) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    extra = {"distributed_config": DistributedConfig(tp_size=world)} if world > 1 else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attention, **extra)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 0, 0, 11, 12, 13, 14, 15, 16]])
    kwargs = dict(input_ids=ids, attention_mask=(ids > 0).long(), max_new_tokens=10, pad_token_id=0,
                  cache_implementation="paged", cache_config={"block_size": 4, "memory_budget": 1 << 20},
                  return_dict_in_generate=True, output_scores=True)
    if mode == "beams":
        kwargs.update(num_beams=3, do_sample=False)
    elif mode == "sample":
        kwargs.update(do_sample=True, top_k=20)
        torch.manual_seed(7)
    else:
        kwargs.update(do_sample=False)
    out = model.generate(**kwargs)
    cache = out.cache
    heads = {g.index: s.key_cache.shape[2] for g in cache.kv.groups for s in g.storages.values()}
    scores = [] if mode == "sample" else [s[:, :32].tolist() for s in out.scores[:2]]  # a slice is enough
    return {"sequences": out.sequences.tolist(), "scores": scores,
            "stored_kv_heads": sorted(set(heads.values())), "num_blocks": cache.kv.num_total_blocks}


def main(folders: list[str]) -> None:
    results = {}
    for folder in folders:
        for attention in ("paged", "sdpa"):
            for mode in MODES:
                results[f"{os.path.basename(folder)}/{attention}/{mode}"] = run(folder, attention, mode)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    finally:  # a gloo group left to the interpreter's exit can abort it ("terminate called without an active exception")
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
