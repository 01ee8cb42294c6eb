"""``PagedEngine``: continuous batching over a stock transformers model.

One ``step()`` reads schedule -> execute -> update from output: the scheduler picks the sequences and their tokens
(and allocates their blocks), the runner runs one forward and returns the logits, the sampler draws every row at
once, the scheduler applies the tokens (finishing on EOS, stop tokens and lengths), and the output stage decodes
new text where a request needs it (streams, stop strings) and builds the outputs. Requests join and leave at
every step; blocks are freed the moment a sequence finishes, aborts or fails.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterator

import torch

from ..config import DEFAULT_CPU_KV_CACHE_GIB, EngineConfig, SamplingParams
from ..distributed import tensor_parallel_group
from ..distributed.group import DEFAULT_TIMEOUT_S, TensorParallelError
from ..distributed.launch import check_launch_options
from ..kv.manager import KVManager
from ..kv.model_config import available_memory, block_id_bytes, local_kv_heads
from ..kv_stats import EngineStats
from .detokenizer import IncrementalDetokenizer, decoder_for, find_stop
from . import parallel
from .isolation import isolate
from .request import Request, RequestOutput, RequestOutputKind, Sequence, SequenceStatus
from .runner import BlockCopyError, ModelRunner
from .sampler import position_logprobs, sample
from .scheduler import Scheduler, SchedulerOutput
from .validation import check_params, check_prompt_ids, prompt_ids, vocab_size

GIB = 1 << 30
logger = logging.getLogger("paged_hf")


class PagedEngine:
    """Serves many requests at once on ``model`` (any decoder-only transformers model).

    Args:
        model: a loaded ``PreTrainedModel``; its attention is switched to ``"paged"``. A model sharded by
            transformers' tensor parallelism (``model.tp_size > 1``) makes this rank's engine part of the group:
            rank 0 leads (requests, scheduling, sampling); the others follow (``follow()``, or ``generate`` under
            ``torchrun``). ``PagedEngine.from_pretrained(path, tensor_parallel_size=N)`` starts the ranks itself.
        tokenizer: needed for string prompts, chat messages, ``stop`` strings and output text.
        **options: ``EngineConfig`` fields (``block_size``, ``kv_cache_dtype``, ``max_num_seqs``, ...).
    """

    def __init__(self, model, tokenizer=None, **options) -> None:
        self.config = EngineConfig.from_options("PagedEngine", options)
        self.group = tensor_parallel_group(model)
        self._broken: TensorParallelError | None = None  # set when the tensor-parallel group broke
        self._timeout_s = DEFAULT_TIMEOUT_S
        if getattr(model.config, "is_encoder_decoder", False):
            raise NotImplementedError(f"PagedEngine serves decoder-only models; {type(model).__name__} is not")
        if model.config._attn_implementation != "paged":
            model.set_attn_implementation("paged")
        self.model = model.eval()
        self.tokenizer = tokenizer
        text_config = model.config.get_text_config(decoder=True)
        self.max_model_len = self.config.max_model_len or getattr(text_config, "max_position_embeddings", 4096)
        self.vocab_size = vocab_size(model, text_config)
        tp_size = self.group.size if self.group is not None else 1
        num_blocks = self.config.num_blocks or self._blocks_from_memory(model, text_config, tp_size)
        if self.group is not None:  # every rank must hold the same blocks: the smallest pool wins
            num_blocks = self.group.min(num_blocks)
        self.kv = KVManager(text_config, self.config.block_size, self.config.kv_cache_dtype, num_blocks,
                            enable_prefix_caching=self.config.enable_prefix_caching,
                            swap_space_bytes=int(self.config.swap_space * GIB),
                            num_kv_heads=local_kv_heads(text_config, tp_size))
        self.kv.allocate_all(model.dtype, model.device)
        self._warm_up_kernels(text_config)
        self.eos_token_ids = self._eos_token_ids()
        self.scheduler = Scheduler(self.config, self.kv, self.eos_token_ids, self.max_model_len)
        self.runner = ModelRunner(model, self.kv, self.group)
        self._decode = decoder_for(tokenizer) if tokenizer is not None else None
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._forks_pending: set[str] = set()  # requests with n > 1 whose other samples wait for the prompt
        self._generated_tokens = 0
        self._busy_seconds = 0.0
        logger.info("PagedEngine: %d KV blocks of %d tokens (%s, %.2f GiB) on %s, max_model_len %d",
                    num_blocks, self.config.block_size, self.config.kv_cache_dtype,
                    self.kv.stats().kv_cache_bytes / GIB, model.device, self.max_model_len)

    # ----------------------------------------------------------------------------------- setup
    def _blocks_from_memory(self, model, text_config, tp_size: int) -> int:
        """Blocks that fit the KV memory budget (``kv_cache_memory``, else the device default: see
        ``EngineConfig``), capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens can use."""
        if self.config.kv_cache_memory is not None:
            budget = self.config.kv_cache_memory * GIB
        elif model.device.type == "cuda":
            budget = available_memory(model.device) * self.config.gpu_memory_utilization
        else:
            budget = min(DEFAULT_CPU_KV_CACHE_GIB * GIB, available_memory(model.device) / 2)
        per_block = block_id_bytes(text_config, self.config.block_size, self.config.kv_cache_dtype,
                                   local_kv_heads(text_config, tp_size), dtype=model.dtype)
        cap = self.config.max_num_seqs * math.ceil(self.max_model_len / self.config.block_size)
        return max(1, min(int(budget) // per_block, cap))

    def _warm_up_kernels(self, text_config) -> None:
        """On the Triton path, compiles every kernel variant the layers will launch now, so no request waits for a
        compile (one variant per kind of layer: nothing compiled depends on the batch). A model with attention
        sinks compiles its sink variants at its first step."""
        kinds: dict[tuple, object] = {}
        for group in self.kv.groups:
            for storage in group.storages.values():
                if storage.kernels.triton:
                    kinds.setdefault((group.window, storage.kv_format if hasattr(storage, "kv_format") else "auto"),
                                     storage)
        if not kinds:
            return
        from ..kernels.warmup import warmup_kernels  # noqa: PLC0415 - imports triton

        started = time.perf_counter()
        softcap = getattr(text_config, "attn_logit_softcapping", None)
        for (window, _), storage in kinds.items():
            warmup_kernels(storage.attention_operands(), num_heads=text_config.num_attention_heads,
                           dtype=self.model.dtype, sliding_window=window, softcap=softcap,
                           store_dtype=storage.store_dtype,
                           pool_tensors=list(storage.tensors().values()))
        logger.info("compiled the kernels of %d layer kinds in %.1f s", len(kinds), time.perf_counter() - started)

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
        return ids

    # -------------------------------------------------------------------------------- requests
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, cache_salt: str | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> str:
        """Queues a request; raises ``ValueError`` (and queues nothing) for a prompt that can never run.

        ``output_kind`` says what ``step()`` returns for it: everything so far (default), only what is new
        (streaming), or one output when it finishes.
        """
        self._require_leader("add_request")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a paged_hf.SamplingParams, got {type(params).__name__}")
        text, ids = prompt_ids(prompt, self.tokenizer)
        ids = check_prompt_ids(ids, self.vocab_size, self.max_model_len)
        check_params(params, len(ids), self.vocab_size, self.max_model_len, self.config)
        # the longest the sequence can get; its last token is sampled, never stored
        stored = len(ids) + params.max_tokens - 1
        need = self.kv.blocks_to_hold(stored)
        if need > self.kv.num_total_blocks:
            raise ValueError(
                f"the request needs up to {need} blocks ({len(ids)} prompt tokens + max_tokens={params.max_tokens}) "
                f"but the pool has {self.kv.num_total_blocks} (num_blocks): it could never finish; lower max_tokens "
                f"or raise num_blocks"
            )
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        request = Request(request_id, text, ids, params, priority, cache_salt, RequestOutputKind(output_kind))
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        self.requests[request_id] = request
        if params.n > 1:
            self._forks_pending.add(request_id)
        self.scheduler.add(request.sequences[0])
        return request_id

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its blocks; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        self._forks_pending.discard(request_id)
        if request is not None:
            for seq in request.sequences:
                self.scheduler.finish(seq, "abort")

    def _fail(self, request: Request, error: BaseException, touched: dict[str, Request]) -> None:
        touched[request.request_id] = request
        if request.error is not None:
            return
        request.error = error
        for seq in request.sequences:
            self.scheduler.finish(seq, "error")
        logger.warning("request %s failed: %s: %s", request.request_id, type(error).__name__, error)

    def _break(self, error: TensorParallelError, touched: dict[str, Request]) -> None:
        """The tensor-parallel group broke: every request fails with ``error``, and so does every later call."""
        logger.error("the engine cannot run any more: %s", error)
        self._broken = error
        for request in list(self.requests.values()):
            self._fail(request, error, touched)

    def _isolate(self, output: SchedulerOutput, error: BaseException, touched: dict[str, Request]) -> None:
        """The forward of ``output`` raised: re-runs its sequences in halves to find the ones that raise alone, fails
        their requests, and goes on with the others (their logits are those of the full batch)."""
        logger.warning("a forward of %d sequences raised %s: %s; running them in parts to find the cause",
                       len(output.scheduled), type(error).__name__, error)
        result = isolate(self.runner, output, error)
        for index, culprit_error in result.failed:
            self._fail(output.scheduled[index].seq.request, culprit_error, touched)
        for index in result.requeue:
            seq = output.scheduled[index].seq
            if seq.status is SequenceStatus.RUNNING:
                self.scheduler.requeue(seq)
        logger.warning("isolated %d failing sequence(s) in %d forwards; %d recompute their prompt",
                       len(result.failed), result.num_forwards, len(result.requeue))
        merged = result.merged(output, keep=lambda item: item.seq.status is SequenceStatus.RUNNING)
        if merged is not None:
            self._update(*merged, touched)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Runs one iteration; returns the outputs of the requests that progressed or finished (per their
        ``output_kind``)."""
        self._require_leader("step")
        started = time.perf_counter()
        output = self.scheduler.schedule()
        touched: dict[str, Request] = {}
        if output.scheduled:
            try:
                model_output = self.runner.execute(output)
            except TensorParallelError as error:  # no forward can run any more: every request fails
                self.kv.end_step(failed=True)
                self._break(error, touched)
            except BlockCopyError as error:  # every sequence of the step may hold wrong K/V: fail them all
                self.kv.end_step(failed=True)
                for item in output.scheduled:
                    self._fail(item.seq.request, error, touched)
            except Exception as error:  # the forward raised: the requests that cause it fail alone
                self._isolate(output, error, touched)
                self.kv.end_step(failed=True)
            else:
                self.kv.end_step(failed=False)
                self._update(output, model_output, touched)
        self._busy_seconds += time.perf_counter() - started
        return self._outputs(touched)

    def _update(self, output: SchedulerOutput, model_output, touched: dict[str, Request]) -> None:
        """Samples, applies the tokens, and post-processes the sequences that got one."""
        sampled = [item.seq for item in output.scheduled if item.samples]
        rows = list(model_output.sample_rows)
        if self._forks_pending:  # a request with n > 1 whose prompt completes now: its other samples join
            for row, seq in list(zip(rows, sampled)):
                if seq.index == 0 and seq.request.request_id in self._forks_pending:
                    self._forks_pending.discard(seq.request.request_id)
                    for sibling in seq.request.sequences[1:]:
                        if sibling.status is SequenceStatus.FORK_PENDING:
                            sampled.append(sibling)
                            rows.append(row)
        for index, (first, count) in model_output.prompt_rows.items():
            item = output.scheduled[index]
            self._record_prompt_logprobs(item, model_output.logits[first : first + count])
            touched[item.seq.request.request_id] = item.seq.request  # progress, even without a token
        if not sampled:
            self.scheduler.update_from_output(output, [], [])
            return
        logits = model_output.logits
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        result = sample(logits.index_select(0, index), sampled, self._decode_token if self._decode else None,
                        self.eos_token_ids)
        for row, error in result.errors.items():
            self._fail(sampled[row].request, error, touched)
        receiving = [seq.status is not SequenceStatus.FINISHED for seq in sampled]
        self.scheduler.update_from_output(output, sampled, result.token_ids)
        now = time.monotonic()
        final_only = RequestOutputKind.FINAL_ONLY
        for seq, got, entry in zip(sampled, receiving, result.logprobs):
            if not got:
                continue
            request = seq.request
            self._generated_tokens += 1
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if entry is not None:
                seq.logprobs.append(entry)
                seq.cumulative_logprob += entry[seq.token_ids[-1]].logprob
            if self._decode is not None:
                self._process_text(seq)
            if request.output_kind is not final_only or seq.status is SequenceStatus.FINISHED:
                touched[request.request_id] = request

    def _record_prompt_logprobs(self, item, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens after positions ``item.start ..`` (once, even if recomputed later)."""
        request = item.seq.request
        recorded = len(request.prompt_logprobs)  # entries for prompt tokens 0 .. recorded - 1
        targets = request.prompt_token_ids[item.start + 1 : item.start + 1 + logits.shape[0]]
        skip = max(0, recorded - (item.start + 1))
        if skip >= len(targets):
            return
        chosen = torch.tensor(targets[skip:], dtype=torch.long, device=logits.device)
        entries = position_logprobs(logits[skip:], chosen, [request.params.prompt_logprobs] * len(chosen),
                                    self._decode_token if self._decode else None)
        request.prompt_logprobs.extend(entries)

    def _decode_token(self, token_id: int) -> str:
        return self._decode.token_text(token_id)

    def _process_text(self, seq: Sequence) -> None:
        """Extends the text where the request needs it now (streams, stop strings) and applies stop strings; a
        request that only wants its final output is decoded once, when it finishes."""
        if self._decode is None:
            return
        request, params = seq.request, seq.request.params
        per_step = params.stop or request.output_kind is not RequestOutputKind.FINAL_ONLY
        finished = seq.status is SequenceStatus.FINISHED
        if not per_step and not finished:
            return
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self._decode, seq.num_prompt_tokens, seq.token_ids)
        if per_step:
            delta = seq.detokenizer.update(seq.token_ids)
            stop_applies = params.stop and (not finished or seq.finish_reason == "length")
            if stop_applies and delta and seq.num_output_tokens >= params.min_tokens:
                longest = max(len(s) for s in params.stop)
                found = find_stop(seq.detokenizer.text, len(delta), params.stop, longest)
                if found is not None:
                    seq.detokenizer.truncate(found[1])
                    if finished:
                        seq.finish_reason, seq.stop_reason = "stop", found[0]
                    else:
                        self.scheduler.finish(seq, "stop", found[0])
                    return
        if seq.status is SequenceStatus.FINISHED:  # not by a stop string (that returned above)
            seq.detokenizer.finish(seq.token_ids)

    def _outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        outputs = []
        for request in touched.values():
            if request.finished:
                self.requests.pop(request.request_id, None)
                self._forks_pending.discard(request.request_id)
            elif request.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            outputs.append(RequestOutput.of(request))
        return outputs

    # ------------------------------------------------------------------------------- front ends
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, priority: list[int] | None = None,
                 cache_salt: list[str | None] | None = None) -> list[RequestOutput]:
        """Runs ``prompts`` (one or a list) to completion; outputs in prompt order.

        Every prompt is checked before any work starts: one that cannot run (too long, ids outside the vocabulary,
        bad parameters) raises its ``ValueError`` and leaves nothing queued, as ``LLM.generate`` and vLLM do. A
        request that fails while it runs (a logits processor that raises, NaN logits, a failed step) fails alone:
        its output has ``error`` set and ``finish_reason == "error"``, and the others complete.
        ``priority`` / ``cache_salt``: one per prompt, as ``add_request``'s.

        Under tensor parallelism every rank may call it (as under ``torchrun``): the leader runs the prompts it was
        given, the followers run the leader's steps, and every rank returns the leader's outputs."""
        if self.group is not None and not self.group.is_leader:
            return parallel.follow(self, until_done=True)
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"params has {len(params_list)} entries for {len(prompts)} prompts")
        for name, values in (("priority", priority), ("cache_salt", cache_salt)):
            if values is not None and len(values) != len(prompts):
                raise ValueError(f"{name} has {len(values)} entries for {len(prompts)} prompts")
        priorities = priority if priority is not None else [0] * len(prompts)
        salts = cache_salt if cache_salt is not None else [None] * len(prompts)
        order: list[str] = []
        try:
            for prompt, p, rank, salt in zip(prompts, params_list, priorities, salts):
                order.append(self.add_request(prompt, p, output_kind=RequestOutputKind.FINAL_ONLY, priority=rank,
                                              cache_salt=salt))
        except Exception:
            for request_id in order:
                self.abort(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        pending = set(order)
        bar = _progress(len(order), use_tqdm)
        while pending and self.has_unfinished_requests():
            for out in self.step():
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    results[out.request_id] = out
                    bar.update(1)
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
        try:
            while True:
                outputs = {o.request_id: o for o in self.step()}
                out = outputs.get(request_id)
                if out is not None:
                    if out.outputs[0].text:
                        yield out.outputs[0].text
                    if out.finished:
                        if out.error:
                            raise RuntimeError(out.error)
                        return
        finally:
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
        tokenizer = _load_tokenizer(model, tokenizer)
        if tensor_parallel_size == 1:
            from transformers import AutoModelForCausalLM  # noqa: PLC0415

            return cls(AutoModelForCausalLM.from_pretrained(model, **model_kwargs).eval(), tokenizer, **options)
        EngineConfig(**options)  # bad options fail here, before any process starts
        loaded, executor = parallel.start_tensor_parallel(model, tensor_parallel_size, distributed_executor_backend,
                                                          model_kwargs, options, distributed_timeout)
        try:
            engine = cls(loaded, tokenizer, **options)
        except BaseException:
            executor.shutdown(timeout_s=5)
            raise
        engine.runner.executor, engine._timeout_s = executor, distributed_timeout
        return engine

    def follow(self) -> None:
        """A follower rank: runs the leader's steps until the leader's ``shutdown()``."""
        if self.group is None or self.group.is_leader:
            raise RuntimeError("follow() is for the follower ranks of a tensor-parallel engine (rank > 0)")
        parallel.follow(self)

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
            torch.distributed.destroy_process_group()

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
            generated_tokens=self._generated_tokens,
            generation_tokens_per_s=self._generated_tokens / self._busy_seconds if self._busy_seconds else 0.0,
            tensor_parallel_size=self.group.size if self.group is not None else 1,
        )

    def check_invariants(self) -> None:
        self.kv.check_invariants()


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


def _load_tokenizer(model: str, tokenizer):
    """``tokenizer`` as given, loaded from its path if a string, or from the model's folder if None (a model
    without tokenizer files runs on token ids)."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    if isinstance(tokenizer, str):
        return AutoTokenizer.from_pretrained(tokenizer)
    if tokenizer is not None:
        return tokenizer
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError, TypeError) as error:
        logger.info("no tokenizer found with %s (%s): prompts must be token ids", model, error)
        return None
