"""Images in the engine: a request's images, their placeholder tokens, and the vision tower's embeddings.

A request with images arrives with its placeholders already expanded (the model's processor writes one image token
per image embedding) and the processor's tensors (``pixel_values``, one row per image). ``RequestImages`` pairs each
image with its run of placeholder tokens and a digest of its pixels. The runner's ``ImageEncoder`` runs the vision
tower once per image, in the step that first computes any of its placeholder tokens (every image such a step needs,
in one call), and keeps the embeddings on the request until all its tokens are computed; a step whose tokens hold
image rows then runs on ``inputs_embeds`` (the text embeddings with the image rows written in), eagerly. A request
that computes an image's tokens again (preempted by recompute, or a prefix hit that ends inside the image) encodes
it again, so a chunk never needs an embedding that is gone.

Prefix caching sees the images through the request's block keys (``hashing.ContentSpans``): each block holding
placeholder tokens carries the digests of its images, and the chained hash carries them to every later block, so
the same image hits and another image behind the same placeholders misses.

The runner's side is ``image_encoder.py``. Families (``IMAGE_FAMILIES``): LLaVA (causal attention over the image
tokens, plain RoPE), LLaVA-NeXT and LLaVA-OneVision (an image's run is as long as its aspect makes it:
``image_sizes``); Idefics3 and SmolVLM (an image is tiles, its crops and the whole image scaled down, each a
run of placeholders after a marker: each tile is an image span of its own here; ``limit_mm_per_prompt`` counts the
global views, one per image); Qwen2-VL, Qwen2.5-VL (whose vision tower attends within windows: the model's own
``get_image_features``) and Qwen3-VL / Qwen3-VL-MoE (whose tower's earlier blocks also give rows that the first
decoder layers add to the image tokens' hidden states, DeepStack: cached per image beside its embeddings) and
Qwen3.5 / Qwen3.5-MoE (Qwen2.5-VL's form over a hybrid text model, whose recurrent layers ``recurrent_mixers``
runs), whose
M-RoPE positions (three rows: time, height, width) come from the model's ``get_rope_index`` once per request, at
``add_request``; a step then hands the model ``[3, 1, T]`` position ids, sliced from them for prompt tokens and
``position + rope delta`` for generated ones, and runs eagerly (the paged attention's causality still reads the
plain positions); and Gemma 3, whose image tokens attend to each other both ways: its images are never split across
chunks (``ImageChunks``: a chunk ends before an image it cannot finish), and the step's image queries are attended
again with a wider bound (``AttentionMetadata.pad_queries``: keys up to the image's last token, from the query's own
window start), which is transformers' mask for them (causal OR same image, within the window); and Gemma 4, whose
image tokens attend to each other both ways in its sliding layers only (``use_bidirectional_attention="vision"``; its
full layers stay causal), and whose step hands the model its token ids with the image rows as ``mm_encoder_outputs``
(its per-layer inputs are embeddings of the token ids: from ``inputs_embeds`` alone it would look image rows up in
its vocabulary). Other families' images raise ``NotImplementedError`` naming the family (their text runs).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..config import ParameterError
from ..hashing import ContentSpans

# config.model_type of the models whose images run
IMAGE_FAMILIES = ("llava", "llava_next", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
                  "qwen3_5", "qwen3_5_moe", "gemma3", "gemma4", "idefics3", "smolvlm")
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
DEEPSTACK_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")  # the vision tower's rows also enter the first decoder layers
# the step hands the model token ids and its image rows (``mm_encoder_outputs``), not ``inputs_embeds``
ENCODER_OUTPUT_FAMILIES = (*DEEPSTACK_FAMILIES, "gemma4")
# an image is tiles (its crops, then the whole image scaled down), each a run of placeholders after its own marker
# token; the processor's tensors are ``[1, tiles, ...]``; here each tile is an image span of its own
TILED_FAMILIES = ("idefics3", "smolvlm")
BIDIRECTIONAL_FAMILIES = ("gemma3",)  # an image's tokens attend to each other both ways
# ... in the sliding-window layers only, where the text config asks for it (``use_bidirectional_attention``)
SLIDING_BIDIRECTIONAL_FAMILIES = ("gemma4",)
FIXED_LENGTH_FAMILIES = ("llava",)  # every image takes the same number of placeholder tokens, with no marker around
PACKED_FAMILIES = ("llava_next", "llava_onevision")  # an image's tokens follow from its image_sizes, no marker around
# the processor tensors the encoder takes: one row per image (per tile for the tiled families), except the Qwen
# models' pixel_values (one row per patch, the image's rows being the product of its image_grid_thw row)
IMAGE_KEYS = ("pixel_values", "image_sizes", "image_grid_thw", "pixel_attention_mask", "image_position_ids")
# the tensors a family's tower cannot do without besides pixel_values: integer rows of (height, width) / (t, h, w)
REQUIRED_KEYS = {"llava_next": ("image_sizes", 2), "llava_onevision": ("image_sizes", 2),
                 **{family: ("image_grid_thw", 3) for family in MROPE_FAMILIES}}


@dataclass
class ImageSpan:
    """One image of a request: its placeholder tokens ``offset .. offset + length - 1`` of the prompt, its
    processor tensors (each with a leading dimension of 1) and the digest of its pixels."""

    offset: int
    length: int
    tensors: dict[str, torch.Tensor]
    digest: str

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class RequestImages:
    """A request's images in prompt order; ``embeds[i]``: image ``i``'s embeddings ``[length, hidden]`` while some of
    its tokens remain to be computed (the encoder cache). ``mrope_positions`` ``[3, prompt length]`` and
    ``rope_delta``: an M-RoPE model's prompt positions, and what a generated token adds to its position."""

    spans: list[ImageSpan]
    embeds: dict[int, torch.Tensor] = field(default_factory=dict)
    deepstack: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # per DeepStack layer, as ``embeds``
    mrope_positions: torch.Tensor | None = None
    rope_delta: int = 0
    bidirectional: bool = False

    def block_keys(self, salt) -> ContentSpans:
        """The request's prefix-cache keys: ``salt`` for every block, plus the digests of the images in it."""
        return ContentSpans(salt, tuple((s.offset, s.length, s.digest) for s in self.spans))

    def overlapping(self, start: int, stop: int) -> list[int]:
        """The images with placeholder tokens among positions ``start .. stop - 1``."""
        return [i for i, s in enumerate(self.spans) if s.offset < stop and s.end > start]


