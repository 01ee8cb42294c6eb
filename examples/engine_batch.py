"""A loop of ``model.generate`` calls over a list of prompts, moved onto ``PagedEngine`` (continuous batching).

    python examples/engine_batch.py                    # stories260K from ../shared/models/
    python examples/engine_batch.py --model PATH_OR_NAME --max-new-tokens 32

``before()`` is the script as people write it: one ``generate`` call per prompt (or per padded batch). ``after()``
is the same job on ``PagedEngine``: the prompts go in together, each with its own ``SamplingParams``, and the
engine batches them step by step, admitting and retiring sequences as they go. Lines marked ``CHANGED`` are the
only ones that differ. Greedy decoding, so both must print the same text; the script checks that they do.
For speed on a mixed workload see ``benchmarks/throughput.py``.
"""

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from paged_hf import PagedEngine, SamplingParams  # CHANGED: the engine and its per-request sampling parameters

# The repository's sibling folder ../shared/models/stories260K (a 260K-parameter Llama trained on TinyStories).
DEFAULT_MODEL = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "stories260K"
PROMPTS = [
    "Once upon a time",
    "The little dog saw a big red ball",
    "Lily and Tom went to the park",
    "One day, a cat named Tim",
    "The sun was hot and the birds",
    "Mom said to Ben",
]


def before(model, tokenizer, prompts, max_new_tokens):
    """The original loop: one ``generate`` per prompt."""
    texts = []
    for prompt in prompts:
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        texts.append(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    return texts


def after(model, tokenizer, prompts, max_new_tokens):
    """The same job on ``PagedEngine``."""
    engine = PagedEngine(model, tokenizer, block_size=16, max_num_seqs=64)  # CHANGED: wraps the model (attention -> "paged")
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0)  # CHANGED: generate's kwargs -> SamplingParams (0 = greedy)
    outputs = engine.generate(prompts, params, use_tqdm=False)  # CHANGED: all prompts in one call, batched continuously
    return [out.outputs[0].text for out in outputs]  # CHANGED: text comes back decoded, in prompt order


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="model folder or hub name (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    if args.model == str(DEFAULT_MODEL) and not DEFAULT_MODEL.is_dir():
        print(f"error: the default model folder {DEFAULT_MODEL} does not exist (it lives in ../shared/models/ next "
              f"to the repository); pass --model with a local folder or a hub name of a causal language model",
              file=sys.stderr)
        return 2

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").eval()

    reference = before(model, tokenizer, PROMPTS, args.max_new_tokens)
    texts = after(model, tokenizer, PROMPTS, args.max_new_tokens)
    model.set_attn_implementation("sdpa")  # the engine switched the model to "paged"; give it back

    for prompt, text in zip(PROMPTS, texts):
        print(f"{prompt!r} -> {text!r}")
    mismatches = [i for i, (a, b) in enumerate(zip(reference, texts)) if a != b]
    for i in mismatches:
        print(f"MISMATCH on prompt {i}:\n  generate: {reference[i]!r}\n  engine:   {texts[i]!r}", file=sys.stderr)
    if mismatches:
        return 1
    print(f"identical text from the generate loop and PagedEngine ({len(PROMPTS)} prompts, greedy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
