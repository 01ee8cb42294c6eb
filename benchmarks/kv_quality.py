"""KV cache quality and bytes: paged_hf's formats beside transformers' own caches, measured in one run.

Rows (``--rows``, comma-separated; the first is the baseline):

- ``dynamic``: transformers' ``DynamicCache`` with sdpa (the model dtype; the baseline);
- ``auto``, ``int8``, ``fp8``, ``fp8_e5m2``, ``int4``, ``int4/64`` ...: ``PagedCache`` with that ``kv_cache_dtype``
  (``/N``: block size ``N``, default 16) and ``attn_implementation="paged"`` (the attention reads the quantized
  blocks and, for int4, the full-precision tail);
- ``quanto4``, ``quanto4r1``, ``hqq4``, ``hqq8``, ...: transformers' ``QuantizedCache`` with the optimum-quanto or HQQ
  backend (``pip install -e .[bench]``) at its defaults (``q_group_size=64``, ``residual_length=128``; ``r1``:
  ``residual_length=1``), with sdpa.

Measured per row:

1. Perplexity over the first ``--tokens`` tokens (default 768) of each text, fed in ``--chunk``-token chunks (default
   32) that attend to the cache as it stores them; the first token of a chunk is predicted by the previous chunk's
   last logits. Texts: ``../shared/data/tinystories_sample.txt`` (its ``<|endoftext|>`` lines become the model's
   document separator) and the prose of the CPython licence (``<stdlib>/LICENSE.txt``, release table and underlines
   dropped). ΔPPL % against the baseline, "±" twice the paired standard error of the mean NLL difference (tokens
   taken as independent), in PPL %. Also KL(baseline ‖ row) of the next-token distributions, mean over all positions
   (×1e-3): far less noisy than ΔPPL, which int4 code flips (a last-bit difference upstream moves a value by a
   whole step) shake by about a percent at 768 tokens.
2. Greedy agreement: ``--prompts`` English prompts, left-padded in batches of ``--batch``, ``--new-tokens`` greedy
   tokens each (EOS suppressed): the fraction identical to the baseline's, and the mean fraction of tokens before
   the first divergence.
3. Bytes held for one sequence (batch 1) of 128, 768 and 4096 tokens, every layer, with float16 K/V written
   straight into each cache (``Cache.update``; the model is not run): codes, scales, zero points, full-precision
   tails and residuals. paged_hf: the blocks the sequence holds times ``bytes_per_block`` plus, for int4, its tail
   row (allocated whether or not it holds tokens); transformers: every tensor the layer holds (quantized data with
   its scales and zero points, and the residual). The ratio is against float16 K/V of the same tokens.
   "per full block" is ``bytes_per_block`` alone (what ``PagedCache.stats().bytes_per_token`` reports).

Torch runs on one thread by default (``--threads``): on the shared 2-core machine two threads ran about 15x
slower than one while other jobs were busy.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/kv_quality.py
    PYTHONPATH=. python benchmarks/kv_quality.py --rows dynamic,int8,int4,quanto4 --prompts 8
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
from paged_hf.kernels.kv_format import kv_format as kv_format_of
from paged_hf.quant import canonical_kv_format

from _common import ModelUnavailable, STORIES_TEXT, load_model, machine, markdown_table

ROWS = ("dynamic", "auto", "int8", "fp8", "fp8_e5m2", "int4", "int4/64", "quanto4", "quanto4r1", "hqq4", "hqq8")
MODELS = {"smollm2": "smollm2", "stories": "stories260K", "stories260K": "stories260K"}
DOC_MARKER = "<|endoftext|>"
BYTES_AT = (128, 768, 4096)
HF_BACKENDS = {"quanto": "quanto", "hqq": "hqq"}

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


# ---------------------------------------------------------------------------------------------------- rows
@dataclass
class Row:
    """One cache configuration: ``make(config)`` builds a fresh cache, ``attention`` is the model's attention."""

    name: str
    kind: str  # "dynamic" | "paged" | "hf"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    backend: str = ""
    hf_options: dict = field(default_factory=dict)

    @property
    def attention(self) -> str:
        return "paged" if self.kind == "paged" else "sdpa"

    def make(self, config):
        from transformers.cache_utils import DynamicCache, QuantizedCache

        if self.kind == "dynamic":
            return DynamicCache(config=config)
        if self.kind == "paged":
            return paged_hf.PagedCache(config, block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype)
        return QuantizedCache(self.backend, config, **self.hf_options)

    def generate_options(self, config) -> dict:
        if self.kind == "paged":
            return dict(cache_implementation="paged",
                        cache_config={"kv_cache_dtype": self.kv_cache_dtype, "block_size": self.block_size})
        return dict(past_key_values=self.make(config))