def image_token_id(model) -> int | None:
    """The placeholder token id of ``model``'s images, or None for a model that reads no images."""
    config = model.config
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def request_images(images, ids: list[int], model, max_images: int | None, max_chunk: int | None = None,
                   max_encoder_tokens: int | None = None) -> RequestImages | None:
    """Checks a request's ``images`` (a mapping of processor tensors: ``pixel_values`` ``[N, ...]``, optionally
    ``image_sizes`` ``[N, 2]``) against its prompt ``ids`` and pairs each image with its run of placeholder tokens.
    ``ParameterError`` (field ``images``) when they do not match; ``NotImplementedError`` for a family whose images
    the engine cannot run. None for a request without images (whose prompt must hold no placeholder).
    ``max_chunk``: the most tokens of one step (a bidirectional image must fit one); ``max_encoder_tokens``: the
    most image tokens encoded in one step (every image must fit it)."""
    token = image_token_id(model)
    runs = _placeholder_runs(ids, token) if token is not None else []
    if images is None:
        if runs:
            raise ParameterError("images", f"the prompt holds {sum(n for _, n in runs)} image placeholder tokens "
                                           f"(id {token}) but the request has no images")
        return None
    if token is None:
        raise ParameterError("images", f"{type(model).__name__} reads no images (its config names no image token)")
    family = model.config.model_type
    if family not in IMAGE_FAMILIES:
        raise NotImplementedError(f"PagedEngine runs images on {list(IMAGE_FAMILIES)} models, not {family!r} (its "
                                  f"text-only requests run)")
    if not isinstance(images, Mapping) or not isinstance(images.get("pixel_values"), torch.Tensor):
        raise ParameterError("images", "images must be the processor's tensors: a mapping with 'pixel_values' "
                                       f"(a tensor, one row per image), got {type(images).__name__}")
    unknown = sorted(set(images) - set(IMAGE_KEYS))
    if unknown:
        raise ParameterError("images", f"images has unsupported key(s) {unknown}; allowed keys are {list(IMAGE_KEYS)}")
    patches = None  # LLaVA-NeXT / -OneVision: each image's own patch rows (the processor pads them to the longest)
    if family in REQUIRED_KEYS:
        _check_sizes(images, *REQUIRED_KEYS[family], family)
        patches = _check_pixels(images, model.config)
    if family in TILED_FAMILIES:
        images = _tiles(images)
    if family == "gemma4":
        _check_patch_positions(images)
    pixels = images["pixel_values"]
    grid = images.get("image_grid_thw")
    count = grid.shape[0] if isinstance(grid, torch.Tensor) and grid.dim() > 0 else \
        pixels.shape[0] if pixels.dim() > 0 else 0
    if count == 0:
        raise ParameterError("images", "images['pixel_values'] holds no image")
    num_images = _tiled_images(ids, runs) if family in TILED_FAMILIES else count
    if max_images is not None and num_images > max_images:
        raise ParameterError("images", f"the request has {num_images} images; at most {max_images} are allowed "
                                       f"(limit_mm_per_prompt)")
    if not torch.isfinite(pixels).all():
        raise ParameterError("images", "pixel_values holds NaN or infinite values")
    if len(runs) < count and family in FIXED_LENGTH_FAMILIES:
        per = _llava_image_tokens(model.config)
        runs = _split_runs(runs, [per] * count) if per else runs
    elif len(runs) < count and family in PACKED_FAMILIES:
        runs = _split_runs(runs, _packed_lengths(model, images))
    if len(runs) != count:
        unit = "tiles" if family in TILED_FAMILIES else "images"
        raise ParameterError("images", f"the prompt holds {len(runs)} runs of image placeholder tokens (id {token}) "
                                       f"for {count} {unit}: the processor writes one run per {unit[:-1]}")
    rows = _pixel_rows(images, count, runs, model)
    for name, value in images.items():
        if name != "pixel_values" and (not isinstance(value, torch.Tensor) or value.dim() == 0 or
                                       value.shape[0] != count):
            raise ParameterError("images", f"images[{name!r}] must be a tensor with one row per image ({count})")
    spans = []
    bounds = [0, *itertools.accumulate(rows)]
    for i, (offset, length) in enumerate(runs):  # copies: the caller may reuse its tensors (the digest is of these)
        tensors = {name: (value[bounds[i] : bounds[i + 1]] if name == "pixel_values" else value[i : i + 1])
                   .detach().to("cpu", copy=True) for name, value in images.items()}
        if patches:  # without the padding, an image's digest and tensors do not depend on the prompt's other images
            tensors["pixel_values"] = tensors["pixel_values"][:, : patches[i]].clone()
        spans.append(ImageSpan(offset, length, tensors, _digest(tensors)))
    result = RequestImages(spans, bidirectional=bidirectional(model))
    longest = max(length for _, length in runs)
    if result.bidirectional and max_chunk is not None and longest > max_chunk:
        raise ParameterError("images", f"an image of {longest} tokens must be computed in one step, but "
                                       f"max_num_batched_tokens is {max_chunk}")
    if max_encoder_tokens is not None and longest > max_encoder_tokens:
        raise ParameterError("images", f"an image of {longest} tokens is more than the vision tower may encode in "
                                       f"one step (max_num_encoder_input_tokens={max_encoder_tokens})")
    if family in MROPE_FAMILIES:
        result.mrope_positions, result.rope_delta = _mrope_positions(model, ids, token, images["image_grid_thw"])
    return result


