"""What ``PagedEngine.add_request`` reads and checks before a request is queued, once per request (never per step).

``SamplingParams`` checks each value on its own (types, ranges, finite numbers); this module checks what depends on
the model and the engine: token ids inside the vocabulary (an id past it would make the embedding lookup raise in
the middle of a batch), a prompt that leaves no room to generate, and the engine's per-request limits
(``EngineConfig.max_logprobs``, ``max_n``, ``max_stop_strings``; logprobs past the vocabulary). Each failure is a
``ParameterError`` naming the field, so that a server can answer 400 with it.
"""

from __future__ import annotations

from numbers import Integral

from ..config import EngineConfig, ParameterError, SamplingParams


def check_prompt_ids(ids: list, vocab_size: int, max_model_len: int) -> list[int]:
    """``ids`` as a list of ints, each in ``[0, vocab_size)``, with room to generate at least one token."""
    if not ids:
        raise ParameterError("prompt", "prompt is empty: it needs at least one token")
    if len(ids) >= max_model_len:  # first: the cheapest refusal of a huge prompt
        raise ParameterError(
            "prompt", f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                      f"{len(ids)} tokens: max_model_len={max_model_len} leaves no room to generate; shorten the prompt"
        )
    if not all(isinstance(t, Integral) and not isinstance(t, bool) for t in ids):
        bad = next(t for t in ids if not isinstance(t, Integral) or isinstance(t, bool))
        raise ParameterError("prompt", f"prompt token ids must be ints, got {bad!r}")
    ids = [int(t) for t in ids]
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ParameterError("prompt", f"prompt token ids must be in [0, {vocab_size}) (the model's vocabulary), "
                                       f"got {bad} at position {ids.index(bad)}")
    return ids


def check_params(params: SamplingParams, num_prompt_tokens: int, vocab_size: int, max_model_len: int,
                 config: EngineConfig) -> None:
    """The engine's limits on ``params`` (its ``max_tokens`` already capped at the context) for a prompt of
    ``num_prompt_tokens`` tokens."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > config.max_logprobs:
            raise ParameterError(name, f"{name} must be at most {config.max_logprobs} (max_logprobs), got {value}")
        if value is not None and value > vocab_size:  # a max_logprobs raised past the vocabulary lets it through
            raise ParameterError(name, f"{name} must be at most {vocab_size} (the model's vocabulary), got {value}")
    if params.n > config.max_n:
        raise ParameterError("n", f"n must be at most {config.max_n} (max_n), got {params.n}")
    if len(params.stop) > config.max_stop_strings:
        raise ParameterError("stop", f"stop has {len(params.stop)} strings; at most {config.max_stop_strings} are "
                                     f"allowed (max_stop_strings)")
    if params.allowed_token_ids is not None and max(params.allowed_token_ids) >= vocab_size:
        raise ParameterError("allowed_token_ids", f"allowed_token_ids must be in [0, {vocab_size}) (the model's "
                                                  f"vocabulary), got {max(params.allowed_token_ids)}")
    if params.logit_bias:
        bad = [t for t in params.logit_bias if t >= vocab_size]
        if bad:
            raise ParameterError("logit_bias", f"logit_bias token ids must be in [0, {vocab_size}) (the model's "
                                               f"vocabulary), got {bad[0]}")


def tokenized_bad_words(params: SamplingParams) -> tuple[tuple[int, ...], ...] | None:
    """``params.bad_words`` as token sequences, where a front end tokenized these very words
    (``SamplingParams._bad_words_token_ids``); None where nothing, or other words, were tokenized."""
    memo = params._bad_words_token_ids
    return memo[1] if memo is not None and memo[0] == params.bad_words else None


def check_drawable(params: SamplingParams, eos_token_ids) -> None:
    """``ParameterError`` naming ``allowed_token_ids`` where every token it allows is ruled out at the first step: by
    one-token ``bad_words`` (always), or with ``min_tokens`` by the end and stop tokens it holds back (the sampler's
    rules). ``params``' bad words are tokenized (``tokenized_bad_words``)."""
    if params.allowed_token_ids is None:
        return
    allowed = set(params.allowed_token_ids)
    banned = {ids[0] for ids in tokenized_bad_words(params) or () if len(ids) == 1}
    if allowed <= banned:
        raise ParameterError("allowed_token_ids", "every token allowed_token_ids allows is a one-token bad_words "
                                                  "entry: no token can ever be drawn")
    held = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(eos_token_ids))
    if params.min_tokens and allowed <= banned | held:
        raise ParameterError("allowed_token_ids", f"allowed_token_ids allows only end or stop tokens (or bad words), "
                                                  f"which min_tokens={params.min_tokens} holds back: no first token "
                                                  f"can be drawn")


def bad_words_token_ids(words: tuple[str, ...], tokenizer) -> tuple[tuple[int, ...], ...]:
    """``SamplingParams.bad_words`` as token sequences, as vLLM tokenizes them: each word alone, and after a space
    where that gives a sequence as long as the first but starting with another token (a word-start token)."""
    if not words:
        return ()
    if tokenizer is None:
        raise ParameterError("bad_words", "bad_words needs the engine's tokenizer: PagedEngine(model, tokenizer)")
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(alone)  # a non-blank word has at least one token
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return tuple(sequences)


def prompt_ids(prompt, tokenizer) -> tuple[str | None, list]:
    """``(text, token ids)`` of a prompt: a string, a list of token ids, ``{"prompt_token_ids": [...]}`` (with an
    optional ``"prompt"`` text) or a list of chat messages (the tokenizer's chat template)."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise ParameterError("prompt", f"prompt_token_ids must be a list of token ids, got {ids!r}")
        return prompt.get("prompt"), list(ids)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt and
                                   all(isinstance(m, dict) for m in prompt)):
        if tokenizer is None:
            raise ValueError("a tokenizer is needed for text or chat prompts: PagedEngine(model, tokenizer)")
    if isinstance(prompt, str):
        return prompt, tokenizer(prompt)["input_ids"]
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
        return text, tokenizer(text, add_special_tokens=False)["input_ids"]
    raise ParameterError("prompt", f"prompt must be a string, a non-empty list of token ids or a non-empty list "
                                   f"of chat messages, got {prompt!r:.200}")


def vocab_size(model, text_config) -> int:
    """Token ids the model can read (its input embeddings) and score (its output layer): the smaller."""
    sizes = []
    embeddings = model.get_input_embeddings()
    if getattr(embeddings, "num_embeddings", None):
        sizes.append(embeddings.num_embeddings)
    head = model.get_output_embeddings()
    if getattr(head, "out_features", None):
        sizes.append(head.out_features)
    return min(sizes) if sizes else text_config.vocab_size
