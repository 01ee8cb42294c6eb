"""Quality of the quantized KV formats on real models and real English text: perplexity and greedy agreement.

For each model and ``kv_cache_dtype`` in ("auto", "int8", "fp8", "fp8_e5m2", "int4"), with
``attn_implementation="paged"`` (the attention reads the quantized blocks and dequantizes them):

1. Perplexity. Each text is one token stream fed through a ``PagedCache`` in ``--chunk``-token chunks, so every
   chunk attends to the past as stored in the cache (quantized; a chunk's own K/V are written before the chunk
   attends, so they are quantized too). The NLL of every next token comes from the chunk logits; the first token
   of a chunk is predicted by the previous chunk's last logits. PPL = exp(mean NLL). A stream longer than
   ``--window`` tokens (default: the model's ``max_position_embeddings``, at most 1024) is cut into windows, each
   fed through a fresh cache; the first token of a window is not predicted.
   Texts: ``../shared/data/tinystories_sample.txt`` (five TinyStories stories; the ``<|endoftext|>`` lines
   between them become the model's document separator: its ``<|endoftext|>`` token where it has one, else BOS),
   and, as a second real English text, the prose of the CPython licence file that ships with the running
   interpreter (``<stdlib>/LICENSE.txt``: the history of Python and the licence terms; the release table and the
   ``====`` underlines are dropped).
   ΔPPL % is against "auto" (the model dtype, float32). "±" is twice the standard error of the mean per-token NLL
   difference to "auto" (paired, tokens taken as independent), shown in PPL %: a rough noise scale.
2. Greedy agreement. ``--prompts`` English prompts (sentence openings from the TinyStories sample, then short
   openings written for this benchmark), left-padded in batches of ``--batch``, each continued for exactly
   ``--new-tokens`` greedy tokens (EOS suppressed) with ``cache_implementation="paged"``. Reported: the fraction
   of continuations identical to "auto" and the mean fraction of tokens that match before the first divergence.

Torch runs on one thread by default (``--threads``): on the shared 2-core machine two threads ran about 15x
slower than one while other jobs were busy.

Bytes per token per layer come from ``PagedCache.stats()`` (K and V, scales and zero points included); the ratio
is against float16 K/V (``2 * 2 * kv_heads * head_dim`` bytes).

    PYTHONPATH=. python benchmarks/kv_quality.py                          # SmolLM2-135M and stories260K
    PYTHONPATH=. python benchmarks/kv_quality.py --models stories --prompts 16
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import paged_hf

from _common import ModelUnavailable, STORIES_TEXT, load_model, machine, markdown_table

FORMATS = ("auto", "int8", "fp8", "fp8_e5m2", "int4")
MODELS = {"smollm2": "smollm2", "stories": "stories260K", "stories260K": "stories260K"}
DOC_MARKER = "<|endoftext|>"
# kv_cache_dtype -> (max ΔPPL % on every text, min bytes ratio vs fp16 or None). The fp8 goal is stated for "fp8"
# (e4m3); fp8_e5m2 has no goal. The ratio goals assume head_dim 64 (stories260K, head_dim 8, cannot reach them).
GOALS = {"int8": (0.3, 1.9), "fp8": (1.0, None), "int4": (3.0, 3.5)}

# Short English openings for the greedy prompts, written for this benchmark.
OPENINGS = [
    "The old lighthouse keeper climbed the stairs every evening",
    "When the rain finally stopped, the children ran outside",
    "My grandmother kept a small garden behind her house, and",
    "The train to the city was late again, so",
    "Scientists have long wondered why some birds",
    "In the middle of the forest there was a quiet lake where",
    "The best way to learn a new language is",
    "After school, Sam and his sister walked to the park",
    "The baker woke up before sunrise to",
    "It was the coldest winter anyone in the village could remember.",
    "A good friend is someone who",
    "The museum opened a new exhibit about the ocean, and",
    "On the first day of summer, the family packed the car and",
    "The little robot looked at the broken vase and",
    "Every morning the farmer fed the chickens and",
    "The history of the bicycle begins in the early nineteenth century, when",
    "Mia found an old map in the attic. It showed",
    "The teacher asked the class to write a story about",
    "Clouds gathered over the hills as the shepherd",
    "To make a cup of tea, first",
    "The city library is the oldest building on the street, and",
    "Tom wanted a puppy more than anything, but his parents said",
    "The moon was full and bright that night, so",
    "Learning to ride a bike takes patience because",
]


# ----------------------------------------------------------------------------------------------------- texts
def licence_text() -> tuple[str, str]:
    """The prose of CPython's LICENSE.txt (release table and underlines dropped) and its path."""
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is absent")
    kept = []
    for line in path.read_text().splitlines():
        if re.fullmatch(r"\s*[=-]{3,}\s*", line):  # section underlines
            continue
        if re.search(r"\S\s{3,}\S", line):  # the columns of the release table
            continue
        kept.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip() + "\n", str(path)


