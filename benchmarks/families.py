"""Decoder families transformers ships, on the engine: the compiled engine's greedy tokens against the eager
engine's and against ``generate`` + ``DynamicCache``, for tiny random models of each family.

Each model is built from its config class with a small shape (``--hidden`` wide, two layers, four heads, a 512-token
vocabulary) and the family's own defaults otherwise (partial rotary, parallel attention, multi-query, ...). Three
prompts of 5-30 tokens generate ``--tokens`` greedy tokens each, chunked in 9-token steps over 4-token blocks. The
compiled graphs check their custom ops' output sizes and strides (inductor's size asserts, off in the engine
itself): a fake that disagrees with its op fails by name instead of giving wrong values. A family the engine refuses
(attention in the model's own code, K/V changed after the cache update, sparse attention over a latent, layers
that neither attend nor keep a recurrent state) is listed with its error; a family transformers lacks is skipped. A hybrid (its
recurrent layers beside attention) runs eagerly: its "compiled" column says so.

    PYTHONPATH=. python benchmarks/families.py
    PYTHONPATH=. python benchmarks/families.py --families phi gpt_neox falcon
"""

from __future__ import annotations

import argparse
import logging

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import paged_hf  # noqa: F401 - registers the "paged" attention
from paged_hf import PagedEngine, SamplingParams
from paged_hf.engine import compile as compile_module

from _common import machine, markdown_table

FAMILIES = ("llama", "mistral", "ministral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3",
            "stablelm", "olmo", "olmo2", "olmo3", "flex_olmo", "cohere", "cohere2", "granite", "starcoder2", "mixtral",
            "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "phimoe", "hunyuan_v1_moe", "glm4_moe",
            "dots1", "afmoe", "gpt_oss", "gpt_neox", "falcon", "gpt2", "gpt_bigcode", "gptj", "codegen", "opt",
            "biogpt", "persimmon", "nemotron", "smollm3", "helium", "glm", "glm4", "exaone4", "ernie4_5", "arcee",
            "apertus", "seed_oss", "hunyuan_v1_dense", "bitnet", "doge",
            # newer in transformers 5.25
            "apertus1p5_text", "aria_text", "cohere2_moe", "cwm", "exaone", "exaone_moe", "flint", "granite_swa",
            "granitemoe_swa", "hrm_text", "hy_v3", "hyperclovax", "internlm3", "iquestcoder", "jais2", "kolibri1",
            "laguna", "mellum", "minicpm5_moe", "minimax_m2", "ministral3", "nanochat", "param2moe", "sarvam_moe",
            "solar_open", "vaultgemma",
            # hybrids: recurrent layers (gated DeltaNet, short convolutions, Mamba2, Mamba) beside attention
            "qwen3_5_text", "qwen3_next", "lfm2", "granitemoehybrid", "bamba", "nemotron_h", "falcon_h1", "jamba",
            "lara_mini", "olmo_hybrid",
            # the last layers read earlier layers' K/V; Gemma 4's full layers are wider, with fewer KV heads
            "gemma3n_text", "gemma4_text",
            # multi-head latent attention: a latent row a token, the up-projection folded into the attention
            "deepseek_v2", "deepseek_v3", "minicpm3", "glm4_moe_lite", "longcat_flash", "youtu", "kimi_linear",
            "bailing_hybrid",
            # refused by name: attention in the model's own code, K/V changed after the update, sparse attention
            # over the latent, layers that are not attention nor recurrent
            "mpt", "bloom", "xglm", "gpt_neo", "jetmoe", "deepseek_v32", "llama4_text", "minimax", "dory", "zaya",
            "mimo_v2_flash")
