"""The engine's compiled forward: ``torch.compile`` of the stock model, the KV store and the paged attention as the
custom ops of ``paged_hf.ops`` (dynamo traces everything else into one graph), on unless ``enforce_eager=True``.

What is dynamic: the step's token count ``T`` (``input_ids``/``position_ids`` ``[1, T]``, the K/V slots), its
sequence count ``S`` (``seq_lens``, ``query_start_loc``, block-table rows), the block-table width, the rows of logits
kept and a tail format's store plan. They are marked dynamic before every call, and compiled size-oblivious (a size
of 0 or 1 is not a case of its own), so a warm-up of one shape gives the graph every later step reuses: steady
serving never recompiles. The step's decode count is a ``[1]`` CPU tensor read inside the attention op, never a
graph constant. The pools are not graph inputs (``ops.bind``), so their size is free too, and one graph serves
every engine over models of one architecture and config.

A model dynamo cannot trace (a graph break: ``fullgraph=True``) or a backend that fails falls back to the eager
forward with a warning, at warm-up or at any later step: never a crash, never a failed request.

Dynamo's guard check costs about 2.4 ms a forward on SmolLM2's 30 layers (14,000 guards: every parameter, module, hook
dict and input), 4% of a 32-sequence bfloat16 decode step; vLLM drops its guards after the warm-up. Here a forward
evaluates every guard when anything they could see may have changed since the last full check: the engine's first
forwards, a hook registered anywhere (``RemovableHandle``'s id counter), a module, parameter or buffer assigned
through the module API anywhere (the global registration hooks below), a module's parameters or buffers converted
anywhere (``to``, ``half``, ``cuda``...: ``Module._apply``, counted below; they convert in place, so no assignment
is seen), ``model.train()``/``eval()``, a model that had hooks at the last check (a removal leaves no trace), a
non-default compiler stance. Every other forward runs under ``set_stance(skip_guard_eval_unsafe=True)``,
which still checks the input tensors' metadata and every guard that ever failed (the ones that tell apart the graphs
of models that share one code object). That steady steps never need the rest is what the steady-serving test shows
with ``evaluate_guards=True`` (every guard at every forward, recompiles made errors). Not seen: a plain Python
attribute changed on a module or its config after the engine started, a parameter's ``.data`` replaced by hand. A
Python frame run inside a skipped-guard call (a finalizer) is one dynamo has no graph for, and the forward fails:
the cyclic collector is paused during those calls, and a forward that dynamo fails all the same switches the engine
to every guard at every forward (the runner runs that step again).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import time

import torch
from torch._dynamo.exc import TorchDynamoException
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx.experimental import _config as fx_config
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle
from tqdm.auto import tqdm

from .. import ops
from ..kernels import cpu_ext
from ..metadata import AttentionMetadata
from ..packed_linear import FusePackedLinears
from . import decompositions
from .decompositions import SigmoidForOnePlusTanh, engine_decompositions
from .forward_cache import EngineCache
from .rotary_tables import RealizeRotaryTables
from .scratch import ScratchForwards

logger = logging.getLogger("paged_hf")

# (starts, counts, num_decodes) of the warm-up forwards: a decode, a mixed step (two decodes, a chunk starting
# inside a block), a prompt. One graph should serve them all; running several checks it, and warms the kernels.
WARMUP_STEPS = (((5,), (1,), 1), ((3, 9, 0), (1, 1, 6), 2), ((0,), (7,), 0))


# Hooks a user adds to the model after the warm-up must run (dynamo's default skips guarding on them): a new hook
# fails the guards and the forward compiles again (or, a hook dynamo cannot trace, runs eagerly). The recompile
# limit counts per code object, and every HF model's forward is transformers' one decorator wrapper: engines over
# many configs in one process (a test run) would exhaust the default 8.
_DYNAMO_SETTINGS = {"skip_nnmodule_hook_guards": False, "recompile_limit": 64}
_COMPILE_CONFIG = torch._dynamo.config.patch(**_DYNAMO_SETTINGS)
# Sizes 0 and 1 are no special case, and equal sizes get no shared symbol (T == S in a decode-only step is chance).
_SHAPE_SETTINGS = {"backed_size_oblivious": True, "use_duck_shape": False}
_SHAPE_CONFIG = fx_config.patch(**_SHAPE_SETTINGS)


class _GraphPasses(CustomGraphPass):
    """The engine's post-grad passes, in order: the q/k/v and gate/up products fused (``FusePackedLinears``), the
    rotary tables computed once a step (``RealizeRotaryTables``), ``1 + tanh(u)`` as ``2 sigmoid(2u)``
    (``SigmoidForOnePlusTanh``: gelu's tanh form where a model writes it out)."""

    passes = (FusePackedLinears(), RealizeRotaryTables(), SigmoidForOnePlusTanh())

    def __call__(self, graph: torch.fx.Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self) -> bytes:
        # inductor's compile caches key on this, not on the decomposition table nor on the custom ops' fakes (the
        # layouts the graph was built for): a changed table or fake must miss them too
        return (b"".join(graph_pass.uuid() for graph_pass in self.passes)
                + get_hash_for_files((decompositions.__file__, ops.__file__, cpu_ext.__file__)))


# Inductor with the engine's passes, one object for every engine: dynamo reuses a compiled graph only for the same
# backend object (a backend made per engine would make every engine compile anew and exhaust the recompile limit).
# ``cpp.dynamic_threads``: every C++ kernel opens an OpenMP region sized at run time. Without it inductor decides a
# kernel's parallelism from the size hints of the first warm-up step (a decode, one token) and compiles the norms,
# the rotary embedding and the residual adds serial for every later token count (bf16 SmolLM2, 2 threads: 5-8% of a
# prefill or mixed run). Each element's arithmetic is the same either way. ``size_asserts`` off, as vLLM compiles:
# the wrapper checked every input's and every custom op output's sizes and strides each step (~600 calls for
# SmolLM2, 0.35 ms of its 3 ms a decode step); the ops' fake implementations are what the graph was built from.
# The decompositions are inductor's with the engine's own in place of a few (``decompositions.py``: gelu's tanh form).
_INDUCTOR_SETTINGS = {"post_grad_custom_pre_pass": _GraphPasses(), "cpp.dynamic_threads": True, "size_asserts": False}
_INDUCTOR = functools.partial(compile_fx, config_patches=_INDUCTOR_SETTINGS, decompositions=engine_decompositions())


# Module API edits in this process (a submodule, parameter or buffer assigned), counted by the global registration
# hooks registered once at import (each returns None: the value assigned is kept). Not while dynamo traces: a
# forward may build a container (``self.layers[:n]`` is a new ``ModuleList``), which must not enter the graph.
_EDITS = [0]


def _count_edit(module, name, value) -> None:
    if not torch.compiler.is_compiling():
        _EDITS[0] += 1


for _register in (nn_module.register_module_module_registration_hook,
                  nn_module.register_module_parameter_registration_hook,
                  nn_module.register_module_buffer_registration_hook):
    _register(_count_edit)


def _counting_apply(apply):
    """``Module._apply`` (every conversion of a module's parameters and buffers: ``to``, ``half``, ``cuda``, ...)
    counting itself as an edit: comparing every parameter's dtype and device instead cost 0.04 ms a step on
    SmolLM2's 272 parameters."""

    @functools.wraps(apply)
    def counted(module, *args, **kwargs):
        _count_edit(module, None, None)
        return apply(module, *args, **kwargs)

    counted.counts_edits = True
    return counted


if not getattr(nn_module.Module._apply, "counts_edits", False):  # once per process (a reload imports this again)
    nn_module.Module._apply = _counting_apply(nn_module.Module._apply)

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = (nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks,
                 nn_module._global_backward_hooks, nn_module._global_backward_pre_hooks)


def _has_hooks(model: torch.nn.Module) -> bool:
    """Whether any hook can run in ``model``'s forward (its modules' or a global one)."""
    return any(_GLOBAL_HOOKS) or any(getattr(m, name) for m in model.modules() for name in _HOOK_DICTS)


# What dynamo raises (before anything ran) when a forward under ``skip_guard_eval_unsafe`` fails the guards it still
# checks: a shape guard of every graph, or a guard that failed before.
_SKIPPED_GUARDS_RECOMPILE = "Recompilation triggered with skip_guard_eval_unsafe stance"


def _default_stance() -> bool:
    stance = getattr(torch._dynamo.eval_frame, "_stance", None)
    return stance is not None and stance.stance == "default" and stance.backend is None \
        and not stance.skip_guard_eval_unsafe


@contextlib.contextmanager
def _skipped_guards():
    """``set_stance(skip_guard_eval_unsafe=True)`` with the cyclic garbage collector paused: a finalizer it runs
    inside the call (an asyncio transport's ``__del__`` in the server, say) is a frame dynamo has no graph for, which
    the stance refuses, and the forward then fails."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            yield
    finally:
        if collecting:
            gc.enable()


def _reason(error: TorchDynamoException) -> str:
    """Dynamo's error in a line: its first, and for an exception the traced code raised ("Observed exception"),
    that exception."""
    lines = str(error).splitlines()
    raised = [line.split("raised exception", 1)[1].strip() for line in lines if "raised exception" in line]
    return f"{type(error).__name__}: {lines[0] if lines else ''}" + (f": {raised[0]}" if raised else "")


class CompileFailed(RuntimeError):
    """torch.compile could not compile the forward (the runner then runs it eagerly)."""


# The oldest torch whose compiled forward gives the eager forward's tokens: torch 2.7 has every setting below but its
# graph of a stock Llama decodes wrong tokens; 2.6 lacks the settings. paged_hf requires 2.8, but an older torch
# installed anyway (transformers accepts 2.6) runs the engine eagerly, saying why, never a wrong graph.
COMPILE_FLOOR = "2.8"
# The settings the compiled forward patches, by name, where they live (a later torch may rename one).
_NEEDED_SETTINGS = ((torch._dynamo.config, "torch._dynamo.config", tuple(_DYNAMO_SETTINGS)),
                    (fx_config, "torch.fx.experimental._config", tuple(_SHAPE_SETTINGS)),
                    (torch._inductor.config, "torch._inductor.config", tuple(_INDUCTOR_SETTINGS)))
_ABSENT = object()


def why_not_compiled() -> str | None:
    """Why this torch cannot run the compiled forward (its version, or the settings and APIs it lacks); None: it
    can."""
    if torch.__version__ < COMPILE_FLOOR:  # a TorchVersion: compared as a version
        return f"torch {torch.__version__} is older than {COMPILE_FLOOR}, the oldest whose graph is exact"
    missing = []
    for module, name, settings in _NEEDED_SETTINGS:
        for setting in settings:
            holder = module
            for part in setting.split("."):
                holder = getattr(holder, part, _ABSENT)
            if holder is _ABSENT:
                missing.append(f"{name}.{setting}")
    if "skip_guard_eval_unsafe" not in inspect.signature(torch.compiler.set_stance).parameters:
        missing.append("torch.compiler.set_stance(skip_guard_eval_unsafe=...)")
    if not hasattr(torch._dynamo.eval_frame, "_stance"):
        missing.append("torch._dynamo.eval_frame._stance")
    return f"torch {torch.__version__} lacks {', '.join(missing)}" if missing else None


class CompiledForward:
    """``torch.compile(model, fullgraph=True)`` called the engine's way: ``forward(engine_cache, metadata, **inputs)``
    (``inputs``: the model's keyword arguments, ``cache=engine_cache`` among them)."""

    def __init__(self, model, backend: str = "inductor", evaluate_guards: bool = False) -> None:
        """``evaluate_guards``: every dynamo guard at every forward (see the module docstring). ``CompileFailed``
        where this torch cannot run it (``why_not_compiled``)."""
        reason = why_not_compiled()
        if reason is not None:
            raise CompileFailed(reason)
        self.model = model
        self.backend = backend
        self.evaluate_guards = evaluate_guards
        self.compiled = torch.compile(model, fullgraph=True, dynamic=None,
                                      backend=_INDUCTOR if backend == "inductor" else backend)
        self.checked: tuple | None = None  # the model's state at the last full check, None: check again
        self.full_checks = 0  # forwards that evaluated every guard
        # ``[n]`` int64 tensors by value, read-only: a step's ``num_decodes`` input (one per batch size, not one op
        # a step)
        self._counts: dict[int, torch.Tensor] = {}

    def _state(self) -> tuple:
        """What the skipped guards would see change: hook registrations, module API edits and conversions, the
        train/eval mode."""
        return RemovableHandle.next_id, _EDITS[0], self.model.training

    def __call__(self, engine_cache: EngineCache, metadata: AttentionMetadata, **inputs):
        """One forward; ``CompileFailed`` when dynamo or the backend fails (before anything ran)."""
        return self.forward(engine_cache, metadata, inputs, self.evaluate_guards)

    def forward(self, engine_cache: EngineCache, metadata: AttentionMetadata, inputs: dict, every_guard: bool):
        """``__call__``, with every guard evaluated if ``every_guard``."""
        _mark_dynamic(metadata, inputs)
        engine_cache.num_decodes = self._counts.get(metadata.num_decodes)
        if engine_cache.num_decodes is None:
            engine_cache.num_decodes = self._counts[metadata.num_decodes] = torch.tensor([metadata.num_decodes])
        state = self._state()
        full = every_guard or state != self.checked or not _default_stance()
        try:
            try:
                outputs = self._run(engine_cache, inputs, full)
            except RuntimeError as error:
                if full:
                    raise
                if not str(error).startswith(_SKIPPED_GUARDS_RECOMPILE):
                    self._refused_by_the_stance(error)
                    raise
                full = True  # a size no graph's checked guards admit: compile the usual way
                outputs = self._run(engine_cache, inputs, full)
        except TorchDynamoException as error:
            raise CompileFailed(_reason(error)) from error
        finally:
            engine_cache.num_decodes = None
        if full:
            self.full_checks += 1
            self.checked = None if _has_hooks(self.model) else state
        return outputs

    def _refused_by_the_stance(self, error: RuntimeError) -> None:
        """After a skipped-guard forward raised ``error``: when dynamo raised it (a Python frame it has no graph for
        ran inside the call, as a finalizer the collector would have run), every later forward evaluates every guard.
        The error still propagates: the runner runs the step again (``engine/isolation.py``), now with every guard,
        which is safe where an in-place retry is not (a tail row the failed forward already rewrote)."""
        message = str(error)
        if "torch.compile" in message or "skip_guard_eval_unsafe" in message:
            logger.warning("PagedEngine: a forward past dynamo's checked guards failed (%s); every later forward "
                           "evaluates every guard", message.splitlines()[0])
            self.evaluate_guards = True

    def _run(self, engine_cache: EngineCache, inputs: dict, full: bool):
        """The compiled call with the pools bound; the compile settings only where dynamo may compile (``full``):
        a skipped-guard call that would compile raises instead (``forward`` runs it again, ``full``), and the two
        settings' patches cost 0.1 ms a step."""
        with ops.bind(engine_cache.pools()):
            if full:
                with _COMPILE_CONFIG, _SHAPE_CONFIG:
                    return self.compiled(**inputs)
            with _skipped_guards():
                return self.compiled(**inputs)

    @torch.inference_mode()  # the engine's steps run in it: tensors made outside would not match the guards
    def warm_up(self, scratch: ScratchForwards, keeps_logits: bool, attention_mask: torch.Tensor) -> float:
        """Compiles the forward on ``scratch`` (pools shaped as the engine's: its own pools and prefix cache stay
        untouched), one forward per ``WARMUP_STEPS`` entry, with the runner's ``attention_mask`` (the
        same tensor kind as every step's); returns the seconds it took.
        ``CompileFailed`` as ``__call__``."""
        begin = time.perf_counter()
        bar = tqdm(WARMUP_STEPS, desc="Compiling the engine's forward", unit="shape", leave=False)
        for starts, counts, num_decodes in bar:
            with scratch.step(starts, counts, num_decodes, attention_mask, keeps_logits) as (metadata, inputs):
                self.forward(scratch.cache, metadata, inputs, every_guard=True)  # each shape's failed guards recorded
        bar.close()
        return time.perf_counter() - begin


def _mark_dynamic(metadata: AttentionMetadata, inputs: dict) -> None:
    """Marks every size that changes from step to step dynamic (see the module docstring)."""
    mark = torch._dynamo.maybe_mark_dynamic
    mark(inputs["input_ids"], 1)
    mark(inputs["position_ids"], 1)
    if isinstance(inputs.get("logits_to_keep"), torch.Tensor):
        mark(inputs["logits_to_keep"], 0)
    for tensor in (metadata.seq_lens, metadata.query_start_loc, metadata.tail_rows):
        if tensor is not None:
            mark(tensor, 0)
    for group in metadata.groups:
        mark(group.block_tables, 0)
        mark(group.block_tables, 1)
        mark(group.slot_mapping, 0)
        if group.store_plan is not None:
            for tensor in (group.store_plan.tail_slots, group.store_plan.fill_blocks, group.store_plan.fill_rows,
                           group.store_plan.fill_first, group.store_plan.fill_tail):
                mark(tensor, 0)
