"""Prompts with images, for the front ends (``LLM``, the server): OpenAI / vLLM content parts to a chat template's
messages and the images in order, and a text (or token ids) with its images to token ids (placeholders expanded)
plus the processor's tensors, which is what ``PagedEngine.add_request(..., images=...)`` takes.

Content parts: ``{"type": "text", "text"}``, ``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`` (or
the URL string), and vLLM's ``{"type": "image_pil", "image_pil": <PIL image>}``. Each image part becomes
``{"type": "image"}`` in the message the chat template sees (what Hugging Face processors' templates read); a
template that reads a message's content as a string gets the processor's image placeholder, one line per image,
before the message's text (``placeholder``, as vLLM writes them). An image part's ``detail`` is OpenAI's: ``"low"``
hands the processor the image scaled down (aspect kept) to fit ``LOW_DETAIL_SIDE`` pixels a side, as OpenAI's
low-resolution mode sees it (fewer image tokens where the processor sizes them by the image, as Qwen2-VL's does);
``"high"`` and ``"auto"`` hand it the image as read (the processor's own resolution is the most there is).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

from .config import ParameterError
from .engine.multimodal import IMAGE_KEYS
from .media import MediaPolicy, load_image

IMAGE_PART_TYPES = ("image_url", "image_pil")
DETAILS = ("auto", "low", "high")  # an image_url part's ``detail``
LOW_DETAIL_SIDE = 512  # pixels a side of a ``detail: "low"`` image, at most
QWEN_VISION = {"<|image_pad|>": ("<|vision_start|>", "<|vision_end|>")}  # the Qwen-VL models' image between markers


_PROBE = "\x01paged-hf-probe\x01"
_reads_parts: dict[str, bool] = {}  # by template: whether it reads content parts


def image_placeholder(tokenizer, processor, chat_template: str | None = None) -> str | None:
    """The text that stands for an image in a chat template that reads content as a string (the processor's image
    token, or its begin-of-image token where it has one; a Qwen-VL image token between its vision start and end
    tokens, as its own templates write it); None for a template that reads content parts."""
    template = chat_template if chat_template is not None else tokenizer.chat_template
    key = str(template)
    if key not in _reads_parts:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": _PROBE}]}],
                                                 chat_template=template, tokenize=False)
            _reads_parts[key] = _PROBE in text and "'type'" not in text and '"type"' not in text
        except Exception:  # noqa: BLE001 - a template that cannot take parts reads strings
            _reads_parts[key] = False
    if _reads_parts[key]:
        return None
    token = getattr(processor, "boi_token", None) or getattr(processor, "image_token", None)
    markers = QWEN_VISION.get(token)
    if markers is None:
        return token
    vocab = processor.tokenizer
    if all(i is not None and i != vocab.unk_token_id for i in vocab.convert_tokens_to_ids(list(markers))):
        return f"{markers[0]}{token}{markers[1]}"  # (a lookup per marker, not a copy of the whole vocabulary)
    return token


def split_chat(messages: list, load: Callable[[object], object], field: str = "messages",
               placeholder: str | None = None) -> tuple[list, list]:
    """``(messages for the template, images)``: image parts replaced by ``{"type": "image"}`` (with
    ``placeholder``: the message becomes a string, a line of it per image before its text) and loaded with
    ``load(url or PIL image)``, in order; a message without images keeps its text as a string."""
    rendered, images = [], []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts, has_image = [], False
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind in IMAGE_PART_TYPES:
                value, detail = part.get(kind), None
                if kind == "image_url" and isinstance(value, Mapping):
                    value, detail = value.get("url"), value.get("detail")
                    if detail is not None and detail not in DETAILS:
                        raise ParameterError(field, f"messages.{index}: image_url.detail must be one of "
                                                    f"{list(DETAILS)}, got {detail!r:.40}")
                image = load(value)
                images.append(low_detail(image) if detail == "low" else image)
                parts.append({"type": "image"})
                has_image = True
            else:
                raise ParameterError(field, f"messages.{index}: content part type must be one of "
                                            f"{['text', *IMAGE_PART_TYPES]}, got {kind!r:.40}")
        text = "\n".join(p["text"] for p in parts if p["type"] == "text")  # vLLM joins text parts by lines
        if has_image and placeholder is not None:
            content = "\n".join([placeholder] * sum(p["type"] == "image" for p in parts) + [text])
        else:
            content = parts if has_image else text
        rendered.append({**message, "content": content})
    return rendered, images


def low_detail(image):
    """``image`` (PIL) scaled down, aspect kept, to fit ``LOW_DETAIL_SIDE`` pixels a side (as it is if it fits)."""
    width, height = image.size
    scale = LOW_DETAIL_SIDE / max(width, height)
    if scale >= 1:
        return image
    from PIL import Image  # noqa: PLC0415 - an optional dependency, imported with the image that needs it

    return image.resize((max(1, round(width * scale)), max(1, round(height * scale))), Image.Resampling.BICUBIC)


def process(processor, text: str, images: list, add_special_tokens: bool = True) -> tuple[list[int], dict]:
    """``(token ids, image tensors)`` of ``text`` with ``images`` through the model's ``processor``: the ids hold the
    expanded placeholders, the tensors are ``PagedEngine``'s ``images`` (``pixel_values`` ``[N, ...]``, ...)."""
    if processor is None:
        raise ParameterError("multi_modal_data", "images need the model's processor (LLM(..., processor=...))")
    try:
        out = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=add_special_tokens)
    except (ValueError, TypeError) as error:  # e.g. placeholders and images that do not match
        raise ParameterError("multi_modal_data", f"the processor refused the prompt and its images: {error}") \
            from None
    return out["input_ids"][0].tolist(), {name: out[name] for name in IMAGE_KEYS if name in out}


