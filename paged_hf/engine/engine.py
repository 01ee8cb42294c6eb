"""``PagedEngine``: continuous batching over a stock transformers model.

One ``step()`` = schedule -> one forward of every scheduled sequence -> sample -> stop checks. Requests join
and leave at every step; blocks are freed the moment a sequence finishes, aborts or fails.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Iterator

import torch

from ..cache import PagedCache
from ..config import DEFAULT_CPU_KV_CACHE_GIB, EngineConfig, SamplingParams
from .engine_cache import EngineCache
from .kv_manager import KVCacheManager
from .request import Request, RequestOutput, Sequence, SequenceStatus
from .runner import ModelRunner
from .sampler import sample
from .scheduler import Scheduler

GIB = 1 << 30


class PagedEngine:
    """Serves many requests at once on ``model`` (any decoder-only transformers model).

    Args:
        model: a loaded ``PreTrainedModel``; its attention is switched to ``"paged"``.
        tokenizer: needed for string prompts, chat messages, ``stop`` strings and output text.
        **options: ``EngineConfig`` fields (``block_size``, ``kv_cache_dtype``, ``max_num_seqs``, ...).
    """

    def __init__(self, model, tokenizer=None, **options) -> None:
        self.config = EngineConfig(**options)
        if getattr(model.config, "is_encoder_decoder", False):
            raise NotImplementedError(f"PagedEngine serves decoder-only models; {type(model).__name__} is not")
        if model.config._attn_implementation != "paged":
            model.set_attn_implementation("paged")
        self.model = model.eval()
        self.tokenizer = tokenizer
        text_config = model.config.get_text_config(decoder=True)
        self.max_model_len = self.config.max_model_len or getattr(text_config, "max_position_embeddings", 4096)
        num_blocks = self.config.num_blocks or self._blocks_from_memory(model)
        self.cache = EngineCache(model.config, self.config.block_size, num_blocks, self.config.kv_cache_dtype,
                                 model.dtype, model.device)
        self.kv = KVCacheManager(self.cache, self.config.enable_prefix_caching, int(self.config.swap_space * GIB))
        self.scheduler = Scheduler(self.config, self.kv)
        self.runner = ModelRunner(model, self.cache)
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = self._eos_token_ids()
        self._ids = itertools.count()
        self._generated_tokens = 0
        self._busy_seconds = 0.0

    # ----------------------------------------------------------------------------------- setup
    def _blocks_from_memory(self, model) -> int:
        """Blocks that fit the KV memory budget (``kv_cache_memory``, else the device default: see
        ``EngineConfig``), capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens can use."""
        if self.config.kv_cache_memory is not None:
            budget = self.config.kv_cache_memory * GIB
        elif model.device.type == "cuda":
            budget = torch.cuda.mem_get_info(model.device)[0] * self.config.gpu_memory_utilization
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(DEFAULT_CPU_KV_CACHE_GIB * GIB, available / 2)
        probe = PagedCache(model.config, block_size=self.config.block_size, kv_cache_dtype=self.config.kv_cache_dtype)
        per_block = sum(probe.block_bytes(i) for i in range(len(probe.layers)))
        cap = self.config.max_num_seqs * math.ceil(self.max_model_len / self.config.block_size)
        return max(1, min(int(budget) // per_block, cap))

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
        return ids

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        if self.tokenizer is None:
            raise ValueError("a tokenizer is needed for text or chat prompts: PagedEngine(model, tokenizer)")
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
            return text, self.tokenizer(text, add_special_tokens=False)["input_ids"]
        raise ValueError(f"prompt must be a string, a list of token ids or a list of chat messages, got {prompt!r}")

    # -------------------------------------------------------------------------------- requests
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> str:
        """Queues a request; raises ``ValueError`` (and queues nothing) for a prompt that can never run."""
        params = params or SamplingParams()
        text, ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room to generate")
        # the longest the sequence can get; its last token is sampled, never stored
        stored = max(len(ids), min(len(ids) + params.max_tokens, self.max_model_len) - 1)
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
        request = Request(request_id, text, ids, params, priority, cache_salt)
        self.requests[request_id] = request
        self.scheduler.add(request.sequences[0])
        return request_id

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its blocks; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            for seq in request.sequences:
                self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        if seq.status is SequenceStatus.FINISHED:
            return
        self.scheduler.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.request.finished:
            seq.request.metrics.finished_time = time.monotonic()

    def _fail(self, request: Request, error: BaseException) -> None:
        request.error = error
        for seq in request.sequences:
            self._finish(seq, "error")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Runs one iteration; returns the outputs of the requests that progressed or finished."""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        touched: dict[str, Request] = {}
        if plan.scheduled:
            try:
                seqs, logits = self.runner.execute(plan.scheduled)
            except Exception as error:  # the forward failed: fail this batch's requests, keep the engine
                self.kv.end_step(failed=True)
                for seq, _, _ in plan.scheduled:
                    self._fail(seq.request, error)
                    touched[seq.request.request_id] = seq.request
                seqs, logits = [], None
            else:
                self.kv.end_step(failed=False)
            for seq, count, _ in plan.scheduled:
                if seq.status is SequenceStatus.RUNNING:
                    seq.num_computed_tokens += count
            for row, (seq, result) in enumerate(zip(seqs, sample(seqs, logits) if seqs else [])):
                touched[seq.request.request_id] = seq.request
                if result.error is not None:
                    self._fail(seq.request, result.error)
                elif seq.status is SequenceStatus.RUNNING:
                    if seq.index == 0:
                        self._fork_pending(seq, logits[row])
                    self._append(seq, result)
        self._busy_seconds += time.perf_counter() - started
        outputs = []
        for request in touched.values():
            outputs.append(RequestOutput.of(request))
            if request.finished:
                self.requests.pop(request.request_id, None)
        return outputs

    def _fork_pending(self, leader: Sequence, logits: torch.Tensor) -> None:
        """After sample 0's prompt is computed, samples 1..n-1 share its blocks and sample from its logits."""
        for sibling in leader.request.sequences[1:]:
            if sibling.status is SequenceStatus.FORK_PENDING:
                self.kv.fork(leader, sibling)
                sibling.status = SequenceStatus.RUNNING
                self.scheduler.running.append(sibling)
                (result,) = sample([sibling], logits.unsqueeze(0))
                if result.error is not None:
                    self._fail(sibling.request, result.error)
                    return
                self._append(sibling, result)

    def _append(self, seq: Sequence, result) -> None:
        request, params = seq.request, seq.request.params
        seq.token_ids.append(result.token_id)
        self._generated_tokens += 1
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = time.monotonic()
        if params.logprobs is not None:
            seq.logprobs.append({"token_id": result.token_id, "logprob": result.logprob, "top": result.top_logprobs})
        num_output = len(seq.output_token_ids)
        if self.tokenizer is not None:
            seq.output_text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        token = result.token_id
        if token in params.stop_token_ids:
            return self._finish(seq, "stop", token)
        if not params.ignore_eos and token in self.eos_token_ids and num_output >= params.min_tokens:
            return self._finish(seq, "stop", None)
        for stop in params.stop:
            at = seq.output_text.find(stop)
            if at >= 0 and num_output >= params.min_tokens:
                seq.output_text = seq.output_text[:at]
                return self._finish(seq, "stop", stop)
        if num_output >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return self._finish(seq, "length")
        return None

    # ------------------------------------------------------------------------------- front ends
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs ``prompts`` (one or a list) to completion; outputs in prompt order. A prompt that cannot run
        gets an output with ``error`` set and the others proceed."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"params has {len(params_list)} entries for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, p in zip(prompts, params_list):
            try:
                order.append(self.add_request(prompt, p))
            except ValueError as error:
                failed = Request(f"rejected-{next(self._ids)}", prompt if isinstance(prompt, str) else None, [],
                                 p or SamplingParams())
                self._fail(failed, error)
                order.append(failed.request_id)
                results[failed.request_id] = RequestOutput.of(failed)
        bar = _progress(len(order) - len(results), use_tqdm)
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in order]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yields the text of sample 0 as it grows (deltas); other queued requests progress meanwhile."""
        request_id = self.add_request(prompt, params)
        sent = 0
        try:
            while True:
                outputs = {o.request_id: o for o in self.step()}
                out = outputs.get(request_id)
                if out is not None:
                    text = out.outputs[0].text
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)
                    if out.finished:
                        if out.error:
                            raise RuntimeError(out.error)
                        return
        finally:
            self.abort(request_id)

    def get_stats(self) -> dict:
        groups = self.cache.groups
        used = sum(g.pool.num_used_blocks for g in groups)
        total = sum(g.pool.num_blocks for g in groups)
        block_bytes = sum(self.cache.block_bytes(i) for i in range(len(self.cache.layers))) // len(groups)
        queried = self.kv.prefix_queried_tokens
        return {
            "kv_cache_used": used,
            "kv_cache_total": total,
            "kv_cache_utilization": used / total if total else 0.0,
            "kv_cache_bytes_used": used * block_bytes,
            "kv_cache_cached_blocks": sum(g.pool.num_cached_blocks for g in groups),
            "prefix_cache_hit_rate": self.kv.prefix_hit_tokens / queried if queried else 0.0,
            "preemption_count": self.scheduler.num_preemptions,
            "num_swapped_out": self.scheduler.num_swapped_out,
            "num_swapped_in": self.scheduler.num_swapped_in,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
            "generated_tokens": self._generated_tokens,
            "generation_tokens_per_s": self._generated_tokens / self._busy_seconds if self._busy_seconds else 0.0,
        }

    def check_invariants(self) -> None:
        live = [s for r in self.requests.values() for s in r.sequences if s.status is not SequenceStatus.FINISHED]
        self.kv.check_invariants(live)


def _progress(total: int, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        enabled = False
    if not enabled:
        class _Silent:
            def update(self, n): pass
            def close(self): pass
        return _Silent()
    return tqdm(total=total, desc="requests", unit="req")
