"""CUDA graphs of the engine's decode-only steps, one per bucket size (vLLM's ``cudagraph_mode="FULL_DECODE_ONLY"``).

At engine start (after the compile warm-up) each bucket's forward over its static buffers (``static_decode.py``) is
warmed up on a side stream and captured into a ``torch.cuda.CUDAGraph``, the largest bucket first, every graph in
one shared memory pool. A decode-only step of ``S`` sequences then takes the smallest bucket ``B >= S``: its rows
are copied into the bucket's buffers and the graph is replayed; the logits of its kept rows are copied out. Other
steps (prefill, mixed, speculative verification, images) run the compiled forward without a graph.

What the captured region runs is capture-safe: the compiled (or eager) model over static tensors, the KV store and
the paged attention ops on their Triton path, with no host sync inside: the decode kernel takes its partition count
from the table width, int4's fill and tail kernels take fixed-size plans (padded fills, tail slots of -1 skipped on
the device), and the one host value the attention op reads (the decode count, a ``[1]`` CPU tensor) is the
bucket's constant ``B`` (a bucket is decode-only by construction).
The pools are baked into the graphs: a tail format's tail pools grow with the sequence rows (``ensure_tail_rows``;
the capture makes rows for the largest bucket first), and the graphs are captured again when they moved. A capture
that fails logs a warning and the engine runs those steps as any other, unpadded and without graphs: never a
crash.

``PAGED_HF_STATIC_DECODE=1`` (read at engine start) runs decode-only steps through the padded static buffers
without capturing, on any device: the CPU tests prove the padding with it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..kv.manager import KVManager
from ..metadata import AttentionMetadata
from .static_decode import StaticDecode, add_scratch_blocks, capture_sizes

logger = logging.getLogger("paged_hf")

STATIC_DECODE_ENV = "PAGED_HF_STATIC_DECODE"
WARMUP_RUNS = 2  # forwards of a bucket on the side stream before its capture (compiles, autotunes, allocates)


class GraphOptions(NamedTuple):
    """How the runner runs decode-only steps: at ``sizes`` (ascending), tables as wide as ``max_model_len`` needs;
    ``capture``: as CUDA graphs, else through the static buffers only."""

    sizes: tuple[int, ...]
    max_model_len: int
    capture: bool


def graph_options(config, device, max_model_len: int) -> GraphOptions | None:
    """The ``GraphOptions`` of an engine (``config``: its ``EngineConfig``) on ``device``, or None (neither graphs
    nor the static path): graphs on CUDA unless ``enforce_eager`` or ``cudagraph_mode="NONE"``; the static path
    alone where ``PAGED_HF_STATIC_DECODE=1``."""
    forced = os.environ.get(STATIC_DECODE_ENV, "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"{STATIC_DECODE_ENV}={forced!r}: expected '1' (padded static decode, no graphs), '0' or "
                         f"unset")
    capture = torch.device(device).type == "cuda" and not config.enforce_eager and config.cudagraph_mode != "NONE"
    if forced != "1" and not capture:
        return None
    sizes = capture_sizes(config.max_num_seqs, config.cudagraph_capture_sizes)
    return GraphOptions(sizes, max_model_len, capture and forced != "1") if sizes else None


class DecodeGraphs:
    """The buckets of an engine's decode-only steps and, on CUDA, their graphs.

    ``forward(bucket) -> logits [B, vocab]``: the runner's forward over a bucket's static inputs (compiled when the
    runner compiles). Build it under ``torch.inference_mode()``, as the steps run (the compiled forward's guards
    check that its inputs are inference tensors)."""

    def __init__(self, kv: KVManager, forward: Callable[[StaticDecode], torch.Tensor], options: GraphOptions,
                 device) -> None:
        self.kv = kv
        self.forward = forward
        self.device = torch.device(device)
        scratch = add_scratch_blocks(kv)
        self.buckets = [StaticDecode(kv, size, options.max_model_len, scratch, device) for size in options.sizes]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output, overwritten by every replay
        self._pools: tuple = ()
        self.static_only = not options.capture  # the padded path without graphs (PAGED_HF_STATIC_DECODE=1)
        if options.capture:
            self.capture()

    def bucket(self, metadata: AttentionMetadata) -> StaticDecode | None:
        """The smallest bucket the step fits (``StaticDecode.fits``), or None."""
        if not metadata.decode_only:
            return None
        return next((b for b in self.buckets if b.fits(metadata)), None)

    def run(self, input_ids: torch.Tensor, metadata: AttentionMetadata, keep: torch.Tensor) -> torch.Tensor | None:
        """The kept logits ``[R, vocab]`` of a decode-only step (``input_ids [S]`` and ``metadata`` on the device;
        ``keep``: rows among ``0 .. S - 1``), or None when no bucket fits it or no graph could be captured (the
        caller runs it as usual)."""
        bucket = self.bucket(metadata)
        if bucket is None:
            return None
        if self.graphs and self._pools != self._pool_pointers():
            logger.info("PagedEngine: the KV tail pools moved (they grew); capturing the decode graphs again")
            self.capture()
        if not self.graphs and not self.static_only:  # the capture failed: padding would only cost
            return None
        bucket.load(input_ids, metadata)
        graph = self.graphs.get(bucket.size)
        if graph is None:
            logits = self.forward(bucket)
        else:
            graph.replay()
            logits = self.logits[bucket.size]
        return logits.index_select(0, keep)

    def capture(self) -> bool:
        """Captures every bucket's graph (largest first, one memory pool); False, with a warning and no graphs kept,
        if any capture fails."""
        began = time.perf_counter()
        self.graphs.clear()
        self.logits.clear()
        if self.kv.has_tail:  # padding reads tail row 0; rows for the largest bucket now, so they seldom move later
            for group in self.kv.groups:
                for storage in group.storages.values():
                    storage.ensure_tail_rows(self.buckets[-1].size)
        try:
            pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(self.device)
            for bucket in reversed(self.buckets):
                bucket.pad(0)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(WARMUP_RUNS):
                        self.forward(bucket)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self.forward(bucket)
                self.graphs[bucket.size], self.logits[bucket.size] = graph, logits
            torch.cuda.synchronize(self.device)
        except Exception as error:  # noqa: BLE001 - any failure: the steps run without graphs
            self.graphs.clear()
            self.logits.clear()
            logger.warning("PagedEngine: capturing the CUDA graphs of decode steps failed (%s: %s); decode steps run "
                           "without graphs", type(error).__name__, str(error).splitlines()[0] if str(error) else "")
            return False
        self._pools = self._pool_pointers()
        logger.info("PagedEngine: captured CUDA graphs of decode steps at batch sizes %s in %.1f s",
                    [b.size for b in self.buckets], time.perf_counter() - began)
        return True

    def _pool_pointers(self) -> tuple:
        """The addresses of the tail pools (the only pool tensors of an engine that are reallocated)."""
        if not self.kv.has_tail:
            return ()
        return tuple(t.data_ptr() for group in self.kv.groups for storage in group.storages.values()
                     for t in storage.tail_tensors().values())
