"""What ``paged-hf serve`` and ``LLM`` load for a vision-language model folder: whether the folder holds one (a model type that
transformers maps to an image-text-to-text class), the class to load it with, its processor, and the server's
``MediaPolicy`` from the command line's image flags."""

from __future__ import annotations

from .media import DEFAULT_MAX_IMAGE_PIXELS, MediaPolicy


def vision_model_type(directory: str, extra: dict) -> str | None:
    """The folder's ``model_type`` when transformers maps it to an image-text-to-text class (LLaVA, Qwen2-VL,
    Gemma 3...); None otherwise (a .gguf file, a text model)."""
    if extra.get("gguf_file"):
        return None
    from transformers import AutoConfig  # noqa: PLC0415
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES  # noqa: PLC0415

    source = {name: extra[name] for name in ("revision", "trust_remote_code") if name in extra}
    model_type = AutoConfig.from_pretrained(directory, **source).model_type
    return model_type if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES else None


def model_class(directory: str, extra: dict):
    """The auto class that loads the folder for the engine: the causal LM class where transformers has one for its
    model type (Gemma 3's loads its image-text model too), else the image-text-to-text class (LLaVA, Qwen2-VL)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText  # noqa: PLC0415
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: PLC0415

    model_type = vision_model_type(directory, extra)
    if model_type is None or model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    return AutoModelForImageTextToText


def load_processor(directory: str, extra: dict):
    """The folder's processor (``AutoProcessor``) when it holds a vision-language model, else None."""
    if vision_model_type(directory, extra) is None:
        return None
    from transformers import AutoProcessor  # noqa: PLC0415

    return AutoProcessor.from_pretrained(directory, **{n: extra[n] for n in ("revision",) if n in extra})


def serve_media(args, directory: str, extra: dict):
    """``(processor or None, MediaPolicy)`` for ``paged-hf serve``: the folder's processor when it holds a
    vision-language model, and what image URLs may name (``--allowed-media-domains``, ``--allowed-local-media-path``,
    ``--max-image-pixels``)."""
    processor = load_processor(directory, extra)
    domains = getattr(args, "allowed_media_domains", None)
    policy = MediaPolicy(allowed_media_domains=tuple(d.lower() for d in domains) if domains else None,
                         allowed_local_media_path=getattr(args, "allowed_local_media_path", None),
                         max_image_pixels=getattr(args, "max_image_pixels", None) or DEFAULT_MAX_IMAGE_PIXELS)
    return processor, policy