def bidirectional(model) -> bool:
    """Whether ``model``'s image tokens attend to each other both ways (Gemma 3; Gemma 4 where its text config says
    ``use_bidirectional_attention="vision"``, in its sliding layers: ``SLIDING_BIDIRECTIONAL_FAMILIES``)."""
    family = model.config.model_type
    if family in SLIDING_BIDIRECTIONAL_FAMILIES:
        return getattr(model.config.get_text_config(), "use_bidirectional_attention", None) == "vision"
    return family in BIDIRECTIONAL_FAMILIES


def _check_patch_positions(images: Mapping) -> None:
    """Gemma 4's tower places each patch by ``image_position_ids`` ``[N, patches, 2]`` (integers; -1 for the
    processor's padding patches), one row per image of ``pixel_values`` ``[N, patches, patch values]``."""
    pixels, positions = images["pixel_values"], images.get("image_position_ids")
    if not isinstance(positions, torch.Tensor):
        raise ParameterError("images", "gemma4 images need images['image_position_ids'] (the processor's, [N, "
                                       "patches, 2]) beside pixel_values")
    if pixels.dim() != 3 or positions.dim() != 3 or positions.shape != (*pixels.shape[:2], 2) or \
            positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise ParameterError("images", f"images['image_position_ids'] must be an integer [N, patches, 2] tensor "
                                       f"matching pixel_values {list(pixels.shape)}, got {positions.dtype} "
                                       f"{list(positions.shape)}")