def token_stream(tokenizer, text: str) -> list[int]:
    """Token ids of ``text``: the tokenizer's own leading special tokens (e.g. BOS), then the documents of ``text``
    (split at ``<|endoftext|>`` lines), joined by the model's document separator."""
    prefix = tokenizer("", add_special_tokens=True)["input_ids"]
    separator = tokenizer.convert_tokens_to_ids(DOC_MARKER)
    if separator is None or separator == tokenizer.unk_token_id:
        separator = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    ids = list(prefix)
    docs = [d.strip() for d in text.split(DOC_MARKER) if d.strip()]
    for i, doc in enumerate(docs):
        if i:
            ids.append(separator)
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
    return ids


def windows(ids: list[int], size: int, prefix: list[int]) -> list[list[int]]:
    """``ids`` cut into windows of at most ``size`` tokens; windows after the first start with ``prefix``."""
    out, body = [ids[:size]], ids[size:]
    step = size - len(prefix)
    while body:
        out.append(list(prefix) + body[:step])
        body = body[step:]
    return [w for w in out if len(w) >= 2]


def sample_prompts(count: int) -> list[str]:
    """Sentence openings (up to 10 words) from the TinyStories sample, evenly spread, then ``OPENINGS``."""
    story = []
    if STORIES_TEXT.is_file():
        text = STORIES_TEXT.read_text().replace(DOC_MARKER, " ")
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
            words = sentence.split()
            if len(words) >= 6 and words[0][0].isalpha():
                story.append(" ".join(words[: min(10, len(words) - 2)]))
    else:
        print(f"note: {STORIES_TEXT} is absent; all prompts come from the built-in openings")
    want_story = min(len(story), max(count - len(OPENINGS), count // 2))
    stride = len(story) / want_story if want_story else 1
    picked = [story[int(i * stride)] for i in range(want_story)]
    picked += OPENINGS[: count - len(picked)]
    if len(picked) < count:
        raise SystemExit(f"--prompts {count}: only {len(picked)} prompts are available")
    return picked


# ---------------------------------------------------------------------------------------------- measurements
@dataclass
class Perplexity:
    nll: torch.Tensor  # per predicted token, float64
    seconds: float

    @property
    def ppl(self) -> float:
        return math.exp(self.nll.mean().item())


@torch.no_grad()
def chunked_nll(model, window_list: list[list[int]], fmt: str, chunk: int) -> Perplexity:
    """Per-token NLL of every window fed through a fresh ``PagedCache(kv_cache_dtype=fmt)`` chunk by chunk."""
    start = time.perf_counter()
    nlls = []
    for ids in window_list:
        cache = paged_hf.PagedCache(model.config, block_size=16, kv_cache_dtype=fmt)
        tokens = torch.tensor(ids, dtype=torch.long)
        previous_last = None  # log-probs of the previous chunk's last position
        for begin in range(0, len(ids), chunk):
            piece = tokens[begin : begin + chunk]
            logits = model(input_ids=piece[None], cache=cache, use_cache=True).logits[0]
            logprobs = torch.log_softmax(logits.double(), dim=-1)
            if previous_last is not None:
                nlls.append(-previous_last[piece[0]].reshape(1))
            if len(piece) > 1:
                nlls.append(-logprobs[:-1].gather(1, piece[1:, None]).squeeze(1))
            previous_last = logprobs[-1]
        if cache.seq_length != len(ids):
            raise RuntimeError(f"the cache holds {cache.seq_length} tokens after feeding {len(ids)}")
    return Perplexity(torch.cat(nlls), time.perf_counter() - start)


@torch.no_grad()
def full_forward_ppl(model, window_list: list[list[int]]) -> float:
    """PPL of one cache-less forward per window (dense fallback of the paged attention): checks the baseline."""
    nlls = []
    for ids in window_list:
        tokens = torch.tensor(ids, dtype=torch.long)
        logits = model(input_ids=tokens[None], use_cache=False).logits[0]
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        nlls.append(-logprobs[:-1].gather(1, tokens[1:, None]).squeeze(1))
    return math.exp(torch.cat(nlls).mean().item())


@torch.no_grad()
def greedy(model, tokenizer, prompts: list[str], fmt: str, batch: int, new_tokens: int) -> tuple[torch.Tensor, float]:
    """``[len(prompts), new_tokens]`` greedy continuations with the paged cache in ``fmt``, and the seconds taken."""
    start = time.perf_counter()
    rows = []
    for begin in range(0, len(prompts), batch):
        enc = tokenizer(prompts[begin : begin + batch], return_tensors="pt", padding=True)
        out = model.generate(
            **enc, cache_implementation="paged", cache_config={"kv_cache_dtype": fmt}, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
        )
        rows.append(out[:, enc["input_ids"].shape[1] :])
    return torch.cat(rows), time.perf_counter() - start


def agreement(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(fraction of rows identical to ``reference``, mean fraction of tokens before the first mismatch)."""
    same = reference == other
    prefix = torch.cumprod(same.int(), dim=1).sum(dim=1).float() / reference.shape[1]
    return same.all(dim=1).float().mean().item(), prefix.mean().item()


# ------------------------------------------------------------------------------------------------ reporting
@dataclass
class FormatResult:
    fmt: str
    bytes_per_token: int
    ppl: dict[str, Perplexity] = field(default_factory=dict)
    identical: float = 1.0
    prefix: float = 1.0


def delta(result: FormatResult, base: FormatResult, text: str) -> tuple[float, float]:
    """(ΔPPL % vs base, twice the paired standard error of the mean NLL difference, in PPL %)."""
    diff = result.ppl[text].nll - base.ppl[text].nll
    pct = (math.exp(diff.mean().item()) - 1) * 100
    se = diff.std().item() / math.sqrt(len(diff)) if len(diff) > 1 else 0.0
    return pct, (math.exp(2 * se) - 1) * 100


def goal_cell(result: FormatResult, base: FormatResult, texts: list[str], ratio: float) -> str:
    if result.fmt not in GOALS:
        return "-"
    max_delta, min_ratio = GOALS[result.fmt]
    wanted = f"< {max_delta}%" + (f", ≥ {min_ratio}×" if min_ratio else "")
    misses = []
    for text in texts:
        pct, _ = delta(result, base, text)
        if pct >= max_delta:
            misses.append(f"{pct:+.2f}% ({text.split()[-1]})")
    if min_ratio and ratio < min_ratio:
        misses.append(f"{ratio:.2f}×")
    return f"{wanted}: " + ("met" if not misses else "missed: " + ", ".join(misses))


def run_model(name: str, args, texts: dict[str, str]) -> None:
    print(f"\n### {name}\n", flush=True)
    started = time.perf_counter()
    try:
        model, tokenizer = load_model(name, attn_implementation="paged")
    except ModelUnavailable as reason:
        print(f"skipped: {reason}")
        return
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    fp16_bytes = 2 * 2 * kv_heads * head_dim
    window = args.window or min(getattr(cfg, "max_position_embeddings", 1024) or 1024, 1024)
    print(
        f"{cfg.num_hidden_layers} layers, {kv_heads} KV heads, head_dim {head_dim}, model dtype {model.dtype}; "
        f"loaded in {time.perf_counter() - started:.0f} s; window {window} tokens, chunk {args.chunk}"
    )
    prefix = tokenizer("", add_special_tokens=True)["input_ids"]
    text_windows = {}
    for label, text in texts.items():
        ids = token_stream(tokenizer, text)
        text_windows[label] = windows(ids, window, prefix)
        predicted = sum(len(w) - 1 for w in text_windows[label])
        print(f"{label}: {len(ids)} tokens, {len(text_windows[label])} window(s), {predicted} predicted tokens")

    results = []
    for fmt in args.formats:
        cache = paged_hf.PagedCache(model.config, block_size=16, kv_cache_dtype=fmt)
        result = FormatResult(fmt, cache.stats().bytes_per_token // model.config.num_hidden_layers)
        for label, wins in text_windows.items():
            result.ppl[label] = chunked_nll(model, wins, fmt, args.chunk)
            print(f"  {fmt:9s} {label}: PPL {result.ppl[label].ppl:.4f} ({result.ppl[label].seconds:.0f} s)", flush=True)
        results.append(result)
    base = results[0]
    for label, wins in text_windows.items():
        reference = full_forward_ppl(model, wins)
        print(f"  check: {label} PPL with one cache-less forward per window {reference:.4f} "
              f"(chunked '{base.fmt}': {base.ppl[label].ppl:.4f})")

    prompts = sample_prompts(args.prompts)
    outputs = {}
    for result in results:
        outputs[result.fmt], seconds = greedy(model, tokenizer, prompts, result.fmt, args.batch, args.new_tokens)
        result.identical, result.prefix = agreement(outputs[base.fmt], outputs[result.fmt])
        print(f"  {result.fmt:9s} greedy: {result.identical:.0%} identical ({seconds:.0f} s)", flush=True)

    labels = list(texts)
    headers = [
        "kv_cache_dtype", "bytes/token/layer", "vs fp16",
        *(f"ΔPPL % ({label})" for label in labels),
        f"greedy identical ({len(prompts)} × {args.new_tokens} tok)", "tokens before 1st divergence", "goal",
    ]
    rows = []
    for result in results:
        ratio = fp16_bytes / result.bytes_per_token
        cells = [result.fmt, result.bytes_per_token, f"{ratio:.2f}×"]
        for label in labels:
            if result is base:
                cells.append(f"PPL {base.ppl[label].ppl:.3f}")
            else:
                pct, noise = delta(result, base, label)
                cells.append(f"{pct:+.3f} ± {noise:.3f}")
        count = round(result.identical * len(prompts))
        cells += [f"{count}/{len(prompts)} ({result.identical:.0%})", f"{result.prefix:.1%}",
                  goal_cell(result, base, labels, ratio)]
        rows.append(cells)
    print(f"\n{name}: {cfg.num_hidden_layers} layers, {kv_heads} KV heads × head_dim {head_dim}; fp16 K+V = "
          f"{fp16_bytes} bytes/token/layer; 'auto' is the model dtype ({model.dtype}), its row gives the baseline "
          f"PPL. Total {time.perf_counter() - started:.0f} s.\n")
    print(markdown_table(headers, rows), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,stories", help="comma-separated: smollm2, stories")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated kv_cache_dtype values; "
                        "the first is the baseline")
    parser.add_argument("--prompts", type=int, default=32, help="greedy prompts (default 32)")
    parser.add_argument("--batch", type=int, default=16, help="prompts per left-padded generate batch")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--chunk", type=int, default=32, help="tokens per forward in the perplexity runs")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared, loaded machine 2 threads ran 15x slower)")
    parser.add_argument("--window", type=int, default=0,
                        help="max tokens per perplexity window (default: max_position_embeddings, at most 1024)")
    args = parser.parse_args(argv)
    names = []
    for name in args.models.split(","):
        if name.strip() not in MODELS:
            parser.error(f"unknown model {name!r}; choose from smollm2, stories")
        names.append(MODELS[name.strip()])
    args.formats = [f.strip() for f in args.formats.split(",")]
    if args.chunk < 1 or args.prompts < 1 or args.batch < 1 or args.new_tokens < 1:
        parser.error("--chunk, --prompts, --batch and --new-tokens must be positive")

    texts = {}
    if STORIES_TEXT.is_file():
        texts["TinyStories sample"] = STORIES_TEXT.read_text()
    else:
        print(f"note: {STORIES_TEXT} is absent; perplexity on the TinyStories sample skipped")
    try:
        licence, licence_path = licence_text()
        texts["CPython LICENSE.txt"] = licence
        print(f"second text: prose of {licence_path} ({len(licence.split())} words)")
    except FileNotFoundError as reason:
        print(f"note: {reason}; perplexity on the second text skipped")

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"machine: {machine()}")
    print(f"command: PYTHONPATH=. python benchmarks/kv_quality.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    for name in names:
        run_model(name, args, texts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