def parse_row(name: str) -> Row:
    """``dynamic``, a ``kv_cache_dtype`` with an optional ``/block_size``, or ``quanto<bits>[r<residual>]`` /
    ``hqq<bits>[r<residual>]``."""
    if name == "dynamic":
        return Row(name, "dynamic")
    hf = re.fullmatch(r"(quanto|hqq)(\d)(?:r(\d+))?", name)
    if hf:
        options = {"nbits": int(hf.group(2))}
        if hf.group(3):
            options["residual_length"] = int(hf.group(3))
        return Row(name, "hf", backend=HF_BACKENDS[hf.group(1)], hf_options=options)
    fmt, _, block = name.partition("/")
    canonical_kv_format(fmt)  # ValueError for an unknown name
    return Row(name, "paged", kv_cache_dtype=fmt, block_size=int(block) if block else 16)


# ---------------------------------------------------------------------------------------------- measurements
@dataclass
class Scores:
    logprobs: torch.Tensor  # [n, vocab] float32: the next-token distribution at every position
    nll: torch.Tensor  # [n - 1] float64: NLL of each actual next token


@torch.no_grad()
def chunked_scores(model, row: Row, ids: list[int], chunk: int) -> Scores:
    """``ids`` fed through a fresh cache of ``row`` ``chunk`` tokens at a time."""
    model.set_attn_implementation(row.attention)
    cache = row.make(model.config)
    tokens = torch.tensor(ids, dtype=torch.long)
    logprobs = []
    for begin in range(0, len(ids), chunk):
        logits = model(input_ids=tokens[None, begin : begin + chunk], past_key_values=cache, use_cache=True).logits[0]
        logprobs.append(torch.log_softmax(logits.double(), dim=-1).float())
    if cache.get_seq_length() != len(ids):
        raise RuntimeError(f"{row.name}: the cache holds {cache.get_seq_length()} tokens after feeding {len(ids)}")
    out = torch.cat(logprobs)
    return Scores(out, -out[:-1].double().gather(1, tokens[1:, None]).squeeze(1))


