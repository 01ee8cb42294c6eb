"""An ordinary transformers script, moved onto paged_hf's paged KV cache by two changed lines (marked CHANGED).

    python examples/drop_in_generate.py                      # stories260K from ../shared/models/
    python examples/drop_in_generate.py --model PATH_OR_NAME --attn-implementation paged

Everything else is the script as it was: load a model and its tokenizer, tokenize a left-padded batch, call
``model.generate``. ``--compare`` (on by default) runs the same batch once more on transformers' default
cache and checks that greedy decoding chose the same tokens.
"""

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import paged_hf  # noqa: F401  # CHANGED 1/2: registers the "paged" cache (and attention) with transformers

# The repository's sibling folder ../shared/models/stories260K (a 260K-parameter Llama trained on TinyStories).
DEFAULT_MODEL = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "stories260K"
PROMPTS = ["Once upon a time", "The little dog saw a big red ball", "Lily and Tom went to the park"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="model folder or hub name (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument(
        "--attn-implementation",
        default="sdpa",
        help="any attention works with the paged cache; 'paged' reads the KV blocks directly (default: %(default)s)",
    )
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the default cache and check the tokens are identical (default: on)")
    args = parser.parse_args(argv)
    if args.model == str(DEFAULT_MODEL) and not DEFAULT_MODEL.is_dir():
        print(f"error: the default model folder {DEFAULT_MODEL} does not exist; pass --model with a local "
              f"folder (or a hub name) of a causal language model", file=sys.stderr)
        return 2

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=args.attn_implementation)

    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    out = model.generate(
        **inputs,
        max_new_tokens=args.max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        cache_implementation="paged",  # CHANGED 2/2: KV in a block pool instead of a DynamicCache
    )
    for text in tokenizer.batch_decode(out, skip_special_tokens=True):
        print(f"paged:   {text!r}")

    if args.compare:  # not part of the upgrade: the proof that it changed no token
        reference = model.generate(
            **inputs, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        for text in tokenizer.batch_decode(reference, skip_special_tokens=True):
            print(f"default: {text!r}")
        if not torch.equal(out, reference):
            print("MISMATCH: the paged cache produced different tokens than the default cache", file=sys.stderr)
            return 1
        print(f"identical tokens with and without the paged cache ({out.shape[0]} sequences, "
              f"{out.shape[1] - inputs['input_ids'].shape[1]} new tokens each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
