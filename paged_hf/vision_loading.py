"""What ``paged-hf serve`` loads for a vision-language model folder: whether the folder holds one (a model type that
transformers maps to an image-text-to-text class and not to a causal LM), its processor, and the server's
``MediaPolicy`` from the command line's image flags."""

from __future__ import annotations

from .media import DEFAULT_MAX_IMAGE_PIXELS, MediaPolicy


def vision_model_type(directory: str, extra: dict) -> str | None:
    """The folder's ``model_type`` when it is a vision-language model that only the image-text-to-text class
    loads (LLaVA, Qwen2-VL...); None otherwise (a .gguf file, a text model, Gemma 3, which its causal class loads)."""
    if extra.get("gguf_file"):
        return None
    from transformers import AutoConfig  # noqa: PLC0415
    from transformers.models.auto.modeling_auto import (  # noqa: PLC0415
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    model_type = AutoConfig.from_pretrained(directory, **extra).model_type
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return model_type
    return None


def serve_media(args, directory: str, extra: dict):
    """``(processor or None, MediaPolicy)`` for ``paged-hf serve``: the folder's processor when it holds a
    vision-language model, and what image URLs may name (``--allowed-media-domains``, ``--allowed-local-media-path``,
    ``--max-image-pixels``)."""
    processor = None
    if vision_model_type(directory, extra) is not None:
        from transformers import AutoProcessor  # noqa: PLC0415

        processor = AutoProcessor.from_pretrained(directory)
    domains = getattr(args, "allowed_media_domains", None)
    policy = MediaPolicy(allowed_media_domains=tuple(d.lower() for d in domains) if domains else None,
                         allowed_local_media_path=getattr(args, "allowed_local_media_path", None),
                         max_image_pixels=getattr(args, "max_image_pixels", None) or DEFAULT_MAX_IMAGE_PIXELS)
    return processor, policy