def _check_sizes(images: Mapping, name: str, width: int, family: str) -> None:
    """``images[name]`` must be ``[N, width]`` positive integers (the tower sizes each image by its row)."""
    value = images.get(name)
    if value is None:
        raise ParameterError("images", f"{family} images need images[{name!r}] (the processor's, one row per "
                                       f"image) beside pixel_values")
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[1] != width or \
            value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool or \
            not bool((value > 0).all()):
        shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ParameterError("images", f"images[{name!r}] must be an integer tensor [images, {width}] of positive "
                                       f"sizes, got {shape}")


def _check_pixels(images: Mapping, config) -> list[int] | None:
    """``pixel_values`` in the form the family's tower reads: LLaVA-NeXT's ``[images, patches, C, H, W]`` (at least
    the patches of each image's best grid: the processor pads the others), the Qwen models' ``[patches, C * t * p *
    p]``. LLaVA-NeXT's patches of each image, None for the Qwen models."""
    pixels, vision = images["pixel_values"], config.vision_config
    if "image_grid_thw" in images:
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        if pixels.dim() != 2 or pixels.shape[1] != width:
            raise ParameterError("images", f"images['pixel_values'] must be [patches, {width}] (channels x "
                                           f"temporal_patch_size x patch_size^2), got {list(pixels.shape)}")
        return None
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches  # noqa: PLC0415

    if pixels.dim() != 5 or pixels.shape[0] != images["image_sizes"].shape[0]:
        raise ParameterError("images", f"images['pixel_values'] must be [images, patches, channels, height, width] "
                                       f"with a row per image_sizes row, got {list(pixels.shape)}")
    patches = []
    for index, size in enumerate(images["image_sizes"].tolist()):
        patches.append(image_size_to_num_patches(size, config.image_grid_pinpoints, vision.image_size))
        if pixels.shape[1] < patches[-1]:
            raise ParameterError("images", f"image {index} of size {size} (image_sizes) takes {patches[-1]} patches "
                                           f"but images['pixel_values'] holds {pixels.shape[1]} a row")
    return patches


def _tiles(images: Mapping) -> dict:
    """A tiled family's processor tensors (``pixel_values`` ``[1, tiles, C, H, W]``, ``pixel_attention_mask`` ``[1,
    tiles, H, W]``: one prompt's) with a row per tile."""
    pixels = images["pixel_values"]
    if pixels.dim() != 5 or pixels.shape[0] != 1:
        raise ParameterError("images", f"images['pixel_values'] must be the processor's [1, tiles, channels, height, "
                                       f"width] of one prompt, got {list(pixels.shape)}")
    mask = images.get("pixel_attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or
                             mask.shape != (*pixels.shape[:2], *pixels.shape[3:])):
        shape = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ParameterError("images", f"images['pixel_attention_mask'] must be [1, tiles, height, width] as "
                                       f"pixel_values {list(pixels.shape)}, got {shape}")
    return {**images, "pixel_values": pixels[0], **({"pixel_attention_mask": mask[0]} if mask is not None else {})}


def _tiled_images(ids: list[int], runs: list[tuple[int, int]]) -> int:
    """The images of a tiled family's prompt: each ends with its global view, whose run follows the same marker token
    (the last run's: the prompt's last image ends it); the other tiles' markers name their row and column."""
    marker = ids[runs[-1][0] - 1] if runs and runs[-1][0] > 0 else None
    return sum(offset > 0 and ids[offset - 1] == marker for offset, _ in runs)


def _pixel_rows(images, count: int, runs: list[tuple[int, int]], model) -> list[int]:
    """The rows of ``pixel_values`` of each image: one, or (with ``image_grid_thw``) its patches, whose merged count
    must equal its placeholders."""
    pixels, grid = images["pixel_values"], images.get("image_grid_thw")
    if grid is None:
        if pixels.shape[0] != count:
            raise ParameterError("images", f"images['pixel_values'] must have one row per image ({count})")
        return [1] * count
    if not isinstance(grid, torch.Tensor) or grid.shape != (count, 3):
        raise ParameterError("images", f"images['image_grid_thw'] must be a [{count}, 3] tensor (one row per image)")
    patches = grid.prod(-1).tolist()
    if sum(patches) != pixels.shape[0]:
        raise ParameterError("images", f"images['pixel_values'] has {pixels.shape[0]} rows but image_grid_thw "
                                       f"counts {sum(patches)} patches")
    merge = model.config.vision_config.spatial_merge_size ** 2
    for index, ((_, length), num_patches) in enumerate(zip(runs, patches)):
        if num_patches // merge != length:
            raise ParameterError("images", f"image {index} has {num_patches // merge} merged patches "
                                           f"(image_grid_thw) but the prompt holds {length} placeholder tokens for it")
    return patches