@torch.no_grad()
def greedy(model, tokenizer, prompts: list[str], row: Row, batch: int, new_tokens: int) -> torch.Tensor:
    """``[len(prompts), new_tokens]`` greedy continuations with ``row``'s cache."""
    model.set_attn_implementation(row.attention)
    out_rows = []
    for begin in range(0, len(prompts), batch):
        enc = tokenizer(prompts[begin : begin + batch], return_tensors="pt", padding=True)
        out = model.generate(**enc, **row.generate_options(model.config), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        out_rows.append(out[:, enc["input_ids"].shape[1] :])
    return torch.cat(out_rows)


def agreement(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(fraction of rows identical to ``reference``, mean fraction of tokens before the first mismatch)."""
    same = reference == other
    prefix = torch.cumprod(same.int(), dim=1).sum(dim=1).float() / reference.shape[1]
    return same.all(dim=1).float().mean().item(), prefix.mean().item()


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in ``obj`` (tensors, quanto's tensor subclasses, tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__"):  # a quantized tensor subclass: its inner tensors
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, name)) for name in names)
        return obj.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of a model config."""
    text = config.get_text_config(decoder=True)
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, kv_heads, head_dim


def block_bytes(config, row: Row) -> int | None:
    """Bytes of one full block of every layer (codes, scales, zeros: the ``KVFormat``), paged rows only."""
    if row.kind != "paged":
        return None
    layers, kv_heads, head_dim = kv_shape(config)
    fmt = kv_format_of(canonical_kv_format(row.kv_cache_dtype))
    return layers * fmt.bytes_per_block(row.block_size, kv_heads, head_dim, torch.float16)


def held_bytes(cache, row: Row, config) -> int:
    """Bytes one sequence holds in ``cache`` (see the module docstring, 3.)."""
    if row.kind == "paged":
        layers, kv_heads, head_dim = kv_shape(config)
        fmt = kv_format_of(canonical_kv_format(row.kv_cache_dtype))
        blocks = sum(1 for b in cache.rows[0].tables[0].blocks if b is not None)
        return blocks * block_bytes(config, row) \
            + layers * fmt.tail_bytes_per_row(row.block_size, kv_heads, head_dim, torch.float16)
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += tensor_bytes(getattr(layer, name, None))
    return total


@torch.no_grad()
def bytes_at(config, row: Row, lengths: tuple[int, ...], chunk: int = 256) -> dict[int, int]:
    """``{tokens: bytes held}`` for one sequence, float16 K/V written with ``Cache.update`` layer by layer."""
    layers, kv_heads, head_dim = kv_shape(config)
    gen = torch.Generator().manual_seed(0)
    config = type(config).from_dict({**config.to_dict(), "torch_dtype": "float16", "dtype": "float16"})
    cache = row.make(config)
    out, held = {}, 0
    for target in sorted(lengths):
        while held < target:
            n = min(chunk, target - held)
            for layer in range(layers):
                k, v = (torch.randn(1, kv_heads, n, head_dim, generator=gen, dtype=torch.float32).half()
                        for _ in range(2))
                cache.update(k, v, layer)
            held += n
        out[target] = held_bytes(cache, row, config)
    return out


# ------------------------------------------------------------------------------------------------ reporting
@dataclass
class Result:
    row: Row
    scores: dict[str, Scores] = field(default_factory=dict)
    identical: float = 1.0
    prefix: float = 1.0
    bytes: dict[int, int] = field(default_factory=dict)
    block: int | None = None


def delta(result: Result, base: Result, text: str) -> tuple[float, float]:
    """(ΔPPL % vs ``base``, twice the paired standard error of the mean NLL difference, in PPL %)."""
    diff = result.scores[text].nll - base.scores[text].nll
    pct = (math.exp(diff.mean().item()) - 1) * 100
    se = diff.std().item() / math.sqrt(len(diff)) if len(diff) > 1 else 0.0
    return pct, (math.exp(2 * se) - 1) * 100


def kl(result: Result, base: Result, text: str) -> float:
    """Mean KL(base ‖ result) of the next-token distributions over the text's positions, in nats."""
    p, q = base.scores[text].logprobs, result.scores[text].logprobs
    return (p.exp() * (p - q)).sum(-1).mean().item()


def run_model(name: str, args, texts: dict[str, str]) -> None:
    print(f"\n### {name}\n", flush=True)
    started = time.perf_counter()
    try:
        model, tokenizer = load_model(name, attn_implementation="sdpa")
    except ModelUnavailable as reason:
        print(f"skipped: {reason}")
        return
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    fp16_token = 2 * 2 * kv_heads * head_dim * cfg.num_hidden_layers
    print(f"{cfg.num_hidden_layers} layers, {kv_heads} KV heads, head_dim {head_dim}, model dtype {model.dtype}; "
          f"first {args.tokens} tokens of each text in chunks of {args.chunk}")
    streams = {}
    for label, text in texts.items():
        ids = token_stream(tokenizer, text)
        if len(ids) < args.tokens:
            print(f"note: {label} has {len(ids)} tokens, fewer than --tokens {args.tokens}")
        streams[label] = ids[: args.tokens]
    prompts = sample_prompts(args.prompts)
    results = []
    for row in args.rows:
        t0 = time.perf_counter()
        result = Result(row)
        for label, ids in streams.items():
            result.scores[label] = chunked_scores(model, row, ids, args.chunk)
        outputs = greedy(model, tokenizer, prompts, row, args.batch, args.new_tokens)
        if not results:
            reference = outputs
        result.identical, result.prefix = agreement(reference, outputs)
        result.bytes = bytes_at(model.config, row, BYTES_AT)
        result.block = block_bytes(model.config, row)
        results.append(result)
        print(f"  {row.name}: {time.perf_counter() - t0:.0f} s", flush=True)

    base = results[0]
    labels = list(texts)
    headers = ["cache", *(f"ΔPPL % {label}" for label in labels), "mean ΔPPL %",
               *(f"KL ×1e3 {label}" for label in labels),
               f"greedy identical ({len(prompts)} × {args.new_tokens})", "tokens before 1st divergence",
               "per full block vs fp16", *(f"bytes @{n} (vs fp16)" for n in BYTES_AT)]
    table = []
    for result in results:
        cells = [result.row.name]
        deltas = [delta(result, base, label) for label in labels]
        if result is base:
            cells += [f"PPL {math.exp(base.scores[label].nll.mean().item()):.3f}" for label in labels] + ["-"]
            cells += ["-"] * len(labels)
        else:
            cells += [f"{pct:+.2f} ± {noise:.2f}" for pct, noise in deltas]
            cells.append(f"{sum(pct for pct, _ in deltas) / len(deltas):+.2f}")
            cells += [f"{kl(result, base, label) * 1e3:.2f}" for label in labels]
        cells += [f"{round(result.identical * len(prompts))}/{len(prompts)}", f"{result.prefix:.1%}"]
        if result.block is None:
            cells.append("-")
        else:
            block_size = result.row.block_size
            cells.append(f"{fp16_token * block_size / result.block:.2f}×")
        for n in BYTES_AT:
            held = result.bytes[n]
            cells.append(f"{held / 2**20:.2f} MiB ({fp16_token * n / held:.2f}×)")
        table.append(cells)
    print(f"\n{name}: {cfg.num_hidden_layers} layers, {kv_heads} KV heads × head_dim {head_dim}; fp16 K+V = "
          f"{fp16_token} bytes/token (all layers). Baseline: {base.row.name}. Total "
          f"{time.perf_counter() - started:.0f} s.\n")
    print(markdown_table(headers, table), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2", help="comma-separated: smollm2, stories")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows (see the module docstring); "
                        "the first is the baseline")
    parser.add_argument("--tokens", type=int, default=768, help="tokens of each text (default 768)")
    parser.add_argument("--chunk", type=int, default=32, help="tokens per forward in the perplexity runs")
    parser.add_argument("--prompts", type=int, default=32, help="greedy prompts (default 32)")
    parser.add_argument("--batch", type=int, default=16, help="prompts per left-padded generate batch")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared, loaded machine 2 threads ran 15x slower)")
    args = parser.parse_args(argv)
    names = []
    for name in args.models.split(","):
        if name.strip() not in MODELS:
            parser.error(f"unknown model {name!r}; choose from smollm2, stories")
        names.append(MODELS[name.strip()])
    try:
        args.rows = [parse_row(r.strip()) for r in args.rows.split(",")]
    except ValueError as error:
        parser.error(str(error))
    if min(args.chunk, args.prompts, args.batch, args.new_tokens, args.tokens) < 1:
        parser.error("--tokens, --chunk, --prompts, --batch and --new-tokens must be positive")

    texts = {}
    if STORIES_TEXT.is_file():
        texts["TinyStories"] = STORIES_TEXT.read_text()
    else:
        print(f"note: {STORIES_TEXT} is absent; perplexity on the TinyStories sample skipped")
    try:
        licence, licence_path = licence_text()
        texts["licence"] = licence
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