def image_prompt(prompt: Mapping, processor, media: MediaPolicy) -> tuple[dict, dict]:
    """vLLM's ``{"prompt": text, "multi_modal_data": {"image": image or [images]}}`` (or ``"prompt_token_ids"``
    instead of ``"prompt"``: ``process_token_ids``) as the engine's prompt (its token ids) and its image tensors."""
    data = prompt["multi_modal_data"]
    if not isinstance(data, Mapping) or set(data) != {"image"}:
        raise ParameterError("multi_modal_data", f"multi_modal_data must be {{'image': an image or a list of them}} "
                                                 f"(PIL, uint8 numpy array or torch tensor, URL), got {data!r:.200}")
    if "prompt_token_ids" not in prompt and not isinstance(prompt.get("prompt"), str):
        raise ParameterError("multi_modal_data", "multi_modal_data needs 'prompt' (the text with its image "
                                                 "placeholders) or 'prompt_token_ids' (its ids)")
    images = data.get("image")
    if isinstance(images, (list, tuple)) and not images:
        raise ParameterError("multi_modal_data", "multi_modal_data['image'] is an empty list: give one image or more, "
                                                 "or a prompt without multi_modal_data")
    images = [load_image(image, media, "multi_modal_data")
              for image in (images if isinstance(images, (list, tuple)) else [images])]
    if "prompt_token_ids" in prompt:
        ids, tensors = process_token_ids(processor, list(prompt["prompt_token_ids"]), images)
        return {"prompt": prompt.get("prompt"), "prompt_token_ids": ids}, tensors
    ids, tensors = process(processor, prompt["prompt"], images)
    return {"prompt": prompt["prompt"], "prompt_token_ids": ids}, tensors


