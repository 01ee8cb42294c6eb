"""Image prompts through ``PagedEngine`` vs ``model.generate`` batches, on a random vision-language model.

``--family``: LLaVA (CLIP tower + Llama; 32x32 images in 4x4 patches, 64 placeholder tokens each), Qwen2-VL (M-RoPE;
an 8x8 grid of 4x4 patches merged 2x2, 16 tokens) or Gemma 3 (SigLIP pooled to 16 tokens; two-way attention inside
an image, sliding window 64). A seeded workload of ``--requests`` prompts, each a few text tokens around one or two
images, with ``--max-out`` greedy output tokens (EOS ignored). Side by side in one process, both with float32 weights
and sdpa:

(a) ``model.generate`` on ``DynamicCache`` in left-padded batches of ``--batch-size`` (the vision tower runs on the
    batch's images inside the first forward);
(b) ``PagedEngine.generate`` (eager), once per ``--budgets`` value of ``max_num_batched_tokens``: the vision tower
    runs per image in the step that first computes its placeholders, so a small budget spreads image encoding over
    steps that also decode other requests (chunked prefill through the image tokens).

Throughput = output tokens / wall seconds; the table also gives each engine run's vision-tower calls and whether its
greedy tokens equal (a)'s, request by request. The model is random (nothing is downloaded): the figures time the
machinery, not a trained model's quality.

    PYTHONPATH=. python benchmarks/images.py                              # 32 requests, budgets 256 and 2048
    PYTHONPATH=. python benchmarks/images.py --family qwen2_vl            # or gemma3
    PYTHONPATH=. python benchmarks/images.py --requests 4 --max-out 4     # the smoke size
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import paged_hf

IMAGE_SIZE, PATCH = 32, 4
IMAGE_TOKEN_ID, BOI, EOI, VOCAB = 1000, 1001, 1002, 1024
FAMILIES = ("llava", "qwen2_vl", "gemma3")
IMAGE_TOKENS = {"llava": (IMAGE_SIZE // PATCH) ** 2, "qwen2_vl": 16, "gemma3": 16}


def build_model(family: str, layers: int, hidden: int):
    text = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    if family == "qwen2_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                   "mrope_section": [hidden // 32, hidden * 3 // 64, hidden * 3 // 64]}
        vision = dict(depth=2, embed_dim=hidden // 2, hidden_size=hidden, num_heads=4, patch_size=PATCH,
                      spatial_merge_size=2, temporal_patch_size=2)
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID,
                                            video_token_id=1003, vision_start_token_id=BOI, vision_end_token_id=EOI)
        return transformers.Qwen2VLForConditionalGeneration(config).eval()
    vision = dict(hidden_size=hidden // 2, intermediate_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                  image_size=IMAGE_SIZE, patch_size=PATCH)
    if family == "gemma3":
        config = transformers.Gemma3Config(
            text_config={**text, "head_dim": hidden // 4, "sliding_window": 64, "query_pre_attn_scalar": hidden // 4},
            vision_config=vision, mm_tokens_per_image=IMAGE_TOKENS["gemma3"], image_token_index=IMAGE_TOKEN_ID,
            boi_token_index=BOI, eoi_token_index=EOI)
        return transformers.Gemma3ForConditionalGeneration(config).eval()
    config = transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**vision),
                                      text_config=transformers.LlamaConfig(**text), image_token_id=IMAGE_TOKEN_ID,
                                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    return transformers.LlavaForConditionalGeneration(config).eval()


def workload(family: str, count: int, seed: int) -> list[tuple[list[int], dict]]:
    """(token ids, the engine's image tensors) per request: 1 or 2 images, text around them."""
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for index in range(count):
        num_images = 1 + index % 2
        ids = [1] + torch.randint(3, 900, (8,), generator=generator).tolist()
        for _ in range(num_images):
            run = [IMAGE_TOKEN_ID] * IMAGE_TOKENS[family]
            ids += (run if family == "llava" else [BOI] + run + [EOI]) + \
                torch.randint(3, 900, (4,), generator=generator).tolist()
        if family == "qwen2_vl":  # an 8x8 grid of patches of 3 x 2 frames x 4 x 4 values
            images = {"pixel_values": torch.randn(num_images * 64, 3 * 2 * PATCH * PATCH, generator=generator),
                      "image_grid_thw": torch.tensor([[1, 8, 8]] * num_images)}
        else:
            images = {"pixel_values": torch.randn(num_images, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)}
        requests.append((ids, images))
    return requests


def generate_inputs(family: str, batch) -> dict:
    """A left-padded batch's inputs for ``model.generate``: ids, mask, the images (and their token types)."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids, _ in batch])
    inputs = {"input_ids": input_ids, "attention_mask": (torch.arange(width) >= width - torch.tensor(
        [[len(ids)] for ids, _ in batch])).long()}
    for name in batch[0][1]:
        inputs[name] = torch.cat([images[name] for _, images in batch])
    if family == "qwen2_vl":
        inputs["mm_token_type_ids"] = (input_ids == IMAGE_TOKEN_ID).int()
    elif family == "gemma3":
        inputs["token_type_ids"] = (input_ids == IMAGE_TOKEN_ID).long()
    return inputs


def run_generate(family: str, model, requests, batch_size: int, max_out: int) -> tuple[float, list[list[int]]]:
    model.set_attn_implementation("sdpa")
    outputs, begin = [], time.perf_counter()
    for first in range(0, len(requests), batch_size):
        inputs = generate_inputs(family, requests[first : first + batch_size])
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_out, min_new_tokens=max_out, do_sample=False,
                                 pad_token_id=0, cache=transformers.DynamicCache(config=model.config))
        outputs.extend(out[:, inputs["input_ids"].shape[1]:].tolist())
    return time.perf_counter() - begin, outputs


def run_engine(model, requests, budget: int, max_out: int) -> tuple[float, list[list[int]], int]:
    engine = paged_hf.PagedEngine(model, None, enforce_eager=True, max_num_batched_tokens=budget, block_size=16,
                                  num_blocks=64 + len(requests) * (max(map(len, (i for i, _ in requests))) + max_out) // 8)
    params = paged_hf.SamplingParams(max_tokens=max_out, temperature=0, ignore_eos=True)
    begin = time.perf_counter()
    outs = engine.generate([ids for ids, _ in requests], params, use_tqdm=False, images=[i for _, i in requests])
    seconds = time.perf_counter() - begin
    engine.check_invariants()
    return seconds, [o.outputs[0].token_ids for o in outs], engine.runner.images.num_encoded_images


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default="llava")
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
    model = build_model(args.family, args.layers, args.hidden)
    requests = workload(args.family, args.requests, args.seed)
    num_images = sum(1 + index % 2 for index in range(args.requests))
    output_tokens = args.requests * args.max_out
    run_generate(args.family, model, requests[:1], 1, 2)  # warm-up: lazy imports, the allocator
    seconds, reference = run_generate(args.family, model, requests, args.batch_size, args.max_out)
    print(f"{args.requests} requests, {num_images} images of {IMAGE_TOKENS[args.family]} tokens, {args.max_out} output "
          f"tokens each; {args.family} (random) {args.layers} layers, hidden {args.hidden}; {args.threads} "
          f"thread(s)\n")
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
