"""``prefix.py --suite``: prefix reuse on random models sized to run here in minutes (no download).

Two workloads, each side by side in one run:

- **burst**: ``--requests`` requests arrive at once, sharing a ``--system-tokens`` system prompt, each with a
  distinct ``--question-tokens`` question, ``--max-tokens`` greedy tokens, the engine's default token budget (2,048):
  TTFT p50 / mean / p90 and prompt tokens computed, prefix caching off vs on, for a full-attention model (Llama
  shape) and a sliding-window one (Mistral shape, window ``--window``);
- **tiers**: ``--tenants`` system prompts of ``--tenant-tokens`` tokens, ``--rounds`` rounds in which each tenant
  sends one request (one at a time, tenants round robin: the least recently used prefix is the next one asked): the
  prefix hit rate of an unbounded pool, of a pool holding a quarter of the prefixes' blocks, and of that pool with
  a host tier (``kv_offloading_size``) that holds them all.

Random weights: the tokens mean nothing, but every engine runs the same model, so the comparisons are exact (greedy
tokens are compared with the no-cache run).
"""

from __future__ import annotations

import statistics
import time

import torch
import transformers

from paged_hf import PagedEngine, SamplingParams
from paged_hf.kv.sizing import block_id_bytes

from _common import markdown_table

SHAPES = {"full (Llama shape)": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
          "sliding (Mistral shape)": (transformers.MistralConfig, transformers.MistralForCausalLM, None)}


def suite_model(name: str, args):
    config_cls, model_cls, extra = SHAPES[name]
    extra = {"sliding_window": args.window} if extra is None else extra
    config = config_cls(vocab_size=512, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                        num_hidden_layers=4, num_attention_heads=max(2, args.hidden // 64), num_key_value_heads=2,
                        max_position_embeddings=2048, **extra)
    torch.manual_seed(0)
    return model_cls(config).eval()


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def counted(engine: PagedEngine) -> list[int]:
    """A counter of the tokens every step schedules."""
    count, schedule = [0], engine.scheduler.schedule

    def counting():
        out = schedule()
        count[0] += out.num_tokens
        return out

    engine.scheduler.schedule = counting
    return count


def burst(model, args, caching: bool) -> dict:
    system = random_ids(args.system_tokens, 0)
    prompts = [system + random_ids(args.question_tokens, 1 + i) for i in range(args.requests)]
    per_request = -(-(len(prompts[0]) + args.max_tokens) // 16) + 1
    engine = PagedEngine(model, None, num_blocks=args.requests * per_request, enable_prefix_caching=caching,
                         swap_space=0, enforce_eager=True)
    engine.generate([random_ids(40, 999)], SamplingParams(max_tokens=2), use_tqdm=False)  # first-call costs
    count = counted(engine)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    ttft = sorted(o.metrics.time_to_first_token for o in outs)
    engine.check_invariants()
    return dict(p50=statistics.median(ttft), mean=statistics.mean(ttft), p90=ttft[int(0.9 * (len(ttft) - 1))],
                wall=wall, computed=count[0], tokens=[o.outputs[0].token_ids for o in outs])


def tiers(model, args, num_blocks: int | None, host_gib: float) -> dict:
    systems = [random_ids(args.tenant_tokens, 100 + t) for t in range(args.tenants)]
    per_request = -(-(args.tenant_tokens + 32 + 8) // 16) + 1
    engine = PagedEngine(model, None, num_blocks=num_blocks or args.tenants * args.rounds * per_request,
                         kv_offloading_size=host_gib, swap_space=0, enforce_eager=True)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    start, outs = time.perf_counter(), []
    for r in range(args.rounds):
        for t, system in enumerate(systems):
            outs += engine.generate([system + random_ids(32, 1000 * r + t)], params, use_tqdm=False)
    stats = engine.get_stats()
    engine.check_invariants()
    return dict(hit_rate=stats["prefix_cache_hit_rate"], host=stats["prefix_cache_host_hits"],
                queries=stats["prefix_cache_queries"], wall=time.perf_counter() - start,
                host_mib=stats["host_cache_bytes"] / 2**20, tokens=[o.outputs[0].token_ids for o in outs])


def run_suite(args) -> int:
    print(f"## burst: {args.requests} requests, {args.system_tokens}-token shared system prompt, "
          f"{args.question_tokens}-token questions, {args.max_tokens} tokens, hidden {args.hidden}, 4 layers\n")
    rows = []
    for name in SHAPES:
        model = suite_model(name, args)
        off, on = burst(model, args, False), burst(model, args, True)
        same = sum(a == b for a, b in zip(off["tokens"], on["tokens"]))
        for label, r in (("off", off), ("on", on)):
            rows.append([name, label, f"{r['p50']:.2f}", f"{r['mean']:.2f}", f"{r['p90']:.2f}", f"{r['wall']:.1f}",
                         r["computed"], f"{off['p50'] / r['p50']:.1f}x", f"{same}/{len(on['tokens'])}"])
        print(f"{name}: done", flush=True)
    print(markdown_table(["model", "prefix caching", "TTFT p50 s", "mean s", "p90 s", "wall s", "tokens computed",
                          "p50 vs off", "greedy = off"], rows))

    model = suite_model("full (Llama shape)", args)
    blocks = args.tenants * -(-(args.tenant_tokens + 40) // 16)  # every tenant's request, cached
    probe = PagedEngine(model, None, num_blocks=16, swap_space=0, enforce_eager=True)
    host_gib = 2 * blocks * block_id_bytes(probe.kv) / 2**30
    print(f"\n## tiers: {args.tenants} tenants x {args.tenant_tokens}-token system prompts, {args.rounds} rounds "
          f"round robin, one request at a time; working set {blocks} blocks; quarter pool {blocks // 4} blocks\n")
    runs = {"unbounded pool": tiers(model, args, None, 0.0),
            "quarter pool": tiers(model, args, blocks // 4, 0.0),
            f"quarter pool + host tier ({host_gib * 1024:.1f} MiB)": tiers(model, args, blocks // 4, host_gib)}
    base = runs["unbounded pool"]
    rows = [[label, f"{r['hit_rate']:.1%}", f"{r['hit_rate'] / base['hit_rate']:.0%}",
             f"{r['host'] / max(1, r['queries']):.1%}", f"{r['host_mib']:.1f}", f"{r['wall']:.1f}",
             f"{sum(a == b for a, b in zip(base['tokens'], r['tokens']))}/{len(r['tokens'])}"]
            for label, r in runs.items()]
    print(markdown_table(["pool", "prefix hit rate", "vs unbounded", "served by the host tier", "host MiB",
                          "wall s", "greedy = unbounded"], rows))
    return 0