DELTANET = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
HYBRID_MLA = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                  mlp_layer_types=["dense", "sparse"] * 2, linear_head_dim=16, linear_num_heads=4)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=8)
# What a family's defaults need to fit the tiny shape (rotary wider than a head, a layer pattern per layer, MLA's
# and the MoE's sizes); a family whose KV heads follow another field (GPT-BigCode's multi_query) keeps them.
OVERRIDES = {
    "gptj": dict(rotary_dim=8), "codegen": dict(rotary_dim=8),
    "gpt_neo": dict(num_layers=2, attention_types=[[["global", "local"], 1]], window_size=8),
    # hybrids: four layers, two of them recurrent (two of their default pattern would all be recurrent), with the
    # linear attention's and the Mamba mixers' heads sized for the tiny width
    **{name: dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, **DELTANET)
       for name in ("qwen3_5_text", "qwen3_next")},
    "lfm2": dict(num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2),
    "granitemoehybrid": dict(num_hidden_layers=4, layer_types=["mamba", "attention"] * 2, **MAMBA2),
    "bamba": dict(num_hidden_layers=4, attn_layer_indices=[1, 3], **MAMBA2),
    "falcon_h1": dict(num_hidden_layers=4, mamba_d_ssm=128, **MAMBA2),
    "nemotron_h": dict(num_hidden_layers=4, layers_block_type=["mamba", "attention", "mamba", "mlp"],
                       mamba_num_heads=8, mamba_head_dim=16, n_groups=1, ssm_state_size=16, chunk_size=8),
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, mamba_d_state=8, mamba_expand=2, mamba_dt_rank=8),
    "recurrent_gemma": dict(num_hidden_layers=4),
    # four layers, sliding and full alternating, the last two reading layers 0 and 1; per-layer inputs sized down
    **{name: dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
                  num_kv_shared_layers=2, vocab_size_per_layer_input=512, hidden_size_per_layer_input=8,
                  num_key_value_heads=2, head_dim=16, **extra)
       for name, extra in (("gemma4_text", dict(global_head_dim=32, num_global_key_value_heads=1,
                                                 attention_k_eq_v=True)),
                           ("gemma3n_text", dict(laurel_rank=4, activation_sparsity_pattern=[0.0] * 4)))},
    # Dory: one input layer, two looped, one output layer (its defaults do not fit four layers)
    "dory": dict(num_hidden_layers=4, n_input_layers=1, n_recurrent_layers=2, n_output_layers=1),
    # MLA: a 16-wide latent, values narrower than keys' no-rotary part; Kimi Linear and the Bailing hybrid with
    # linear attention (KDA, Lightning) beside it, four layers
    **{name: dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, head_dim=8, qk_nope_head_dim=16,
                  v_head_dim=12, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                  topk_group=1, num_key_value_heads=4, **(HYBRID_MLA if name in ("kimi_linear", "bailing_hybrid")
                                                          else {}))
       for name in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "minicpm3", "glm4_moe_lite", "longcat_flash",
                    "youtu", "kimi_linear", "bailing_hybrid")},
    "dots1": dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1),
}
OWN_KV_HEADS = ("gpt_neox", "falcon", "gpt_bigcode", "gemma4_text", "deepseek_v2", "deepseek_v3", "deepseek_v32",
                "minicpm3", "glm4_moe_lite", "longcat_flash", "youtu", "kimi_linear", "bailing_hybrid")
PROMPT_LENGTHS = (5, 17, 30)
ENGINE = dict(block_size=4, num_blocks=128, max_num_batched_tokens=9)


def tiny(family: str, hidden: int):
    """A seeded random ``family`` model, ``hidden`` wide, two layers, four heads (two KV heads where it has them)."""
    overrides = OVERRIDES.get(family, {})
    config = AutoConfig.for_model(family, **{**dict(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False),
        **overrides})
    if family not in OWN_KV_HEADS and hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = 2
    for name, value in (("head_dim", hidden // 4), ("moe_intermediate_size", hidden), ("num_experts", 4),
                        ("num_local_experts", 4), ("num_experts_per_tok", 2)):
        # a read-only property (Falcon's head_dim) stays as the config derives it
        if name not in overrides and hasattr(config, name) and \
                not isinstance(getattr(type(config), name, None), property):
            setattr(config, name, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation("sdpa" if model._supports_sdpa else "eager")
    return model


def engine_tokens(model, prompts, params, **options) -> tuple[list[list[int]], bool]:
    engine = PagedEngine(model, None, **ENGINE, **options)
    outs = engine.generate(prompts, params, use_tqdm=False)
    errors = [out.error for out in outs if out.error]
    if errors:
        raise RuntimeError(errors[0])
    return [out.outputs[0].token_ids for out in outs], engine.runner.compiled is not None


def check(family: str, hidden: int, tokens: int) -> list:
    """One table row: family, compiled, compiled == eager, eager == generate, note."""
    try:
        model = tiny(family, hidden)
        prompts = [list(range(3, 3 + n)) for n in PROMPT_LENGTHS]
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        reference = [model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]  # EOS ignored
        eager, _ = engine_tokens(model, prompts, params, enforce_eager=True)
        compiled, did_compile = engine_tokens(model, prompts, params)
    except Exception as error:  # noqa: BLE001 - a family's failure is its row
        return [family, "-", "-", "-", f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"]
    return [family, "yes" if did_compile else "no (eager)", compiled == eager, eager == reference, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=10)
    args = parser.parse_args()
    logging.getLogger("paged_hf").setLevel(logging.ERROR)
    compile_module._INDUCTOR_SETTINGS["size_asserts"] = True
    print(f"# the engine over tiny random models of each family\n{machine()}\n")
    rows = []
    for family in args.families:
        if family not in CONFIG_MAPPING:
            print(f"skipped {family}: this transformers has no such model type")
            continue
        rows.append(check(family, args.hidden, args.tokens))
        print(f"{family}: done", flush=True)
    print(markdown_table(["family", "compiled", "compiled == eager", "eager == generate", "error"], rows))


if __name__ == "__main__":
    main()
