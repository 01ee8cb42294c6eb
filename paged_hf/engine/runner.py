"""The engine's runner: one forward of the stock HF model over every scheduled sequence, then sampling.

The scheduled tokens are laid back to back in one row (``input_ids`` ``[1, T]``) with each token's own position;
the ``AttentionMetadata`` (built once, on the model's device) tells the ``"paged"`` attention which tokens belong to
which sequence and where their blocks are. Only the rows whose next token is sampled get logits
(``logits_to_keep``), plus the prompt positions of requests that asked for prompt logprobs. ``execute`` returns a
``RunnerOutput`` (the sampled tokens, logprobs, prompt logprobs and the requests that failed) and changes no request
or sequence: the scheduler applies it. A forward that raises is run again in parts to find the sequences that
cause it (``isolation``); under tensor parallelism the followers run every forward the leader plans (``run``).
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass, field

import torch
from torch._dynamo.utils import counters

from ..distributed.group import TensorParallelError
from ..kv.manager import KVManager
from ..metadata import (AttentionMetadata, build_metadata, decode_metadata, handed_steps,
                        long_tensor)
from .compile import CompiledForward, CompileFailed
from .cuda_graphs import DecodeGraphs, GraphOptions
from .decode_batch import DecodeBatch
from .forward_cache import EngineCache
from .isolation import isolate
from .model_output import ModelOutput
from .image_encoder import ImageEncoder
from .multimodal import image_token_id
from .request import PositionLogprobs, Request, Sequence
from .scratch import ScratchForwards
from .sampler import SamplerOutput, position_logprobs, sample
from .scheduled import ScheduledSequence, SchedulerOutput
from .spec.verify import VerifiedRun, verify

logger = logging.getLogger("paged_hf")


@dataclass
class RunnerOutput:
    """What one step gave, for the scheduler to apply. ``seqs[i]`` drew ``token_ids[i]`` (with ``logprobs[i]``
    when its request asked for them; the samples of an ``n > 1`` request whose prompt completed are among them);
    ``prompt_logprobs``: per scheduled sequence that asked, the entries of its chunk's prompt positions;
    ``verified``: the sequences that ran speculative drafts, with the tokens they emit (not in ``seqs``).
    ``batch``: the step ran from the persistent decode batch (advanced: its ``token_ids`` are the ones drawn).
    ``errors``: requests that fail alone (their forward or their sampling raised); ``requeue``: sequences whose
    prefix a failed sequence of the step was to write (they compute their prompt again); ``retried``: the forward
    raised and ran again in parts. ``step_error``: nothing of the step ran (its block copies failed, or, with
    ``broken``, the tensor-parallel group broke)."""

    seqs: list[Sequence] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[tuple[ScheduledSequence, list[PositionLogprobs]]] = field(default_factory=list)
    errors: list[tuple[Request, BaseException]] = field(default_factory=list)
    verified: list[VerifiedRun] = field(default_factory=list)  # sequences whose speculative drafts were verified
    requeue: list[Sequence] = field(default_factory=list)
    retried: bool = False
    step_error: BaseException | None = None
    broken: bool = False
    batch: DecodeBatch | None = None  # the step ran from the persistent decode batch: ``seqs`` are its rows


class BlockCopyError(RuntimeError):
    """The step's block copies (copy-on-write, swap) failed: any sequence of the step may hold wrong K/V."""


@dataclass
class StepInput:
    """What every rank needs to run one forward: the packed token ids ``[T]``, the attention metadata, the rows of
    logits to keep and the block copies to run first. Built by the leader (``ModelRunner.plan``); under tensor
    parallelism it is broadcast, with its tensors on the CPU, and each rank moves it to its device.
    ``image_inputs``: a step that computes image tokens (one process only) runs eagerly on these model keywords
    (``ImageEncoder.step_inputs``) instead of ``input_ids``; ``position_ids`` ``[3, T]``: a step with M-RoPE
    requests (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) runs eagerly on these instead of the metadata's positions."""

    input_ids: torch.Tensor
    metadata: AttentionMetadata
    keep: torch.Tensor
    copies: list = field(default_factory=list)
    num_rows: int = 0  # the leader's block-table rows (a follower gives its tail formats as many tail rows)
    image_inputs: dict | None = None
    position_ids: torch.Tensor | None = None


