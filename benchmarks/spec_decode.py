"""Speculative decoding (n-gram prompt lookup, or a draft model): generated tokens/s of ``PagedEngine`` with and
without it.

Two workloads over the TinyStories sample, greedy, EOS ignored so both engines generate the same number of tokens:

- ``repeat``: a prompt that asks for text it already holds. stories260K is given a story and then the story's first
  words again (it continues by copying, as far as it can); SmolLM2-135M-Instruct is asked in its chat template to
  repeat the story word for word. Prompt lookup finds the continuation in the prompt.
- ``fresh``: story openings only, nothing to look up: speculation must switch itself off (its acceptance gate) and
  cost at most 5%.

Each row runs the same requests on two engines built alike (one with ``speculative_config``), at batch 1 (the
requests one after another) and at batch ``B`` (all at once), and checks that their greedy tokens are identical.
Each engine gets a warm-up call first; the engines take turns request group by request group; each timing is the
best of ``--repeats``. On a shared machine the ratio of CPU seconds (this process, one thread) is the steadier one,
and the goals are judged on it. ``--method draft_model`` proposes with a draft model (``--draft``, by default the
target itself loaded again: acceptance near 1, so the row measures what the draft's ``k`` forwards a step cost
against the target forwards they save); ``--draft-dtype bfloat16`` loads it in bfloat16 and ``--draft-dtype int8``
quantizes its linears to int8 (torch's dynamic quantization: int8 weights, activations quantized per call), the
target's own weights made cheaper per forward; ``--draft-layers N`` cuts it after its first ``N`` decoder layers
(``early_exit_draft``: the target's layers, norm and head, shared). The goals are the n-gram method's and are not
judged for drafts.

    PYTHONPATH=. python benchmarks/spec_decode.py                              # stories260K, batches 1 and 16
    PYTHONPATH=. python benchmarks/spec_decode.py --model smollm2 --requests 4 --max-tokens 64
    PYTHONPATH=. python benchmarks/spec_decode.py --method draft_model --requests 4 --batches 1,4
    PYTHONPATH=. python benchmarks/spec_decode.py --model smollm2 --method draft_model --draft-dtype int8 --k 2
    PYTHONPATH=. python benchmarks/spec_decode.py --model smollm2 --method draft_model --draft-layers 24
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

import paged_hf  # noqa: F401 - registers the "paged" attention
from paged_hf import PagedEngine, SamplingParams
from paged_hf.engine.spec import early_exit_draft

from _common import STORIES_TEXT, ModelUnavailable, load_model, machine, markdown_table

GOAL_BATCH_1 = 1.5
GOAL_BATCHED = 1.2
GOAL_FRESH = 0.95


def stories(count: int) -> list[str]:
    if not STORIES_TEXT.is_file():
        raise ModelUnavailable(f"{STORIES_TEXT} is absent")
    texts = [s.strip() for s in STORIES_TEXT.read_text().split("<|endoftext|>") if s.strip()]
    return [texts[i % len(texts)] for i in range(count)]


def prompts_for(workload: str, model_name: str, tokenizer, count: int, story_chars: int) -> list[list[int]]:
    texts = [s[:story_chars] for s in stories(count)]
    if workload == "fresh":
        return [tokenizer(s.split(".")[0] + ".")["input_ids"] for s in texts]
    if model_name == "smollm2":
        return [tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Repeat the following text word for word.\n\n{s}"}],
            add_generation_prompt=True, tokenize=True, return_dict=False) for s in texts]
    return [tokenizer(f"{s} {s[:40]}")["input_ids"] for s in texts]


def quantized_int8(model):
    """``model`` with every ``nn.Linear`` dynamically quantized to int8 (fbgemm's int8 GEMMs on x86: several times
    faster per token than float32 on a CPU); torch.ao's API, deprecated in favour of torchao, silenced here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def timed(engines: tuple[PagedEngine, PagedEngine], prompts: list[list[int]], params: SamplingParams, batch: int,
          repeats: int):
    """Per engine: (wall seconds, CPU seconds, outputs) of the prompts in groups of ``batch``, each group run to
    completion. The two engines take turns group by group (the order flips each group), so that a change in the
    machine's load falls on both; the times are the best of ``repeats``."""
    best = [[float("inf"), float("inf")] for _ in engines]
    outputs: list[list] = [[] for _ in engines]
    for _ in range(repeats):
        wall, cpu = [0.0, 0.0], [0.0, 0.0]
        outputs = [[] for _ in engines]
        for group, first in enumerate(range(0, len(prompts), batch)):
            for e in ((0, 1) if group % 2 == 0 else (1, 0)):
                start, start_cpu = time.perf_counter(), time.process_time()
                outputs[e] += engines[e].generate(prompts[first : first + batch], params, use_tqdm=False)
                wall[e] += time.perf_counter() - start
                cpu[e] += time.process_time() - start_cpu
        for e in range(len(engines)):
            best[e] = [min(best[e][0], wall[e]), min(best[e][1], cpu[e])]
    return [(w, c, o) for (w, c), o in zip(best, outputs)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="stories260K", choices=["stories260K", "stories", "smollm2"])
    parser.add_argument("--workloads", default="repeat,fresh")
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--requests", type=int, default=16, help="requests per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--story-chars", type=int, default=600, help="characters of each story in the prompts")
    parser.add_argument("--method", default="ngram", choices=["ngram", "draft_model"])
    parser.add_argument("--draft", default=None, choices=["stories260K", "smollm2"],
                        help="draft_model: the draft (default: the target, loaded again)")
    parser.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16", "int8"],
                        help="draft_model: the draft's dtype (default: the target's; int8: its linears dynamically "
                             "quantized)")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="draft_model: the draft cut after its first N decoder layers (early_exit_draft)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--always", action="store_true",
                        help="auto_disable=False: speculate at every step (what the pairing itself costs or saves)")
    parser.add_argument("--lookup", default="4,2", help="prompt_lookup_max,prompt_lookup_min")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="compile the forward (default: eager)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    name = "stories260K" if args.model == "stories" else args.model
    try:
        model, tokenizer = load_model(name)
    except ModelUnavailable as error:
        print(f"skipped {name}: {error}")
        return 0
    lookup_max, lookup_min = (int(v) for v in args.lookup.split(","))
    if args.method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": lookup_max,
                "prompt_lookup_min": lookup_min}
    else:
        draft_name = args.draft or name
        draft = load_model(draft_name)[0]
        if args.draft_dtype == "int8":
            draft = quantized_int8(draft)
        elif args.draft_dtype is not None:
            draft = draft.to(getattr(torch, args.draft_dtype))
        if args.draft_dtype is not None:
            draft_name += f" in {args.draft_dtype}"
        if args.draft_layers is not None:
            draft = early_exit_draft(draft, args.draft_layers)
            draft_name += f", its first {args.draft_layers} layers"
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k}
    if args.always:
        spec["auto_disable"] = False
    options = dict(block_size=16, num_blocks=max(256, args.requests * 64), enforce_eager=not args.compile,
                   cpu_threads_bind="nobind", max_num_seqs=max(int(b) for b in args.batches.split(",")))
    base = PagedEngine(model, tokenizer, **options)
    fast = PagedEngine(model, tokenizer, speculative_config=spec, **options)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    print(f"# speculative decoding, {name}: {machine()}; load average {os.getloadavg()}")
    shown = {**spec, "model": draft_name} if args.method == "draft_model" else spec
    print(f"speculative_config={shown}; {args.requests} requests x {args.max_tokens} tokens per row\n")
    rows, failures = [], []
    judged = args.method == "ngram"
    for workload in args.workloads.split(","):
        prompts = prompts_for(workload, name, tokenizer, args.requests, args.story_chars)
        for batch in (int(b) for b in args.batches.split(",")):
            for engine in (base, fast):
                engine.generate(prompts[:batch], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
            before = fast.get_stats()
            (seconds_base, cpu_base, expected), (seconds_fast, cpu_fast, got) = \
                timed((base, fast), prompts, params, batch, args.repeats)
            after = fast.get_stats()
            same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(expected, got))
            drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
            accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
            tokens = sum(len(o.outputs[0].token_ids) for o in got)
            ratio = seconds_base / seconds_fast
            goal = GOAL_FRESH if workload == "fresh" else GOAL_BATCH_1 if batch == 1 else GOAL_BATCHED
            cpu_ratio = cpu_base / cpu_fast
            rows.append([workload, batch, f"{tokens / seconds_base:.0f}", f"{tokens / seconds_fast:.0f}",
                         f"{ratio:.2f}x", f"{cpu_ratio:.2f}x", f"{goal}x" if judged else "-",
                         ("met" if cpu_ratio >= goal else "NOT met") if judged else "-",
                         f"{accepted / drafted:.2f}" if drafted else "-", f"{drafted / tokens:.2f}",
                         "same tokens" if same else "DIFFERENT"])
            if not same:
                failures.append(f"{workload} batch {batch}: the greedy tokens differ")
    print(markdown_table(["workload", "batch", "tok/s without", "tok/s with", "ratio", "ratio (CPU s)", "goal", "",
                          "acceptance",
                          "drafts / token", "greedy"], rows))
    stats = fast.get_stats()
    print(f"\nacceptance per position (all rows): "
          f"{[round(r, 2) for r in stats['spec_decode_acceptance_rate_per_pos']]}")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