def process_token_ids(processor, ids: list[int], images: list) -> tuple[list[int], dict]:
    """``process`` for a prompt given as token ids, as vLLM takes them: one placeholder token per image (the
    processor's begin-of-image token, or its image token), each replaced by the ids the processor expands it to for
    that image, or ids that already hold every image's expansion (as many image tokens), kept as they are. The image
    tensors are the processor's for all the images at once."""
    if processor is None:
        raise ParameterError("multi_modal_data", "images need the model's processor (LLM(..., processor=...))")
    placeholder = getattr(processor, "boi_token", None) or getattr(processor, "image_token", None)
    if placeholder is None:
        raise ParameterError("multi_modal_data", f"{type(processor).__name__} names no image token: give 'prompt' "
                                                 f"(text) with multi_modal_data")
    tokenizer = processor.tokenizer
    placeholder_id = tokenizer.convert_tokens_to_ids(placeholder)
    expansions = [_expansion(processor, placeholder, image) for image in images]
    _, tensors = process(processor, placeholder * len(images), images, add_special_tokens=False)
    image_id = Counter(token for expansion in expansions for token in expansion).most_common(1)[0][0]
    expanded = sum(expansion.count(image_id) for expansion in expansions)
    if ids.count(image_id) == expanded:
        return ids, tensors  # the placeholders were expanded already
    if ids.count(placeholder_id) != len(images):
        raise ParameterError("multi_modal_data", f"prompt_token_ids hold {ids.count(placeholder_id)} image "
                                                 f"placeholders ({placeholder!r}, id {placeholder_id}) for "
                                                 f"{len(images)} images: give one per image, or every image's "
                                                 f"expansion")
    out, image = [], iter(images)
    special = set(tokenizer.all_special_ids)
    for position, token in enumerate(ids):
        if token != placeholder_id:
            out.append(token)
        elif all(t in special and t != placeholder_id for t in ids[:position]):  # the text's start (after BOS)
            out.extend(process(processor, placeholder, [next(image)], add_special_tokens=False)[0])
        else:
            out.extend(_expansion(processor, placeholder, next(image)))
    return out, tensors


def _expansion(processor, placeholder: str, image) -> list[int]:
    """The ids the processor writes for ``placeholder`` with ``image``, as they follow a word: after an anchor word,
    whose ids are then dropped (a tokenizer that marks the start of a text, SentencePiece's prefix space, marks a
    placeholder written alone, as it is at the start of a prompt)."""
    anchor = processor.tokenizer("a", add_special_tokens=False)["input_ids"]
    ids, _ = process(processor, "a" + placeholder, [image], add_special_tokens=False)
    if ids[:len(anchor)] == anchor:
        return ids[len(anchor):]
    return process(processor, placeholder, [image], add_special_tokens=False)[0]


def render_chat(tokenizer, processor, conversation: list, media: MediaPolicy, template: dict) -> tuple[dict, dict | None]:
    """One conversation through the chat template (``template``: ``apply_chat_template``'s keywords) as the engine's
    prompt, and its image tensors (None without images)."""
    messages, images = split_chat(conversation, lambda source: load_image(source, media),
                                  placeholder=image_placeholder(tokenizer, processor, template.get("chat_template")))
    text = tokenizer.apply_chat_template(messages, tokenize=False, **template)
    if images:  # the template holds the special tokens
        ids, tensors = process(processor, text, images, add_special_tokens=False)
    else:
        ids, tensors = tokenizer(text, add_special_tokens=False)["input_ids"], None
    return {"prompt": text, "prompt_token_ids": ids}, tensors


def processed_images(prompts: list, processor, media: MediaPolicy) -> list[dict | None]:
    """The image tensors of each ``(engine prompt, salt)`` of ``prompts`` (None without images); each
    ``multi_modal_data`` prompt is replaced, in place, by its processed token ids."""
    images: list[dict | None] = [None] * len(prompts)
    for index, (prompt, salt) in enumerate(prompts):
        if isinstance(prompt, Mapping) and "multi_modal_data" in prompt:
            engine_prompt, images[index] = image_prompt(prompt, processor, media)
            prompts[index] = (engine_prompt, salt)
    return images
