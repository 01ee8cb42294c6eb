"""``enable_default_paged``: the paged cache as the default of every generate() that does not choose its own.

The process-wide switch behind ``paged-hf run`` (tests/test_run.py runs it end to end); here it is driven in
process, on tiny models, together with the pipeline route (``pipeline(...)(..., cache_implementation="paged")``).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache, GenerationConfig

import paged_hf
from paged_hf.patches import default_paged
from models import stories_model, stories_tokenizer, tiny_model

PROMPT = {"input_ids": torch.tensor([[0, 0, 5, 9, 14], [7, 3, 22, 8, 31]]),
          "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])}
GREEDY = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True)


@pytest.fixture
def default_on():
    """Turns the default on for one test and always leaves it off (the registration as it was)."""
    yield paged_hf.enable_default_paged
    paged_hf.disable_default_paged()
    paged_hf.register()


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def built_cache(out):
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


def test_default_builds_a_paged_cache_with_the_default_tokens(llama, default_on):
    reference = llama.generate(**PROMPT, **GREEDY)
    assert isinstance(built_cache(reference), DynamicCache)
    default_on({"block_size": 4})
    out = llama.generate(**PROMPT, **GREEDY)
    cache = built_cache(out)
    assert isinstance(cache, paged_hf.PagedCache)
    assert cache.cache_config.block_size == 4, "the default's cache_config must reach the cache"
    assert torch.equal(out.sequences, reference.sequences)


@pytest.mark.parametrize(
    "choice",
    ["cache_object", "past_key_values", "keyword", "explicit_generation_config", "model_generation_config",
     "use_cache_false"],
)
def test_a_call_that_chooses_its_cache_keeps_it(llama, default_on, choice):
    default_on()
    kwargs = dict(GREEDY)
    saved = llama.generation_config
    if choice == "cache_object":
        kwargs["cache"] = DynamicCache(config=llama.config)
    elif choice == "past_key_values":
        kwargs["past_key_values"] = DynamicCache(config=llama.config)
    elif choice == "keyword":
        kwargs["cache_implementation"] = "static"
    elif choice == "explicit_generation_config":
        kwargs = {"generation_config": GenerationConfig(cache_implementation="static", **GREEDY)}
    elif choice == "model_generation_config":
        llama.generation_config = GenerationConfig(cache_implementation="static")
    elif choice == "use_cache_false":
        kwargs["use_cache"] = False
    try:
        assert default_paged.caller_chose_cache(llama, (), kwargs)
        out = llama.generate(**PROMPT, **kwargs)
    finally:
        llama.generation_config = saved
    assert not isinstance(built_cache(out), paged_hf.PagedCache)
    assert not default_paged.caller_chose_cache(llama, (), dict(GREEDY))


def test_an_explicit_paged_call_without_cache_config_takes_the_defaults(llama, default_on):
    default_on({"block_size": 8})
    out = llama.generate(**PROMPT, **GREEDY, cache_implementation="paged")
    assert built_cache(out).cache_config.block_size == 8
    out = llama.generate(**PROMPT, **GREEDY, cache_implementation="paged", cache_config={"block_size": 2})
    assert built_cache(out).cache_config.block_size == 2, "a call's own cache_config wins"


def test_assisted_decoding_under_the_default(llama, default_on):
    assistant = tiny_model("llama", seed=1)
    row = {k: v[1:] for k, v in PROMPT.items()}  # assisted generate takes one row
    reference = llama.generate(**row, **GREEDY, assistant_model=assistant)
    default_on()
    out = llama.generate(**row, **GREEDY, assistant_model=assistant)
    assert isinstance(built_cache(out), paged_hf.PagedCache)
    assert torch.equal(out.sequences, reference.sequences)


def test_a_model_the_paged_cache_cannot_hold_keeps_its_cache_with_a_warning(default_on):
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(config).eval()
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 1]])}
    reference = t5.generate(**inputs, max_new_tokens=4, do_sample=False)
    default_on()
    with pytest.warns(RuntimeWarning, match="keeps transformers' default cache.*encoder-decoder"):
        out = t5.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, reference)


def test_bad_cache_config_is_refused_before_anything_changes(default_on):
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['blocksize'\]"):
        default_on({"blocksize": 16})
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        default_on({"block_size": 12})
    with pytest.raises(ValueError, match="cache_config must be a dict"):
        default_on("int8")
    assert not default_paged.is_enabled()


def test_unregister_turns_the_default_off_and_register_reads_the_environment(llama, default_on, monkeypatch):
    default_on()
    paged_hf.unregister()
    assert not default_paged.is_enabled()
    assert not isinstance(built_cache(llama.generate(**PROMPT, **GREEDY)), paged_hf.PagedCache)
    monkeypatch.setenv("PAGED_HF_DEFAULT_CACHE", "paged")
    monkeypatch.setenv("PAGED_HF_CACHE_CONFIG", '{"block_size": 4, "kv_cache_dtype": "int8"}')
    paged_hf.register()
    assert default_paged.cache_config() == {"block_size": 4, "kv_cache_dtype": "int8"}
    assert isinstance(built_cache(llama.generate(**PROMPT, **GREEDY)), paged_hf.PagedCache)


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"PAGED_HF_DEFAULT_CACHE": "yes"}, "PAGED_HF_DEFAULT_CACHE must be 'paged'"),
        ({"PAGED_HF_DEFAULT_CACHE": "paged", "PAGED_HF_CACHE_CONFIG": "{block_size: 4}"},
         "PAGED_HF_CACHE_CONFIG is not valid JSON"),
        ({"PAGED_HF_DEFAULT_CACHE": "paged", "PAGED_HF_CACHE_CONFIG": "[4]"}, "must be a JSON object"),
        ({"PAGED_HF_DEFAULT_CACHE": "paged", "PAGED_HF_CACHE_CONFIG": '{"kv_cache_dtype": "int3"}'},
         "PAGED_HF_CACHE_CONFIG: kv_cache_dtype must be one of"),
    ],
    ids=["switch", "json", "not-object", "bad-value"],
)
def test_bad_environment_raises_naming_the_variable(environ, message):
    with pytest.raises(ValueError, match=message):
        default_paged.config_from_environment(environ)


def test_environment_switch_values():
    assert default_paged.config_from_environment({}) is None
    assert default_paged.config_from_environment({"PAGED_HF_DEFAULT_CACHE": "paged"}) == {}
    with pytest.warns(RuntimeWarning, match="PAGED_HF_CACHE_CONFIG is set but PAGED_HF_DEFAULT_CACHE"):
        assert default_paged.config_from_environment({"PAGED_HF_CACHE_CONFIG": "{}"}) is None


# ------------------------------------------------------------------------------------------------ pipeline
@pytest.fixture(scope="module")
def story_pipeline():
    tok = stories_tokenizer()  # left padding, pad token set: what a batched text-generation pipeline needs
    return transformers.pipeline("text-generation", model=stories_model("sdpa"), tokenizer=tok)


@pytest.fixture
def paged_caches_built(monkeypatch):
    built = []
    init = paged_hf.PagedCache.__init__

    def counting_init(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(paged_hf.PagedCache, "__init__", counting_init)
    return built


@pytest.mark.parametrize("route", ["call", "construction", "default"])
def test_pipeline_on_the_paged_cache_gives_the_default_texts(story_pipeline, paged_caches_built, default_on, route):
    prompts = ["Once upon a time", "The little dog saw a big red ball", "Lily"]
    settings = dict(max_new_tokens=20, do_sample=False, batch_size=3)
    reference = story_pipeline(prompts, **settings)
    assert not paged_caches_built
    if route == "call":  # generate's keywords, passed through the pipeline call
        out = story_pipeline(prompts, **settings, cache_implementation="paged")
    elif route == "construction":  # generation keywords given to pipeline() apply to every call
        pipe = transformers.pipeline("text-generation", model=story_pipeline.model, tokenizer=story_pipeline.tokenizer,
                                     cache_implementation="paged", cache_config={"block_size": 8})
        out = pipe(prompts, **settings)
        assert paged_caches_built[0].cache_config.block_size == 8
    else:
        default_on()
        out = story_pipeline(prompts, **settings)
    assert out == reference
    assert len(paged_caches_built) == 1, "one batched generate call, one PagedCache"
