"""The output stage: text, stop strings and the ``RequestOutput``s of a step.

It owns the detokenizer of every sequence (``Sequence.detokenizer``, written here only) and what each request's last
output carried (``_Sent``, for ``DELTA`` outputs), so building an output changes no sequence. Text is decoded per step
only where a request needs it then (a stream, stop strings); a request that only wants its final output is decoded
once, when it finishes. The scheduler asks ``stop_string`` for its verdict after appending a token, and finishes the
sequence on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .detokenizer import Decoder, IncrementalDetokenizer, find_stop
from .request import CompletionOutput, Request, RequestOutput, RequestOutputKind, Sequence, SequenceStatus


@dataclass
class _Sent:
    """What a ``DELTA`` request's outputs carried so far: per sample, tokens, logprobs and text characters."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[int] = field(default_factory=list)
    text: list[int] = field(default_factory=list)
    prompt_logprobs: int = 0


def text_token_ids(seq: Sequence) -> list[int]:
    """The tokens whose text is ``seq``'s output text: all of them, but for the stop token or EOS that ended it,
    whose text is left out unless ``include_stop_str_in_output`` (vLLM's rule; the token stays in ``token_ids``)."""
    if seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str) \
            and not seq.request.params.include_stop_str_in_output:
        return seq.token_ids[:-1]
    return seq.token_ids


def stop_hold_back(params) -> int:
    """Characters an unfinished sequence's output holds back: ``len(longest stop string) - 1``, the most a stop
    string completed by later tokens can reach back into text already decoded (vLLM's output buffer), so no output
    ever shows text a stop string then removes; 0 without stop strings or when the stop string is kept."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(stop) for stop in params.stop) - 1


class OutputStage:
    """Detokenization, stop strings and outputs for one engine (``tokenizer``: None runs on token ids alone)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoder = Decoder(tokenizer) if tokenizer is not None else None
        self._other_decoders: dict[tuple[bool, bool], Decoder] = {}  # the rarer special-token settings, when asked
        self._sent: dict[str, _Sent] = {}

    def _decoder_for(self, params) -> Decoder:
        """The output-text decoder ``params`` ask for (special tokens skipped, unless asked otherwise)."""
        if params.skip_special_tokens and params.spaces_between_special_tokens:
            return self.decoder
        key = (params.skip_special_tokens, params.spaces_between_special_tokens)
        if key not in self._other_decoders:
            self._other_decoders[key] = Decoder(self.tokenizer, *key)
        return self._other_decoders[key]

    def token_text(self, token_id: int) -> str | None:
        """A logprob entry's name for ``token_id`` (its text in context), or None without a tokenizer."""
        return None if self.decoder is None else self.decoder.token_text(token_id)

    # ------------------------------------------------------------------------------------- the verdict
    def stop_string(self, seq: Sequence) -> str | None:
        """Extends ``seq``'s text where its request needs it now and returns the stop string its new text ends,
        if any (the text is cut before it, for good). Called once per sampled token, after the scheduler appended
        it (and finished the sequence on EOS, a stop token or a length)."""
        if self.decoder is None:
            return None
        params = seq.request.params
        if not params.detokenize or not params.stop and seq.request.output_kind is RequestOutputKind.FINAL_ONLY:
            return None  # never decoded, or decoded once, when it finishes
        detokenizer = self._detokenizer(seq)
        token_ids = text_token_ids(seq)
        delta = detokenizer.update(token_ids)
        finished = seq.status is SequenceStatus.FINISHED
        if not params.stop or (finished and seq.finish_reason != "length") \
                or seq.num_output_tokens <= params.min_tokens:  # vLLM's rule: a stop must end after min_tokens
            return None
        # text held back (the output ends in a byte-fallback token such as a newline's <0x0A>, or inside a
        # character) is searched as if the output ended here: vLLM's detokenizer emits a complete character at once
        held = "" if delta else detokenizer.pending(token_ids)
        if not delta and not held:
            return None
        found = find_stop(detokenizer.text + held, len(delta or held), params.stop)
        if found is None:
            return None
        if held:  # the output ends at this token: its held text is final
            detokenizer.accept(held, token_ids)
        detokenizer.truncate(found[1] + (len(found[0]) if params.include_stop_str_in_output else 0))
        return found[0]

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self._decoder_for(seq.request.params), seq.num_prompt_tokens,
                                                     seq.token_ids)
        return seq.detokenizer

    # ------------------------------------------------------------------------------------- outputs
    def outputs(self, requests: Iterable[Request]) -> list[RequestOutput]:
        """The outputs of ``requests`` (those the step changed), per their ``output_kind``: ``FINAL_ONLY`` ones
        only when they finish."""
        out = []
        for request in requests:
            if request.output_kind is RequestOutputKind.FINAL_ONLY and not request.finished:
                continue
            out.append(self.output_of(request))
        return out

    def output_of(self, request: Request) -> RequestOutput:
        """``request``'s output now (a ``DELTA`` request's: what is new since its last one)."""
        if request.finished and self.decoder is not None and request.params.detokenize:
            for seq in request.sequences:
                self._detokenizer(seq).finish(text_token_ids(seq))
        delta = request.output_kind is RequestOutputKind.DELTA
        sent = self._sent.setdefault(request.request_id, _Sent()) if delta else None
        wants_logprobs = request.params.logprobs is not None
        prompt_len = len(request.prompt_token_ids)
        outputs = []
        hold = stop_hold_back(request.params)
        for seq in request.sequences:
            tokens, text = seq.token_ids[prompt_len:], seq.output_text
            if hold and seq.status is not SequenceStatus.FINISHED:  # may be the start of a stop string
                text = text[: max(len(text) - hold, 0)]
            logprobs = seq.logprobs if wants_logprobs else None
            if sent is not None:
                while len(sent.tokens) <= seq.index:
                    sent.tokens.append(0), sent.logprobs.append(0), sent.text.append(0)
                tokens, text = tokens[sent.tokens[seq.index]:], text[sent.text[seq.index]:]
                logprobs = logprobs[sent.logprobs[seq.index]:] if logprobs is not None else None
                sent.tokens[seq.index] += len(tokens)
                sent.text[seq.index] += len(text)
                sent.logprobs[seq.index] += len(logprobs or ())
            outputs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(tokens), finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, logprobs=None if logprobs is None else list(logprobs),
                cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            ))
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is not None and sent is not None:
            prompt_logprobs = prompt_logprobs[sent.prompt_logprobs:]
            sent.prompt_logprobs += len(prompt_logprobs)
        if request.finished:
            self._sent.pop(request.request_id, None)
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, outputs, request.finished,
            request.metrics, None if request.error is None else f"{type(request.error).__name__}: {request.error}",
            None if prompt_logprobs is None else list(prompt_logprobs),
            None if request.metrics.first_scheduled_time is None else request.metrics.num_prefix_cached_tokens,
        )

    def forget(self, request_id: str) -> None:
        """Drops what is kept for a request that left without a final output (aborted)."""
        self._sent.pop(request_id, None)
