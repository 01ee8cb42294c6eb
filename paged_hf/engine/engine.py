"""``PagedEngine``: continuous batching over a stock transformers model.

One ``step()`` reads schedule -> execute -> update -> outputs, each owned by one object: the scheduler picks the
sequences and their tokens (and allocates their blocks); the runner runs one forward, samples every row at once and
returns a ``RunnerOutput``; the scheduler applies it (tokens, finishing, failures, the prefix cache's step), asking
the output stage whether a sequence's new text ends in a stop string; the output stage builds the outputs. Requests
join and leave at every step; blocks are freed the moment a sequence finishes, aborts or fails.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import itertools
import logging
from collections.abc import Iterator
import time


from ..config import GIB, EngineConfig, ParameterError, SamplingParams
from ..distributed import tensor_parallel_group
from ..distributed.group import DEFAULT_TIMEOUT_S, TensorParallelError, leave_group
from ..distributed.launch import check_launch_options
from ..kv.sizing import blocks_to_hold
from ..kv_stats import EngineStats
from ..model_source import load_tokenizer
from ..structured.compiler import GrammarCompilerCache, logits_width
from . import multimodal, parallel
from .cuda_graphs import graph_options
from .output import OutputStage
from .request import Request, RequestOutput, RequestOutputKind
from .runner import ModelRunner
from .scheduler import Scheduler
from .spec.config import check_tensor_parallel
from .threads import StepPinning, bind_cpu_threads
from .validation import (bad_words_token_ids, check_drawable, check_params, check_prompt_ids, prompt_ids,
                         tokenized_bad_words, vocab_size)
from .worker import build_kv, follow, max_model_len_of, prepare_model

logger = logging.getLogger("paged_hf")


class PagedEngine:
    """Serves many requests at once on ``model`` (any decoder-only transformers model).

    Args:
        model: a loaded ``PreTrainedModel``; its attention is switched to ``"paged"``. A model sharded by
            transformers' tensor parallelism (``model.tp_size > 1``) makes this rank's engine part of the group:
            rank 0 leads (requests, scheduling, sampling); the others follow (``follow()``, or ``generate`` under
            ``torchrun``). ``PagedEngine.from_pretrained(path, tensor_parallel_size=N)`` starts the ranks itself.
        tokenizer: needed for string prompts, chat messages, ``stop`` strings and output text.
        **options: ``EngineConfig`` fields (``block_size``, ``kv_cache_dtype``, ``max_num_seqs``, ...); an unknown
            one raises ``ValueError`` naming it and the closest valid one.
    """

    def __init__(self, model, tokenizer=None, *, _executor=None, **options) -> None:
        self.config = EngineConfig.from_options("PagedEngine", options)
        # The model, tokenizer and transformers' modules are hundreds of thousands of objects that live as long as
        # the engine: out of the cyclic collector's sight, its passes during serving stop costing milliseconds a
        # step (vLLM freezes after start-up too). What was garbage before is collected first. Only what exists
        # before the engine is frozen: the engine's own objects (its pool's reference cycles) stay collectable, so a
        # dropped engine frees its memory.
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)  # at exit they are ordinary objects again, torn down as usual (idempotent)
        self.group = tensor_parallel_group(model)
        self._broken: TensorParallelError | None = None  # set when the tensor-parallel group broke
        self._timeout_s = DEFAULT_TIMEOUT_S
        self.model = prepare_model(model)
        self.cpu_threads = bind_cpu_threads(self.config.cpu_threads_bind, model.device)
        self._pinning = StepPinning.for_engine(self.config.cpu_threads_bind, model.device, self.cpu_threads)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len_of(self.config, model)
        self.vocab_size = vocab_size(model, model.config.get_text_config(decoder=True))
        self.kv = build_kv(model, self.config, self.group)
        self.eos_token_ids = self._eos_token_ids()
        self.output = OutputStage(tokenizer)
        self.grammars = GrammarCompilerCache(tokenizer, logits_width(model), self.eos_token_ids)
        self.scheduler = Scheduler(self.config, self.kv, self.eos_token_ids, self.max_model_len)
        self._attach_draft_model()
        if self.group is not None and not self.config.enforce_eager:
            logger.info("PagedEngine: tensor parallelism runs the forward eagerly on every rank (enforce_eager)")
        recurrent = self.kv.recurrent is not None
        if recurrent and not self.config.enforce_eager:
            logger.info("PagedEngine: a model with recurrent layers runs its forward eagerly (enforce_eager): each "
                        "recurrent layer splits the step by sequence in Python")
        self.runner = ModelRunner(model, self.kv, self.group, _executor, self.eos_token_ids,
                                  self.output.token_text if tokenizer is not None else None,
                                  compile=not self.config.enforce_eager and self.group is None and not recurrent,
                                  graphs=None if self.group is not None or recurrent else
                                  graph_options(self.config, model.device, self.max_model_len))
        self._ids = itertools.count()
        # Outputs have one reader each: ``generate`` and each ``stream`` read their own requests' (their readers are
        # tokens here), ``step()``'s caller every other request's. A step any of them runs parks the outputs of the
        # others' requests until their reader asks (``_step_for``), so none is lost, whoever stepped.
        self._readers: dict[str, object] = {}  # request id -> its reader (absent: step()'s caller)
        self._parked: dict[object, list[RequestOutput]] = {}  # reader (None: step()'s caller) -> its outputs
        self._busy_seconds = 0.0
        self._num_steps = self._num_step_tokens = 0  # steps that ran a forward, and the tokens those forwarded
        logger.info("PagedEngine: %d KV blocks of %d tokens (%s, %.2f GiB) on %s, max_model_len %d",
                    self.kv.num_total_blocks, self.config.block_size, self.config.kv_cache_dtype,
                    self.kv.stats().kv_cache_bytes / GIB, model.device, self.max_model_len)
        self._warn_of_batch_wide_rope(model.config.get_text_config(decoder=True))
        self.max_sequence_len = self._max_sequence_len()
        if self.max_sequence_len < self.max_model_len:  # vLLM refuses to start so; a small pool is a choice here
            logger.warning("PagedEngine: the KV pool holds one sequence of at most %d tokens, fewer than "
                           "max_model_len %d: a longer request is refused (raise num_blocks or kv_cache_memory, or "
                           "lower max_model_len)", self.max_sequence_len, self.max_model_len)

    def _warn_of_batch_wide_rope(self, text_config) -> None:
        """Phi-3's ``longrope`` chooses its factors from the longest position of a forward: past its
        ``original_max_position_embeddings`` one request of a step switches every request of it (as in vLLM)."""
        rope = getattr(text_config, "rope_parameters", None) or {}
        per_layer_type = bool(rope) and all(isinstance(value, dict) for value in rope.values())  # Gemma 3's form
        for parameters in rope.values() if per_layer_type else [rope]:
            original = parameters.get("original_max_position_embeddings")
            if parameters.get("rope_type") == "longrope" and original and self.max_model_len > original:
                logger.warning("PagedEngine: the model's longrope chooses its factors from the longest position of "
                               "each forward: once a request of a step is past %d tokens "
                               "(original_max_position_embeddings), every request of that step uses the long "
                               "factors, and a shorter one's tokens can differ from its run alone", original)
                return

    def _max_sequence_len(self) -> int:
        """The most tokens one sequence can reach: ``max_model_len``, or fewer where the pool cannot hold them (a
        sequence stores every token but its last, which is sampled and never stored)."""
        fits = lambda length: blocks_to_hold(self.kv, length - 1) <= self.kv.num_total_blocks  # noqa: E731
        low, high = 1, self.max_model_len  # fits(1): nothing stored
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle) else (low, middle - 1)
        return low

    def _attach_draft_model(self) -> None:
        """Speculation's step clock (CPU seconds on a CPU); method "draft_model": the draft model on its own pool of
        as many blocks as the target's, compiled as the target is."""
        spec = self.config.speculative_config
        if spec is not None and self.model.device.type == "cpu":
            self.scheduler.speculator.clock = time.process_time
        if spec is None or spec.method != "draft_model":
            return
        check_tensor_parallel(spec, self.group.size if self.group is not None else 1)
        from .spec.draft_model import DraftModelProposer, load_draft_model  # noqa: PLC0415 - only this method

        draft = load_draft_model(spec.model, self.model)
        self.scheduler.speculator.drafter = DraftModelProposer(
            draft, self.kv.num_total_blocks, self.config.block_size, self.config.max_num_batched_tokens,
            compile=not self.config.enforce_eager)

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
        return ids

    @property
    def requests(self) -> dict[str, Request]:
        """The requests not finished yet, by id (the scheduler's)."""
        return self.scheduler.requests

    # -------------------------------------------------------------------------------- requests
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, cache_salt: str | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                    enable_prefix_caching: bool = True, images=None) -> str:
        """Queues a request; raises ``ValueError`` (and queues nothing) for a prompt that can never run.

        ``output_kind`` says what ``step()`` returns for it: everything so far (default), only what is new
        (streaming), or one output when it finishes. ``enable_prefix_caching=False``: this request reuses no cached
        prefix (it computes its whole prompt; its blocks are still cached for later requests). ``images``: the
        processor's tensors for the prompt's images (``{"pixel_values": [N, ...]}``; the prompt's ids hold the
        placeholders the processor expanded, one run per image; see ``engine/multimodal.py``).
        """
        self._require_leader("add_request")
        text, ids, params = self.check_request(prompt, params)
        limit = self.config.limit_mm_per_prompt
        request_images = multimodal.request_images(images, ids, self.model, limit and limit.get("image"),
                                                   self.config.max_num_batched_tokens,
                                                   self.config.max_num_encoder_input_tokens)
        if request_images is not None and self.group is not None:
            raise NotImplementedError("PagedEngine runs images on one process, not under tensor parallelism")
        if request_id is None:  # an id no request holds, whatever ids callers chose themselves
            request_id = str(next(self._ids))
            while request_id in self.scheduler.requests:
                request_id = str(next(self._ids))
        bad_words = tokenized_bad_words(params) or ()  # check_request tokenized them, if a front end had not
        grammar = self._compile_grammar(params)
        request = Request(request_id, text, ids, params, priority, cache_salt, RequestOutputKind(output_kind))
        request.reuse_prefix = bool(enable_prefix_caching)
        if request_images is not None:
            request.images = request_images
            request.cache_salt = request_images.block_keys(cache_salt)  # the images' digests key their blocks
        request.compiled_grammar = grammar
        request.bad_words_token_ids = bad_words
        self.scheduler.add(request)
        return request_id

    def check_request(self, prompt, params: SamplingParams | None) -> tuple[str | None, list[int], SamplingParams]:
        """``(text, token ids, params)`` of a request as ``add_request`` takes it (``max_tokens`` capped at the
        context, ``bad_words`` tokenized), or the ``ValueError`` it would raise whatever the engine's state: ids
        outside the vocabulary, a prompt with no room to generate, bad parameters, parameters that rule out every
        token, a request longer than the KV pool holds. Changes nothing (safe from any thread): a front end can
        refuse a hopeless request before queueing it."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a paged_hf.SamplingParams, got {type(params).__name__}")
        text, ids = prompt_ids(prompt, self.tokenizer)
        ids = check_prompt_ids(ids, self.vocab_size, self.max_model_len)
        room = self.max_model_len - len(ids)
        if params.max_tokens is None:  # as many as the context holds, or the pool where it holds fewer
            room = max(1, min(room, self.max_sequence_len - len(ids)))
        if params.max_tokens is None or params.max_tokens > room:
            # vLLM's rule: the context length ends a request whatever its max_tokens (finish_reason "length"); a
            # min_tokens past it is met as far as the context allows
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        check_params(params, len(ids), self.vocab_size, self.max_model_len, self.config)
        if params.bad_words and tokenized_bad_words(params) is None:
            params = dataclasses.replace(params, _bad_words_token_ids=(
                params.bad_words, bad_words_token_ids(params.bad_words, self.tokenizer)))
        check_drawable(params, self.eos_token_ids)
        # the longest the sequence can get; its last token is sampled, never stored
        if len(ids) + params.max_tokens > self.max_sequence_len:
            stored = len(ids) + params.max_tokens - 1
            raise ParameterError(
                "max_tokens" if len(ids) < self.max_sequence_len else "prompt",
                f"the request needs up to {blocks_to_hold(self.kv, stored)} blocks ({len(ids)} prompt tokens + "
                f"max_tokens={params.max_tokens}) but the pool has {self.kv.num_total_blocks} (num_blocks), which hold "
                f"one sequence of at most {self.max_sequence_len} tokens: it could never finish; lower max_tokens or "
                f"raise num_blocks"
            )
        return text, ids, params

    def _compile_grammar(self, params: SamplingParams):
        """The Future of ``params.structured_outputs``' compiled grammar (compiling on the grammar threads), or None;
        a spec the backend refuses raises its ``GrammarError`` now."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise ParameterError("structured_outputs", "structured_outputs needs the engine's tokenizer (the grammar "
                                                       "is compiled over its vocabulary): PagedEngine(model, tokenizer)")
        return self.grammars.submit(params.structured_outputs)

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its blocks; unknown or finished ids are ignored."""
        if self.scheduler.abort(request_id) is not None:
            self.output.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether requests are queued or running, or outputs wait for ``step()``'s caller (its requests that a
        ``generate`` or ``stream`` stepped, to their end too): ``while has_unfinished_requests(): step()`` gets every
        output."""
        return bool(self.scheduler.requests) or bool(self._parked.get(None))

    # ------------------------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Runs one iteration; returns the outputs of the requests that progressed or finished (per their
        ``output_kind``), and those a ``generate`` or ``stream`` running meanwhile stepped for them. Requests that
        a running ``generate`` or ``stream`` added are theirs: their outputs go to them."""
        return self._step_for(None)

    def _step_for(self, reader) -> list[RequestOutput]:
        """``reader``'s outputs (None: ``step()``'s caller): those parked for it, else one iteration's, whose
        outputs for other readers are parked for them."""
        parked = self._parked.pop(reader, None)
        if parked:
            return parked
        mine = []
        for out in self._advance():
            owner = self._readers.get(out.request_id)
            if out.finished:
                self._readers.pop(out.request_id, None)
            if owner is reader:
                mine.append(out)
            else:
                self._parked.setdefault(owner, []).append(out)
        return mine

    def _read_by(self, reader, request_ids) -> None:
        for request_id in request_ids:
            self._readers[request_id] = reader

    def _release(self, reader, request_ids) -> None:
        """Forgets ``reader`` (its requests ended or were aborted) and what was parked for it."""
        for request_id in request_ids:
            if self._readers.get(request_id) is reader:
                del self._readers[request_id]
        self._parked.pop(reader, None)

    def _advance(self) -> list[RequestOutput]:
        """One iteration: schedule, execute, update; the outputs of the requests it changed."""
        self._require_leader("step")
        started = time.perf_counter()
        with self._pinning.during_step():
            changed: list[Request] = self.scheduler.admit_compiled()  # structured outputs whose grammar failed
            output = self.scheduler.schedule()
            if output.scheduled:
                self._num_steps += 1
                self._num_step_tokens += output.num_tokens
                result = self.runner.execute(output)
                if result.broken:
                    logger.error("the engine cannot run any more: %s", result.step_error)
                    self._broken = result.step_error
                changed += self.scheduler.update_from_output(output, result, self.output.stop_string)
        self._busy_seconds += time.perf_counter() - started
        return self.output.outputs(changed)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, priority: list[int] | None = None,
                 cache_salt: list[str | None] | None = None, images: list | None = None) -> list[RequestOutput]:
        """Runs ``prompts`` (one or a list) to completion; outputs in prompt order.

        Every prompt is checked before any work starts: one that cannot run (too long, ids outside the vocabulary,
        bad parameters) raises its ``ValueError`` and leaves nothing queued, as ``LLM.generate`` and vLLM do. A
        request that fails while it runs (a logits processor that raises, NaN logits, a failed step) fails alone:
        its output has ``error`` set and ``finish_reason == "error"``, and the others complete.
        ``priority`` / ``cache_salt`` / ``images``: one per prompt, as ``add_request``'s.

        Under tensor parallelism every rank may call it (as under ``torchrun``): the leader runs the prompts it was
        given, the followers run the leader's steps, and every rank returns the leader's outputs."""
        if self.group is not None and not self.group.is_leader:
            return follow(self.runner, until_done=True)
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"params has {len(params_list)} entries for {len(prompts)} prompts")
        for name, values in (("priority", priority), ("cache_salt", cache_salt), ("images", images)):
            if values is not None and len(values) != len(prompts):
                raise ValueError(f"{name} has {len(values)} entries for {len(prompts)} prompts")
        priorities = priority if priority is not None else [0] * len(prompts)
        salts = cache_salt if cache_salt is not None else [None] * len(prompts)
        image_list = images if images is not None else [None] * len(prompts)
        order: list[str] = []
        try:
            for prompt, p, rank, salt, image in zip(prompts, params_list, priorities, salts, image_list):
                order.append(self.add_request(prompt, p, output_kind=RequestOutputKind.FINAL_ONLY, priority=rank,
                                              cache_salt=salt, images=image))
        except Exception:
            for request_id in order:
                self.abort(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        pending = set(order)
        bar = _progress(len(order), use_tqdm)
        reader = object()
        self._read_by(reader, order)
        try:
            while pending and (self.scheduler.requests or self._parked.get(reader)):
                for out in self._step_for(reader):
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            self._release(reader, order)
            bar.close()
        if pending:
            raise RuntimeError(f"the engine stopped with requests {sorted(pending)} unfinished")
        outputs = [results[rid] for rid in order]
        if self._broken is None:
            self.runner.broadcast(("done", outputs))
        return outputs

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yields the text of sample 0 as it grows (deltas); other queued requests progress meanwhile."""
        request_id = self.add_request(prompt, params, output_kind=RequestOutputKind.DELTA)
        reader = object()
        self._read_by(reader, [request_id])
        try:
            while request_id in self.scheduler.requests or self._parked.get(reader):  # else aborted elsewhere
                for out in self._step_for(reader):
                    if out.outputs[0].text:
                        yield out.outputs[0].text
                    if out.finished:
                        if out.error:
                            raise RuntimeError(out.error)
                        return
        finally:
            self._release(reader, [request_id])
            self.abort(request_id)

    # ------------------------------------------------------------------------- tensor parallelism
    @classmethod
    def from_pretrained(cls, model: str, tokenizer=None, *, tensor_parallel_size: int = 1,
                        distributed_executor_backend: str = "mp", distributed_timeout: float = DEFAULT_TIMEOUT_S,
                        model_kwargs: dict | None = None, **options) -> "PagedEngine":
        """An engine on the model at ``model`` (a folder, or a hub id), loaded through transformers; ``tokenizer``: a
        tokenizer, its path, or None for the model's own (if it has one).

        ``tensor_parallel_size=N`` (vLLM's name) shards it over N ranks with transformers' tensor-parallel plan: this
        process leads and N - 1 followers start as local processes (``distributed_executor_backend="mp"``) or as Ray
        actors (``"ray"``: a Ray cluster places them, across machines too). A size that does not divide the model's
        heads, or a model without a tensor-parallel plan, is a ValueError before any process starts. A follower that
        dies is reported by the next step; a collective that waits longer than ``distributed_timeout`` seconds
        raises. Call ``shutdown()`` when done. ``model_kwargs`` go to ``from_pretrained`` (e.g. ``dtype``). The backend
        and the timeout are checked at any size; with one rank there is nothing for them to do.
        """
        check_launch_options(distributed_executor_backend, distributed_timeout)
        model_kwargs = {"attn_implementation": "paged", **(model_kwargs or {})}
        tokenizer = load_tokenizer(tokenizer, model, optional=True)
        if tensor_parallel_size == 1:
            from transformers import AutoModelForCausalLM  # noqa: PLC0415

            return cls(AutoModelForCausalLM.from_pretrained(model, **model_kwargs).eval(), tokenizer, **options)
        config = EngineConfig.from_options("PagedEngine", options)  # bad options fail here, before any process starts
        check_tensor_parallel(config.speculative_config, tensor_parallel_size)
        loaded, executor = parallel.start_tensor_parallel(model, tensor_parallel_size, distributed_executor_backend,
                                                          model_kwargs, options, distributed_timeout)
        try:
            engine = cls(loaded, tokenizer, _executor=executor, **options)
        except BaseException:
            executor.shutdown(timeout_s=5)
            raise
        engine._timeout_s = distributed_timeout
        return engine

    def follow(self) -> None:
        """A follower rank: runs the leader's steps until the leader's ``shutdown()``."""
        if self.group is None or self.group.is_leader:
            raise RuntimeError("follow() is for the follower ranks of a tensor-parallel engine (rank > 0)")
        follow(self.runner)

    @property
    def broken(self) -> TensorParallelError | None:
        """Why this engine cannot run any more (its tensor-parallel group broke, or it was shut down), else None."""
        return self._broken

    def keep_alive(self) -> None:
        """The leader, idle (a server waiting for requests): keeps the followers' wait under the group's timeout.
        Cheap; a no-op without tensor parallelism (or once the group broke or was shut down)."""
        if self._broken is None:
            parallel.keep_alive(self.runner, self._timeout_s)

    def shutdown(self) -> None:
        """Tells the followers to stop and waits for those this engine started; a tensor-parallel engine cannot run
        after it (its calls raise). Idempotent; a no-op on one process."""
        if self.group is None or not self.group.is_leader:
            return
        if self._broken is None:
            try:
                self.runner.broadcast(("stop",))
            except TensorParallelError as error:  # a dead follower: nothing to tell it
                logger.warning("tensor-parallel shutdown: %s", error)
            self._broken = TensorParallelError("the engine was shut down")
        if self.runner.executor is not None:  # the followers from_pretrained started
            executor, self.runner.executor = self.runner.executor, None
            executor.shutdown()
            leave_group()

    def _require_leader(self, name: str) -> None:
        """``name`` needs the leader of a working group (or no group)."""
        if self._broken is not None:
            raise TensorParallelError(f"{name}(): the engine cannot run any more: {self._broken}")
        if self.group is not None and not self.group.is_leader:
            raise RuntimeError(f"{name}() runs on the leader (rank 0); rank {self.group.rank} follows its steps: call "
                               f"follow() (or generate(), which follows and returns the leader's outputs)")

    def get_stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            **self.kv.stats().__dict__,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_swapped=len(scheduler.swapped),
            preemption_count=scheduler.num_preemptions,
            num_swapped_out=scheduler.num_swapped_out,
            num_swapped_in=scheduler.num_swapped_in,
            generated_tokens=scheduler.num_generated_tokens,
            generation_tokens_per_s=scheduler.num_generated_tokens / self._busy_seconds if self._busy_seconds else 0.0,
            num_steps=self._num_steps,
            num_step_tokens=self._num_step_tokens,
            tensor_parallel_size=self.group.size if self.group is not None else 1,
            num_encoded_images=self.runner.images.num_encoded_images if self.runner.images is not None else 0,
            **(scheduler.speculator.stats() if scheduler.speculator is not None else {}),
        )

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        if self.kv.prefix_caching and not self.scheduler.unregistered_decodes:  # since the last lookup, every
            # running sequence's computed full block is registered (decode runs register theirs at the next one)
            size = self.kv.block_size
            for seq in self.scheduler.running:
                assert seq.kv.num_cached_blocks >= seq.num_computed_tokens // size, (
                    f"{seq.request.request_id}: {seq.num_computed_tokens} tokens computed, only "
                    f"{seq.kv.num_cached_blocks} blocks registered in the prefix cache")
        batch = self.runner.batch
        if batch is not None and batch.epoch == self.scheduler.epoch:  # it may still run the next step
            batch.check()
        speculator = self.scheduler.speculator
        if speculator is not None and speculator.drafter is not None:
            speculator.drafter.check_invariants()


def _progress(total: int, use_tqdm):
    """A progress bar over ``total`` requests: ``use_tqdm`` True (tqdm), False (none), or a tqdm-like factory
    (vLLM accepts one)."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts")
    if use_tqdm:
        from tqdm.auto import tqdm  # noqa: PLC0415 - a dependency, imported when a bar is shown

        return tqdm(total=total, desc="Processed prompts", unit="req")

    class _Silent:
        def update(self, n): pass
        def close(self): pass
    return _Silent()
