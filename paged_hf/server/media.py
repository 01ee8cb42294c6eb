"""Chat requests with image content parts: their images read under the server's ``MediaPolicy`` (data: URLs; local
files and remote hosts only where ``--allowed-local-media-path`` / ``--allowed-media-domains`` allow), the messages
rendered by the chat template and run through the model's processor, in a worker thread (decoding an image never
stalls the engine thread). Every refusal is a 400 naming ``messages``: no processor, too many images
(``limit_mm_per_prompt``), an image that cannot be read or decoded or is larger than ``max_image_pixels``, a prompt
past ``max_model_len``.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from ..config import ParameterError
from ..media import MediaPolicy, load_image
from ..multimodal_prompts import image_placeholder, process, split_chat
from .errors import ApiError
from .prompts import PromptTokenizer


class ImagePrompts:
    """``processor``: the model's (None: image parts get a 400); ``max_images``: per request (None: no limit)."""

    def __init__(self, prompts: PromptTokenizer, processor, policy: MediaPolicy, max_images: int | None) -> None:
        self.prompts = prompts
        self.processor = processor
        self.policy = policy
        self.max_images = max_images

    async def chat(self, messages: list[dict], num_images: int, template_kwargs: dict, add_generation_prompt: bool,
                   add_special_tokens: bool, truncate: int | None) -> tuple[dict, dict]:
        """The engine's prompt of a chat with ``num_images`` image parts, and its image tensors (``images``)."""
        if self.processor is None:
            raise ApiError(400, "this server takes no images: its model has no processor", "messages")
        if self.max_images is not None and num_images > self.max_images:
            raise ApiError(400, f"the messages hold {num_images} images; at most {self.max_images} are allowed "
                                f"(limit_mm_per_prompt)", "messages")
        if truncate is not None:
            raise ApiError(400, "truncate_prompt_tokens cannot cut a prompt with images (it would cut an image's "
                                "placeholder tokens)", "truncate_prompt_tokens")
        self.prompts._check_length(sum(len(part.get("text", "")) for m in messages for part in m["content"]
                                       if isinstance(m["content"], list)), "messages")
        return await run_in_threadpool(self._render, messages, template_kwargs, add_generation_prompt,
                                       add_special_tokens)

    def _render(self, messages, template_kwargs, add_generation_prompt, add_special_tokens) -> tuple[dict, dict]:
        try:
            rendered, images = split_chat(messages, lambda source: load_image(source, self.policy, "messages"),
                                          placeholder=image_placeholder(self.prompts.tokenizer, self.processor))
        except ParameterError as error:
            raise ApiError(400, str(error), "messages") from None
        text = self.prompts._template(rendered, template_kwargs, add_generation_prompt)
        self.prompts._check_length(len(text), "messages")
        try:
            ids, tensors = process(self.processor, text, images, add_special_tokens=add_special_tokens)
        except ParameterError as error:
            raise ApiError(400, str(error), "messages") from None
        self.prompts._check_tokens(ids, "messages")
        return {"prompt": text, "prompt_token_ids": ids}, tensors