def _mrope_positions(model, ids: list[int], token: int, grid: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The prompt's ``[3, L]`` M-RoPE positions and its rope delta, from the model's own ``get_rope_index``."""
    ids_tensor = torch.tensor([ids], dtype=torch.long)
    owner = model if hasattr(model, "get_rope_index") else model.model
    positions, delta = owner.get_rope_index(ids_tensor, (ids_tensor == token).int(), image_grid_thw=grid.cpu())
    return positions[:, 0].cpu(), int(delta.reshape(-1)[0])


def _placeholder_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of consecutive ``token`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    for position, value in enumerate(ids):
        if value != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return runs


def _llava_image_tokens(config) -> int | None:
    """The placeholder tokens of one LLaVA image: its patches, and the CLS token under the "full" feature strategy
    (None where the config does not say)."""
    vision = getattr(config, "vision_config", None)
    size, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    if not isinstance(size, int) or not isinstance(patch, int) or patch <= 0:
        return None
    return (size // patch) ** 2 + (getattr(config, "vision_feature_select_strategy", "default") == "full")


def _packed_lengths(model, images: Mapping) -> list[int] | None:
    """The placeholder tokens of each LLaVA-NeXT / -OneVision image (its base view, then its grid's crops unpadded to
    its aspect, a newline after each line): the model's own ``pack_image_features`` on meta tensors of the tower's
    output shapes, which computes nothing. None where the model's packing does not take them."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches  # noqa: PLC0415

    config, inner = model.config, model.model
    vision, hidden = config.vision_config, config.text_config.hidden_size
    side = vision.image_size // vision.patch_size
    extra = {"vision_aspect_ratio": config.vision_aspect_ratio} if config.model_type == "llava_onevision" else \
        {"vision_feature_select_strategy": config.vision_feature_select_strategy}
    lengths = []
    try:
        for size in images["image_sizes"]:
            patches = image_size_to_num_patches(size.tolist(), config.image_grid_pinpoints, vision.image_size)
            features = torch.empty(patches, side * side, hidden, device="meta")
            packed = inner.pack_image_features([features], size[None], image_newline=inner.image_newline.to("meta"),
                                               **extra)[0]
            lengths.append(packed[0].shape[0])
    except Exception:  # noqa: BLE001 - another version's packing: the runs stay as they are
        return None
    return lengths


def _split_runs(runs: list[tuple[int, int]], lengths: list[int] | None) -> list[tuple[int, int]]:
    """``runs`` cut into images of ``lengths`` tokens, in order (two images with nothing between them are one run);
    unchanged where the runs are not the images' lengths end to end."""
    if lengths is None:
        return runs
    out, images = [], iter(lengths)
    for offset, length in runs:
        end = offset + length
        while offset < end:
            size = next(images, None)
            if size is None or offset + size > end:
                return runs
            out.append((offset, size))
            offset += size
    return out if len(out) == len(lengths) else runs


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """BLAKE2b of an image's processor tensors (names, dtypes, shapes and bytes): its identity in the prefix cache."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        value = tensors[name].contiguous()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)};".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


class ImageChunks:
    """One step's rules for chunks through images (the scheduler makes one per step): a chunk never ends inside a
    bidirectional image (Gemma 3), and the images whose vision tower runs this step (their first tokens are computed
    and their embeddings are not cached) hold at most ``encoder_budget`` placeholder tokens together (None: no
    limit). A chunk cut to 0 tokens waits for a later step."""

    def __init__(self, encoder_budget: int | None) -> None:
        self.left = encoder_budget

    def chunk(self, request, start: int, count: int) -> int:
        """``count`` tokens of ``request`` from ``start``, cut before the first image they may not take; the images
        it encodes are counted against the budget (as soon as the chunk is cut: a chunk the scheduler then cannot
        place only leaves less encoding to this step)."""
        images = request.images
        if images is None:
            return count
        stop = start + count
        for index in images.overlapping(start, stop):
            span = images.spans[index]
            encodes = index not in images.embeds
            if (images.bidirectional and span.end > stop) or \
                    (encodes and self.left is not None and span.length > self.left):
                return max(0, span.offset - start)
            if encodes and self.left is not None:
                self.left -= span.length
        return count
