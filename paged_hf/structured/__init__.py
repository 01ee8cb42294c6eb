"""Structured outputs: a request's output constrained to a JSON schema, a regex, a list of choices or a grammar.

``StructuredOutputsParams`` (in ``SamplingParams(structured_outputs=...)``) says what; the engine compiles it with
xgrammar off its thread (``compiler``), keeps one matcher per sequence (``matcher``) and masks every constrained row
of a step at once before sampling (``bitmask``). ``JSONSchemaLogitsProcessor`` / ``StructuredLogitsProcessor`` do
the same for ``model.generate()``. xgrammar is imported on first use (``pip install 'paged_hf[structured]'``).
"""

from .grammar import GrammarError
from .params import StructuredOutputsParams


def __getattr__(name: str):
    if name in ("JSONSchemaLogitsProcessor", "StructuredLogitsProcessor"):  # they import transformers and xgrammar
        from . import logits_processor  # noqa: PLC0415

        return getattr(logits_processor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GrammarError", "JSONSchemaLogitsProcessor", "StructuredLogitsProcessor", "StructuredOutputsParams"]
