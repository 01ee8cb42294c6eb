"""Image prompts through ``PagedEngine`` vs ``model.generate`` batches, on a random LLaVA (CLIP tower + Llama).

A seeded workload of ``--requests`` prompts, each a few text tokens around one or two images (32x32 pixels, 4x4
patches: 64 placeholder tokens each), with ``--max-out`` greedy output tokens (EOS ignored). Side by side in one
process, both with float32 weights and sdpa:

(a) ``model.generate`` on ``DynamicCache`` in left-padded batches of ``--batch-size`` (the vision tower runs on the
    batch's images inside the first forward);
(b) ``PagedEngine.generate`` (eager), once per ``--budgets`` value of ``max_num_batched_tokens``: the vision tower
    runs per image in the step that first computes its placeholders, so a small budget spreads image encoding over
    steps that also decode other requests (chunked prefill through the image tokens).

Throughput = output tokens / wall seconds; the table also gives each engine run's vision-tower calls and whether its
greedy tokens equal (a)'s, request by request. The model is random (nothing is downloaded): the figures time the
machinery, not a trained model's quality.

    PYTHONPATH=. python benchmarks/images.py                              # 32 requests, budgets 256 and 2048
    PYTHONPATH=. python benchmarks/images.py --requests 4 --max-out 4     # the smoke size
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import paged_hf

IMAGE_SIZE, PATCH = 32, 4
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
IMAGE_TOKEN_ID, VOCAB = 1000, 1024


def build_model(layers: int, hidden: int):
    vision = transformers.CLIPVisionConfig(hidden_size=hidden // 2, intermediate_size=hidden, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH)
    text = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID,
                                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(config).eval()


def workload(count: int, seed: int) -> list[tuple[list[int], torch.Tensor]]:
    """(token ids, pixel values [images, 3, 32, 32]) per request: 1 or 2 images, text around them."""
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for index in range(count):
        num_images = 1 + index % 2
        ids = [1] + torch.randint(3, 900, (8,), generator=generator).tolist()
        for _ in range(num_images):
            ids += [IMAGE_TOKEN_ID] * IMAGE_TOKENS + torch.randint(3, 900, (4,), generator=generator).tolist()
        requests.append((ids, torch.randn(num_images, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)))
    return requests


def run_generate(model, requests, batch_size: int, max_out: int) -> tuple[float, list[list[int]]]:
    model.set_attn_implementation("sdpa")
    outputs, begin = [], time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids, _ in batch])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=mask, pixel_values=torch.cat([p for _, p in batch]),
                                 max_new_tokens=max_out, min_new_tokens=max_out, do_sample=False, pad_token_id=0,
                                 cache=transformers.DynamicCache(config=model.config))
        outputs.extend(out[:, width:].tolist())
    return time.perf_counter() - begin, outputs


def run_engine(model, requests, budget: int, max_out: int) -> tuple[float, list[list[int]], int]:
    engine = paged_hf.PagedEngine(model, None, enforce_eager=True, max_num_batched_tokens=budget, block_size=16,
                                  num_blocks=64 + len(requests) * (2 * IMAGE_TOKENS + max_out + 32) // 16)
    params = paged_hf.SamplingParams(max_tokens=max_out, temperature=0, ignore_eos=True)
    begin = time.perf_counter()
    outs = engine.generate([ids for ids, _ in requests], params, use_tqdm=False,
                           images=[{"pixel_values": p} for _, p in requests])
    seconds = time.perf_counter() - begin
    engine.check_invariants()
    return seconds, [o.outputs[0].token_ids for o in outs], engine.runner.images.num_encoded_images


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-out", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8, help="generate's batch size")
    parser.add_argument("--budgets", default="256,2048", help="the engine's max_num_batched_tokens, comma-separated")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args.layers, args.hidden)
    requests = workload(args.requests, args.seed)
    num_images = sum(p.shape[0] for _, p in requests)
    output_tokens = args.requests * args.max_out
    run_generate(model, requests[:1], 1, 2)  # warm-up: lazy imports, the allocator
    seconds, reference = run_generate(model, requests, args.batch_size, args.max_out)
    print(f"{args.requests} requests, {num_images} images of {IMAGE_TOKENS} tokens, {args.max_out} output tokens "
          f"each; LLaVA (random) {args.layers} layers, hidden {args.hidden}; {args.threads} thread(s)\n")
    print("| system | seconds | output tok/s | vs generate | vision-tower runs | same tokens |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    print(f"| generate, DynamicCache, batches of {args.batch_size} | {seconds:.2f} | {output_tokens / seconds:.1f} | "
          f"1.00x | {num_images} | - |")
    for budget in (int(b) for b in args.budgets.split(",")):
        engine_seconds, tokens, encoded = run_engine(model, requests, budget, args.max_out)
        same = sum(t == r for t, r in zip(tokens, reference))
        print(f"| PagedEngine, max_num_batched_tokens={budget} | {engine_seconds:.2f} | "
              f"{output_tokens / engine_seconds:.1f} | {seconds / engine_seconds:.2f}x | {encoded} | "
              f"{same}/{len(tokens)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
