"""A script written for vLLM's offline API, running on paged_hf: the import is the only changed line (CHANGED).

    python examples/vllm_offline.py                      # stories260K from ../shared/models/
    python examples/vllm_offline.py --model PATH         # a model folder, a .gguf file or a hub name

It completes a few prompts greedily and with seeded sampling, then answers a chat, as a vLLM user would write it.
"""

import argparse
from pathlib import Path

from paged_hf import LLM, SamplingParams  # CHANGED: was `from vllm import LLM, SamplingParams`

DEFAULT_MODEL = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "stories260K"
PROMPTS = [
    "Once upon a time",
    "The little dog saw a big red ball",
    "Lily and Tom went to the park",
]
# stories260K has no chat template of its own: this one just joins the messages
PLAIN_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    llm = LLM(model=args.model, dtype="float32", max_num_seqs=16, enable_prefix_caching=True)
    runs = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
        "sampled": SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=args.max_tokens),
    }
    for name, params in runs.items():
        for output in llm.generate(PROMPTS, params, use_tqdm=False):
            completion = output.outputs[0]
            print(f"[{name}] {output.prompt!r} -> {completion.text!r} ({len(completion.token_ids)} tokens, "
                  f"{completion.finish_reason})")

    tokenizer = llm.get_tokenizer()
    template = None if tokenizer.chat_template else PLAIN_TEMPLATE
    conversation = [{"role": "user", "content": "Once upon a time, there was a cat named"}]
    (answer,) = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                         chat_template=template, use_tqdm=False)
    print(f"[chat] {answer.outputs[0].text!r}")
    stats = llm.get_stats()
    print(f"model {stats['model_memory_gib'] * 1024:.2f} MiB, KV pool {stats['kv_cache_memory_gib'] * 1024:.2f} MiB "
          f"on {stats['device']}, {stats['generated_tokens']} tokens generated")


if __name__ == "__main__":
    main()
