"""Where a model and its tokenizer load from: a model folder, a .gguf file, or a Hugging Face hub name.

One home for the front ends (``LLM``, ``PagedEngine.from_pretrained``, ``paged-hf serve / generate / demo``):
``model_source`` turns what the user gave into ``from_pretrained``'s name and keywords, ``load_tokenizer`` loads
the tokenizer the same way. Imports nothing from the package; transformers only when a tokenizer loads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

logger = logging.getLogger("paged_hf")

_HUB_NAME = re.compile(r"[A-Za-z0-9_][\w.-]*(/[A-Za-z0-9_][\w.-]*)?")  # "name" or "org/name", as the hub allows


def looks_like_hub_name(path: str) -> bool:
    return bool(_HUB_NAME.fullmatch(path)) and ".." not in path and "--" not in path and not path.endswith(".gguf")


def gguf_files(folder: str) -> list[str]:
    """The .gguf files of a model folder that holds no config.json (sorted names), else none: such a folder loads one
    of them."""
    if not os.path.isdir(folder) or os.path.isfile(os.path.join(folder, "config.json")):
        return []
    return sorted(name for name in os.listdir(folder) if name.endswith(".gguf"))


def model_source(model, gguf_file: str | None = None) -> tuple[str, dict]:
    """The ``from_pretrained`` name and its ``gguf_file`` keyword: a .gguf file path splits into its folder and
    name; a folder holding no config.json but exactly one .gguf file loads that file. A path that does not exist
    and cannot be a hub name raises ``ValueError`` saying so (transformers would call it a malformed repo id)."""
    path = os.fspath(model)
    if not os.path.exists(path) and not looks_like_hub_name(path):
        raise ValueError(f"model {path!r} does not exist: give a model folder, a .gguf file, or a Hugging Face hub "
                         f"name ('org/name')")
    if gguf_file is None and path.endswith(".gguf") and os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}
    if gguf_file is None:
        ggufs = gguf_files(path)
        if len(ggufs) > 1:
            raise ValueError(f"{path!r} holds several .gguf files {ggufs}; pass gguf_file= to choose one")
        if ggufs:
            return path, {"gguf_file": ggufs[0]}
    return path, {} if gguf_file is None else {"gguf_file": gguf_file}


def load_tokenizer(tokenizer, model, *, trust_remote_code: bool = False, revision: str | None = None,
                   gguf_file: str | None = None, optional: bool = False):
    """``tokenizer`` as given (an object), loaded from its path, or, when None, from the model's source (a path, a
    hub name, or a loaded model's ``name_or_path``; ``gguf_file`` applies to the model's source only).
    ``optional``: a model without tokenizer files gives None (its prompts must be token ids) instead of raising;
    a tokenizer path that fails to load raises either way."""
    from transformers import AutoTokenizer, PreTrainedModel  # noqa: PLC0415

    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer  # a tokenizer object
    source = tokenizer if tokenizer is not None else model
    if isinstance(source, PreTrainedModel):
        source = source.name_or_path
        if not source:
            raise ValueError("tokenizer is needed: the model object has no name_or_path to load one from")
    try:
        name, extra = model_source(source, gguf_file if tokenizer is None else None)
        if revision is not None:
            extra["revision"] = revision
        with explained_hub_miss(name):
            return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **extra)
    except (OSError, ValueError, TypeError) as error:
        if not optional or tokenizer is not None:
            raise
        logger.info("no tokenizer found with %s (%s): prompts must be token ids", source, error)
        return None


@contextlib.contextmanager
def explained_hub_miss(name: str):
    """A name that is no local path went to the hub: when that fails, say so before transformers' own words."""
    try:
        yield
    except OSError as error:
        if os.path.exists(name):
            raise
        raise OSError(f"model {name!r} is not a local folder or file, and the Hugging Face hub could not provide it "
                      f"(unreachable, offline, or no such repository): {error}") from error
