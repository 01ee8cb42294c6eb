"""Run under ``torchrun --nproc-per-node N`` (or plainly): structured outputs on the engine, every rank calling
``generate`` (rank 0 leads and masks the logits, the others only run the forward); prints rank 0's outputs.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed/tp_structured.py DIR TOKENIZER
"""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers
from transformers import DistributedConfig

from paged_hf import PagedEngine, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


def main(folder: str, tokenizer_path: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    extra = {"distributed_config": DistributedConfig(tp_size=world)} if world > 1 else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="paged", **extra)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=64)
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=spec),
              SamplingParams(max_tokens=60, temperature=1.0, seed=3, n=2, structured_outputs=spec),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]
    outs = engine.generate(["Once upon a time", "The cat", "Tom went"], params, use_tqdm=False)
    if int(os.environ.get("RANK", "0")) == 0:
        result = {"outputs": [[(c.text, c.token_ids, c.finish_reason) for c in o.outputs] for o in outs],
                  "tp": engine.get_stats().tensor_parallel_size, "used_after": engine.get_stats().kv_cache_used}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    try:
        main(sys.argv[1], sys.argv[2])
    finally:  # a gloo group left to the interpreter's exit can abort it ("terminate called without an active exception")
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