class ModelRunner:
    """Runs the engine's forwards. ``group``: the tensor-parallel group, whose other ranks run every forward the
    leader plans (the runner broadcasts each ``StepInput`` before running it); None on one process."""

    def __init__(self, model, kv: KVManager, group=None, executor=None, eos_token_ids=frozenset(),
                 token_text=None, compile: bool = False, graphs: GraphOptions | None = None) -> None:
        """``executor``: the follower processes this process started (``PagedEngine.from_pretrained``), checked
        before each broadcast; ``eos_token_ids``: what ``min_tokens`` holds back; ``token_text(id) -> str``: names
        logprob entries (None: no names); ``compile``: run the forward compiled (``engine.compile``), warmed up
        here; a model that does not compile runs eagerly, with a warning; ``graphs``: run decode-only steps at
        bucketed sizes through static buffers (``engine.cuda_graphs``), captured as CUDA graphs after the warm-up
        when ``graphs.capture``."""
        self.model = model
        self.kv = kv
        self.cache = EngineCache(kv)
        self.device = model.device
        self.group = group
        self.executor = executor
        self.eos_token_ids = eos_token_ids
        self.token_text = token_text
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        self.last_broadcast = time.monotonic()
        scratch = ScratchForwards(kv, model.dtype, self.device)  # the start probe's and the warm-up's pools
        self._probe(scratch)
        self.compiled: CompiledForward | None = self._compile(scratch) if compile else None
        self.graphs: DecodeGraphs | None = None
        if graphs is not None:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(kv, self._static_forward, graphs, self.device)
        self.images = ImageEncoder(model) if image_token_id(model) is not None else None
        self.batch: DecodeBatch | None = None  # the last step's, when it was a steady decode step

    @torch.inference_mode()
    def _probe(self, scratch: ScratchForwards) -> None:
        """One eager forward on scratch pools (a decode beside a prefill chunk) before anything is served: a model
        whose attention does not read the paged blocks (``AttentionBypassed``: it computes attention in its own
        code, or changes its K/V after storing them), or whose forward adds layers to its cache (looped layers), is
        refused here, by name, instead of serving wrong tokens."""
        num_layers = len(scratch.cache.layers)
        error = None
        with scratch.step((3, 0), (1, 3), 1, self.no_mask, self.keeps_logits) as (_, inputs):
            try:
                self._eager(inputs)
            except Exception as raised:  # noqa: BLE001 - which refusal it is, is decided below
                error = raised
        name = type(self.model).__name__
        if len(scratch.cache.layers) != num_layers:  # whether or not the forward got through
            raise NotImplementedError(
                f"PagedEngine cannot serve {name}: its forward adds layers to the cache ({num_layers} -> "
                f"{len(scratch.cache.layers)}: copies of cache layers for the layers it runs more than once, as "
                f"Dory's loops do), which the engine's pools, one per decoder layer, do not hold") from error
        if isinstance(error, NotImplementedError):  # AttentionBypassed, or what the cache refuses (a layer copied)
            raise NotImplementedError(f"PagedEngine cannot serve {name}: {error}") from error
        if error is not None:
            raise error

    def _compile(self, scratch: ScratchForwards) -> CompiledForward | None:
        graphs = counters["stats"]["unique_graphs"]
        try:
            compiled = CompiledForward(self.model)
            logger.info("PagedEngine: compiling the forward of %s (torch.compile, %s; enforce_eager=True skips it)",
                        type(self.model).__name__, compiled.backend)
            seconds = compiled.warm_up(scratch, self.keeps_logits, self.no_mask)
        except CompileFailed as error:
            logger.warning("PagedEngine: torch.compile cannot compile %s (%s); the engine runs it eagerly",
                           type(self.model).__name__, error)
            return None
        logger.info("PagedEngine: compiled the forward in %.1f s (%d new graph(s))", seconds,
                    counters["stats"]["unique_graphs"] - graphs)
        return compiled

    def plan(self, output: SchedulerOutput, copies: list, persistent: bool = False) -> tuple[
            StepInput, list[int], dict[int, tuple[int, int]], dict[int, tuple[int, int]]]:
        """The ``StepInput`` of ``output``'s forward (host work only), and where its logits go: the rows of the
        sampling sequences, in scheduled order, per prompt-logprob sequence ``(first row, count)``, and per
        sequence with speculative drafts ``(first row, 1 + k)``. ``persistent``: the step is the engine's (not a
        part of one, as isolation runs): it uses and sets ``self.batch`` (a steady decode step reads its tensors)."""
        if persistent:
            if self.batch is not None and self.batch.matches(output):
                return self._plan_batch(self.batch, copies)
            self.batch = DecodeBatch.of(output)
        scheduled = output.scheduled
        d = output.num_decodes
        input_ids = [item.seq.token_ids[item.start] for item in scheduled[:d]]
        for item in scheduled[d:]:
            if item.draft_token_ids:
                input_ids.append(item.seq.token_ids[item.start])
                input_ids.extend(item.draft_token_ids)
            else:
                input_ids.extend(item.seq.token_ids[item.start : item.start + item.num_tokens])
        device = "cpu" if self.group is not None else self.device  # broadcast from the host, then moved
        metadata = build_metadata(
            self.kv, [item.seq.kv for item in scheduled], [item.start for item in scheduled],
            [item.num_tokens for item in scheduled], d, device,
        )
        ends = metadata.query_start_loc[1:] - 1  # [S]: each sequence's last token row
        sample_index = [i for i, item in enumerate(scheduled) if item.samples and not item.draft_token_ids]
        keep_rows = [ends if len(sample_index) == len(scheduled)
                     else ends[long_tensor(sample_index).to(ends.device)]]
        prompt_rows: dict[int, tuple[int, int]] = {}
        first = len(sample_index)
        scoring = [i for i, item in enumerate(scheduled) if item.seq.request.params.prompt_logprobs is not None]
        for i in scoring:
            item = scheduled[i]
            if item.seq.index == 0:
                count = _prompt_positions(item)
                if count:
                    start = int(metadata.query_start_loc[i])
                    keep_rows.append(torch.arange(start, start + count, device=ends.device))
                    prompt_rows[i] = (first, count)
                    first += count
        draft_rows: dict[int, tuple[int, int]] = {}
        for i, item in enumerate(scheduled[d:], start=d):
            if item.draft_token_ids:
                start = int(metadata.query_start_loc[i])
                keep_rows.append(torch.arange(start, start + item.num_tokens, device=ends.device))
                draft_rows[i] = (first, item.num_tokens)
                first += item.num_tokens
        keep = torch.cat(keep_rows) if len(keep_rows) > 1 else keep_rows[0]
        step = StepInput(long_tensor(input_ids), metadata, keep, copies, self.kv.num_rows)
        return step, list(range(len(sample_index))), prompt_rows, draft_rows

    def _plan_batch(self, batch: DecodeBatch, copies: list) -> tuple[StepInput, list[int], dict, dict]:
        """``plan`` of a steady decode step, from the persistent batch's tensors (no pass over the sequences)."""
        device = "cpu" if self.group is not None else self.device
        metadata = decode_metadata(self.kv, batch.rows, batch.positions, batch.longest, device,
                                   layout=batch.layout)
        keep = metadata.token_seqs  # [S]: row s is sequence s's only token
        step = StepInput(batch.token_ids, metadata, keep, copies, self.kv.num_rows)
        return step, list(range(len(batch.seqs))), {}, {}

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """Runs the step's block copies, then its forward, and samples every row at once."""
        try:
            model_output = self._run_planned(output, output.copies, persistent=True)
        except TensorParallelError as error:  # no forward can run any more
            self.batch = None
            return RunnerOutput(step_error=error, broken=True)
        except BlockCopyError as error:  # every sequence of the step may hold wrong K/V
            self.batch = None
            return RunnerOutput(step_error=error)
        except Exception as error:  # noqa: BLE001 - the forward raised: the sequences that cause it fail alone
            self.batch = None
            return self._isolate(output, error)
        return self._sample(output, model_output, self.batch)

    def _isolate(self, output: SchedulerOutput, error: BaseException) -> RunnerOutput:
        logger.warning("a forward of %d sequences raised %s: %s; running them in parts to find the cause",
                       len(output.scheduled), type(error).__name__, error)
        try:
            found = isolate(self.forward, self.kv, output, error)
        except TensorParallelError as broken:
            return RunnerOutput(step_error=broken, broken=True)
        failed = {id(output.scheduled[i].seq.request): (output.scheduled[i].seq.request, e) for i, e in found.failed}
        requeue = [output.scheduled[i].seq for i in found.requeue]
        logger.warning("isolated %d failing sequence(s) in %d forwards; %d recompute their prompt",
                       len(found.failed), found.num_forwards, len(requeue))
        requeued = {id(seq) for seq in requeue}
        merged = found.merged(output, keep=lambda item: id(item.seq.request) not in failed
                              and id(item.seq) not in requeued)
        result = self._sample(*merged) if merged is not None else RunnerOutput()
        result.errors = list(failed.values()) + result.errors
        result.requeue, result.retried = requeue, True
        return result

    def _sample(self, output: SchedulerOutput, model_output: ModelOutput, batch: DecodeBatch | None = None
                ) -> RunnerOutput:
        """Draws the next token of every sampling sequence (and of the samples joining a completed prompt) from
        their rows, and scores the prompt positions of the sequences that asked for prompt logprobs. ``batch``:
        the step's persistent decode batch (its rows are every kept row, in order), advanced here."""
        if batch is not None:
            drawn = sample(model_output.logits, batch.seqs, self.token_text, self.eos_token_ids, batch.summary)
            if not drawn.errors:
                ran = batch.token_ids is not None  # it ran the step (else it was built from the sequences)
                batch.advance(drawn.token_ids, drawn.token_tensor)
                return RunnerOutput(batch.seqs, drawn.token_ids, drawn.logprobs, batch=batch if ran else None)
            self.batch = None  # the rows that failed leave: the next step rebuilds it
            return _without_failed(batch.seqs, drawn, RunnerOutput())  # drawn once: seeded generators step once
        result = RunnerOutput()
        logits = model_output.logits
        failed: set[int] = set()  # requests whose prompt logits are not finite: they fail, and draw nothing
        for index, (first, count) in model_output.prompt_rows.items():
            item = output.scheduled[index]
            request = item.seq.request
            rows = logits[first : first + count]
            if bool(torch.isnan(rows).any()) or bool(torch.isposinf(rows).any()):
                failed.add(id(request))
                result.errors.append((request, ValueError(
                    f"the model's logits at prompt positions {item.start}..{item.start + count - 1} hold NaN or "
                    f"+inf: their prompt_logprobs cannot be computed")))
                continue
            targets = request.prompt_token_ids[item.start + 1 : item.start + 1 + count]
            chosen = torch.tensor(targets, dtype=torch.long, device=logits.device)
            params = request.params
            entries = position_logprobs(rows, chosen, [params.prompt_logprobs] * count,
                                        self.token_text if params.detokenize else None)
            result.prompt_logprobs.append((item, entries))
        if model_output.draft_rows:
            runs = [(output.scheduled[i].seq, output.scheduled[i].start, output.scheduled[i].draft_token_ids, first)
                    for i, (first, _) in model_output.draft_rows.items()]
            result.verified, errors = verify(logits, runs, self.token_text, self.eos_token_ids)
            result.errors.extend(errors)
        sampling = [item for item in output.scheduled if item.samples and not item.draft_token_ids]
        seqs, rows = [item.seq for item in sampling], model_output.sample_rows
        if failed or any(item.forks for item in sampling):  # forks draw from their prompt's row; failed: nothing
            seqs, rows = [], []
            for item, row in zip(sampling, model_output.sample_rows):
                if id(item.seq.request) in failed:
                    continue
                seqs.append(item.seq)
                rows.append(row)
                for fork in item.forks:
                    seqs.append(fork)
                    rows.append(row)
        if not seqs:
            return result
        if len(rows) == logits.shape[0] and rows == list(range(len(rows))):  # every kept row samples, in order
            picked = logits
        else:
            picked = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
        return _without_failed(seqs, sample(picked, seqs, self.token_text, self.eos_token_ids), result)

    @torch.inference_mode()
    def forward(self, output: SchedulerOutput) -> ModelOutput:
        """The forward of ``output``'s sequences (its block copies must have run); the logits the step needs."""
        return self._run_planned(output, [])

    def _run_planned(self, output: SchedulerOutput, copies: list, persistent: bool = False) -> ModelOutput:
        step, sample_rows, prompt_rows, draft_rows = self.plan(output, copies, persistent)
        if self.images is not None:  # the vision tower runs here, for the images this step's tokens need
            step.image_inputs = self.images.step_inputs(output.scheduled, step.input_ids,
                                                        step.metadata.query_start_loc)
            step.position_ids = self.images.positions(output.scheduled, step.metadata.positions,
                                                      step.metadata.query_start_loc)
            step.metadata.pad_queries = self.images.bidirectional_queries(output.scheduled, step.metadata)
        self.broadcast(("step", step))
        logits = self.run(step)
        if step.image_inputs is not None:
            self.images.release(output.scheduled)
        return ModelOutput(logits, sample_rows, prompt_rows, draft_rows)

    def broadcast(self, message) -> None:
        """Sends ``message`` to the other ranks (tensor parallelism), after checking they are alive."""
        if self.group is None:
            return
        if self.executor is not None:
            self.executor.check()
        self.group.broadcast(message)
        self.last_broadcast = time.monotonic()

    def _check_group(self, error: BaseException) -> None:
        """``TensorParallelError`` if ``error`` (raised by a forward) comes from a broken group: a follower this
        process started has died, or a collective failed."""
        if self.group is None:
            return
        if self.executor is not None:
            self.executor.check()
        if isinstance(error, torch.distributed.DistError):
            raise TensorParallelError(f"a collective of the forward failed: {error}") from error

    @torch.inference_mode()
    def run(self, step: StepInput) -> torch.Tensor:
        """Runs ``step`` on this rank: its block copies, then the forward; the kept logits ``[R, vocab]``."""
        self.kv.cover_rows(step.num_rows)
        try:
            self.kv.apply_copies(step.copies)
        except Exception as error:
            raise BlockCopyError(f"the step's block copies failed: {type(error).__name__}: {error}") from error
        metadata = step.metadata if step.metadata.device == self.device else step.metadata.to(self.device)
        on_host = self.device.type == "cpu"  # the step's tensors are there: no ``.to`` (a dispatched op each)
        keep = step.keep if on_host else step.keep.to(self.device, non_blocking=True)
        attention = self.model.config._attn_implementation
        if attention != "paged":  # another user of the model switched it: the engine's forward reads the blocks
            logger.warning("the engine's model was switched to attn_implementation=%r; switching it back to 'paged' "
                           "for the engine's forward", attention)
            self.model.set_attn_implementation("paged")
        eager = step.image_inputs is not None or step.position_ids is not None
        if step.image_inputs is None:
            input_ids = step.input_ids if on_host else step.input_ids.to(self.device, non_blocking=True)
            tokens = dict(input_ids=input_ids.unsqueeze(0))
            if self.graphs is not None and not eager:  # a decode-only step that fits a bucket runs there
                logits = self.graphs.run(tokens["input_ids"][0], metadata, keep)
                if logits is not None:
                    return logits
        else:
            tokens = step.image_inputs
        self.cache.metadata = metadata
        kwargs = {"logits_to_keep": keep} if self.keeps_logits else {}
        positions = metadata.positions.unsqueeze(0) if step.position_ids is None else step.position_ids.unsqueeze(1)
        inputs = dict(**tokens, position_ids=positions, cache=self.cache, attention_mask=self.no_mask, use_cache=True,
                      **kwargs)
        states = self.kv.recurrent  # the recurrent layers' writes land only when the forward returned
        try:
            out = self._eager(inputs) if eager else self._forward(metadata, inputs)
        except Exception as error:
            if states is not None:
                states.discard()
            self._check_group(error)
            raise
        finally:
            self.cache.metadata = None
        if states is not None:
            states.commit()
        return out.logits[0] if self.keeps_logits else out.logits[0, keep]

    def _static_forward(self, bucket) -> torch.Tensor:
        """The forward of a ``StaticDecode`` bucket's inputs (``DecodeGraphs`` runs or captures it): logits ``[B,
        vocab]``, one per row."""
        self.cache.metadata = bucket.metadata
        kwargs = {"logits_to_keep": bucket.keep} if self.keeps_logits else {}
        inputs = dict(input_ids=bucket.input_ids, position_ids=bucket.position_ids, cache=self.cache,
                      attention_mask=self.no_mask, use_cache=True, **kwargs)
        try:
            return self._forward(bucket.metadata, inputs).logits[0]
        finally:
            self.cache.metadata = None

    def _forward(self, metadata: AttentionMetadata, inputs: dict):
        if self.compiled is not None:
            try:
                with handed_steps():
                    return self.compiled(self.cache, metadata, **inputs)
            except CompileFailed as error:  # before anything of the forward ran: run it eagerly, from now on
                logger.warning("PagedEngine: torch.compile failed on a forward of %d tokens (%s); the engine runs "
                               "eagerly from now on", metadata.num_tokens, error)
                self.compiled = None
        return self._eager(inputs)

    def _eager(self, inputs: dict):
        """The model's own forward (``handed_steps``: a layer that updates its cache without kwargs)."""
        with handed_steps():
            return self.model(**inputs)


def _prompt_positions(item) -> int:
    """Prompt positions of this chunk whose next token is a prompt token (their logits score the prompt)."""
    prompt_len = len(item.seq.request.prompt_token_ids)
    return max(0, min(item.start + item.num_tokens, prompt_len - 1) - item.start)


def _without_failed(seqs: list[Sequence], drawn: SamplerOutput, result: RunnerOutput) -> RunnerOutput:
    """``result`` with ``drawn``'s tokens of ``seqs`` (``drawn``'s row ``r`` is ``seqs[r]``'s), less every request
    one of whose rows failed: those go to its errors."""
    if not drawn.errors:
        result.seqs, result.token_ids, result.logprobs = seqs, drawn.token_ids, drawn.logprobs
        return result
    failed = {id(seqs[row].request): seqs[row].request for row in drawn.errors}
    for row, error in drawn.errors.items():
        result.errors.append((seqs[row].request, error))
    for seq, token, entry in zip(seqs, drawn.token_ids, drawn.logprobs):
        if id(seq.request) not in failed:
            result.seqs.append(seq)
            result.token_ids.append(token)
            result.logprobs.append(entry)
    return result
