"""Tiny random vision-language models and their processors, built from small configs and local pieces (nothing is
downloaded): a LLaVA (a 2-layer CLIP vision tower on 16x16 images, 4x4 patches, its projector and a 2-layer Llama)
whose processor is LLaVA's PIL image processor with the stories260K tokenizer plus an ``<image>`` token."""

from __future__ import annotations

import numpy as np
import torch
import transformers
from PIL import Image

from models import STORIES, require_stories

IMAGE_SIZE = 16
PATCH = 4
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # CLIP's CLS token is dropped ("default" strategy)
IMAGE_TOKEN_ID = 512  # the stories260K vocabulary (512) plus "<image>"
VOCAB = 520


def seeded_model(model_class, config, seed: int, attn_implementation: str):
    """``model_class(config)`` in eval mode, its weights drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    model.set_attn_implementation(attn_implementation)
    return model


def without_video_processor(processor_class, **parts):
    """``processor_class(**parts, video_processor=None)``: transformers' video processors need torchvision, which
    these tests do without (no video is asked of the processor), and the processor checks each part's class."""
    from unittest import mock

    with mock.patch.object(transformers.ProcessorMixin, "check_argument_for_proper_class", lambda *args: None):
        return processor_class(**parts, video_processor=None)


def tiny_llava(attn_implementation: str = "sdpa", seed: int = 0):
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH,
                                           projection_dim=32)
    text = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID,
                                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    return seeded_model(transformers.LlavaForConditionalGeneration, config, seed, attn_implementation)


def llava_processor():
    """LLaVA's processor: its PIL image processor (resize to 16, crop 16x16) and the stories260K tokenizer with
    ``<image>`` added (id 512)."""
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    require_stories()
    tokenizer = transformers.AutoTokenizer.from_pretrained(STORIES)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert tokenizer.convert_tokens_to_ids("<image>") == IMAGE_TOKEN_ID
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for part in m['content'] %}{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}"
        "{% endif %}{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    images = LlavaImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                    crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                                       vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                       chat_template=tokenizer.chat_template)


def random_pixels(count: int, seed: int) -> torch.Tensor:
    """``[count, 3, 16, 16]`` processed-looking pixel values."""
    return torch.randn(count, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed))


def random_image(seed: int, size: tuple[int, int] = (24, 20)) -> Image.Image:
    """A random RGB PIL image of ``size`` (width, height)."""
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def prompt_with_images(num_images: int, seed: int, text_len: int = 3) -> list[int]:
    """Token ids: text, then each image's placeholder run followed by a few text tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = [1] + torch.randint(3, 500, (text_len,), generator=generator).tolist()
    for _ in range(num_images):
        ids += [IMAGE_TOKEN_ID] * IMAGE_TOKENS + torch.randint(3, 500, (2,), generator=generator).tolist()
    return ids


# ------------------------------------------------------------------------------------------------ Qwen2-VL
VISION_START, VISION_END, QWEN_IMAGE_TOKEN_ID = 513, 514, 515
GEMMA_IMAGE_TOKEN_ID = 515
# the text model of the tiny Qwen2-VL and Qwen2.5-VL: 2 layers, M-RoPE sections 2/3/3 of head_dim 16
QWEN2_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})


def tiny_qwen2_vl(attn_implementation: str = "sdpa", seed: int = 0):
    """A 2-layer Qwen2-VL (M-RoPE sections 2/3/3 of head_dim 16) with a 2-block vision tower on 4x4 patches, merged
    2x2; ids 513-516 are its vision start / end, image and video tokens."""
    text = QWEN2_TEXT
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=QWEN_IMAGE_TOKEN_ID,
                                        video_token_id=516, vision_start_token_id=VISION_START,
                                        vision_end_token_id=VISION_END)
    return seeded_model(transformers.Qwen2VLForConditionalGeneration, config, seed, attn_implementation)


def tiny_qwen2_5_vl(attn_implementation: str = "sdpa", seed: int = 0):
    """``tiny_qwen2_vl``'s text model and ids with Qwen2.5-VL's vision tower: 2 blocks on 4x4 patches merged 2x2, the
    first attending within windows of 2x2 merged patches (``window_size`` 16 pixels), the second over the image."""
    text = QWEN2_TEXT
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=16, fullatt_block_indexes=[1],
                  tokens_per_second=2)
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=QWEN_IMAGE_TOKEN_ID,
                                           video_token_id=516, vision_start_token_id=VISION_START,
                                           vision_end_token_id=VISION_END)
    return seeded_model(transformers.Qwen2_5_VLForConditionalGeneration, config, seed, attn_implementation)


def tiny_qwen3_vl(attn_implementation: str = "sdpa", seed: int = 0, moe: bool = False):
    """``tiny_qwen2_vl``'s ids with Qwen3-VL (``moe``: Qwen3-VL-MoE, 4 experts, 2 a token): 3 text layers with
    interleaved M-RoPE, a 3-block vision tower on 4x4 patches merged 2x2 whose first two blocks' merged rows are also
    added to the first two decoder layers' image rows (DeepStack)."""
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    if moe:
        text.update(moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=64,
                  deepstack_visual_indexes=[0, 1])
    config_class = transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig
    config = config_class(text_config=text, vision_config=vision, image_token_id=QWEN_IMAGE_TOKEN_ID,
                          video_token_id=516, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    model_class = transformers.Qwen3VLMoeForConditionalGeneration if moe else \
        transformers.Qwen3VLForConditionalGeneration
    return seeded_model(model_class, config, seed, attn_implementation)


def tiny_qwen3_5(attn_implementation: str = "sdpa", seed: int = 0, moe: bool = False):
    """``tiny_qwen2_vl``'s ids with Qwen3.5 (``moe``: Qwen3.5-MoE, 4 experts, 2 a token): a hybrid text model of 4
    layers (gated DeltaNet and attention alternating) with interleaved M-RoPE, a 2-block vision tower on 4x4
    patches merged 2x2."""
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0,
                layer_types=["linear_attention", "full_attention"] * 2, linear_num_value_heads=4,
                linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True, "partial_rotary_factor": 1.0})
    if moe:
        text.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=64)
    config_class = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    config = config_class(text_config=text, vision_config=vision, image_token_id=QWEN_IMAGE_TOKEN_ID,
                          video_token_id=516, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    model_class = transformers.Qwen3_5MoeForConditionalGeneration if moe else \
        transformers.Qwen3_5ForConditionalGeneration
    return seeded_model(model_class, config, seed, attn_implementation)


# ------------------------------------------------------------------------------------------------ LLaVA-NeXT
NEXT_PINPOINTS = [[16, 32], [32, 16], [32, 32]]
NEXT_SIZES = ((40, 20), (30, 30), (50, 17), (16, 16))


def tiny_llava_next(attn_implementation: str = "sdpa", seed: int = 0):
    """``tiny_llava``'s towers as LLaVA-NeXT: each image is its 16x16 base view and the crops of its best grid
    (``NEXT_PINPOINTS``), their features unpadded to the image's aspect with a newline row after each line."""
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH,
                                           projection_dim=32)
    text = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = transformers.LlavaNextConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID,
                                          image_grid_pinpoints=NEXT_PINPOINTS, vision_feature_layer=-2,
                                          vision_feature_select_strategy="default")
    model = seeded_model(transformers.LlavaNextForConditionalGeneration, config, seed, attn_implementation)
    return with_random_newline(model)


def with_random_newline(model):
    """``model`` with its image newline embedding drawn at random (transformers starts it at zeros)."""
    with torch.no_grad():
        model.model.image_newline.normal_()
    return model


def llava_next_processor():
    """LLaVA-NeXT's processor: its PIL image processor (16x16 views, ``NEXT_PINPOINTS``) and ``llava_processor``'s
    tokenizer (``<image>`` 512)."""
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    images = LlavaNextImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, image_grid_pinpoints=NEXT_PINPOINTS,
                                        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return transformers.LlavaNextProcessor(image_processor=images, tokenizer=llava_processor().tokenizer,
                                           patch_size=PATCH, vision_feature_select_strategy="default",
                                           num_additional_image_tokens=1)


def tiny_llava_onevision(attn_implementation: str = "sdpa", seed: int = 0):
    """LLaVA-OneVision: a 2-layer SigLIP tower on 16x16 views of 4x4 patches (every token kept: "full") and a
    2-layer Qwen2, the views and crops as ``tiny_llava_next``'s."""
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH)
    text = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = transformers.LlavaOnevisionConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID,
                                               video_token_id=513, image_grid_pinpoints=NEXT_PINPOINTS,
                                               vision_feature_layer=-1, vision_feature_select_strategy="full")
    model = seeded_model(transformers.LlavaOnevisionForConditionalGeneration, config, seed, attn_implementation)
    return with_random_newline(model)


def llava_onevision_processor():
    """LLaVA-OneVision's processor: its PIL image processor (16x16 views, ``NEXT_PINPOINTS``) and ``llava_processor``'s
    tokenizer; built without its video processor, which needs torchvision (no video is asked of it)."""
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import \
        LlavaOnevisionImageProcessorPil

    images = LlavaOnevisionImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                             image_grid_pinpoints=NEXT_PINPOINTS)
    return without_video_processor(transformers.LlavaOnevisionProcessor, image_processor=images,
                                   tokenizer=llava_processor().tokenizer, num_image_tokens=(IMAGE_SIZE // PATCH) ** 2,
                                   vision_feature_select_strategy="full")


def llava_next_case(num_images: int, seed: int, family: str = "llava_next") -> tuple[list[int], dict | None]:
    """A text of ``num_images`` images of ``NEXT_SIZES`` through the family's processor: its ids and tensors."""
    words = ["Look", "at", "the", "cat", "and", "dog", "now"]
    text = " ".join(words[(seed + i) % len(words)] + " <image>" for i in range(num_images)) + " " + words[seed % 7]
    images = [random_image(seed * 10 + i, NEXT_SIZES[(seed + i) % len(NEXT_SIZES)]) for i in range(num_images)]
    processor = llava_next_processor() if family == "llava_next" else llava_onevision_processor()
    out = processor(text=[text], images=images or None, return_tensors="pt")
    tensors = {name: out[name] for name in ("pixel_values", "image_sizes")} if num_images else None
    return out["input_ids"][0].tolist(), tensors


# ------------------------------------------------------------------------------------------------ Idefics3, SmolVLM
FAKE_IMAGE, GLOBAL_IMAGE, FIRST_ROW_COL = 513, 514, 515  # <fake_token_around_image>, <global-img>, <row_1_col_1>
TILE_TOKENS = 4  # a 16x16 tile: 16 patches, pixel-shuffled by 2 into 4 tokens
TILE_LAYOUTS = ((1, 2), (2, 2), (0, 0))  # rows x columns of crops before each image's global view (0: no crops)


def tiny_tiled(family: str, attn_implementation: str = "sdpa", seed: int = 0):
    """A 2-layer Llama behind a 2-layer SigLIP tower on 16x16 tiles of 4x4 patches, pixel-shuffled by 2 (4 tokens a
    tile): ``family`` "idefics3" or "smolvlm"; the vocabulary holds the stories260K tokenizer's ids, ``<image>`` (512)
    and ``idefics3_processor``'s tokens."""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=PATCH)
    text = dict(model_type="llama", vocab_size=560, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)
    config_class, model_class = (transformers.Idefics3Config, transformers.Idefics3ForConditionalGeneration) \
        if family == "idefics3" else (transformers.SmolVLMConfig, transformers.SmolVLMForConditionalGeneration)
    config = config_class(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID, scale_factor=2)
    return seeded_model(model_class, config, seed, attn_implementation)


def tiled_case(num_images: int, seed: int) -> tuple[list[int], dict | None]:
    """Token ids as Idefics3's processor writes them (each image: a run of ``TILE_TOKENS`` placeholders per crop after
    its row/column marker, then one after ``<global-img>``), with random tiles ``[1, tiles, 3, 16, 16]``."""
    generator = torch.Generator().manual_seed(seed)
    ids = [1] + torch.randint(3, 500, (3,), generator=generator).tolist()
    tiles = 0
    for image in range(num_images):
        rows, cols = TILE_LAYOUTS[(seed + image) % len(TILE_LAYOUTS)]
        for row in range(rows):
            for col in range(cols):
                ids += [FAKE_IMAGE, FIRST_ROW_COL + 6 * row + col] + [IMAGE_TOKEN_ID] * TILE_TOKENS
            ids += [13] if rows else []
        ids += [FAKE_IMAGE, GLOBAL_IMAGE] + [IMAGE_TOKEN_ID] * TILE_TOKENS + [FAKE_IMAGE]
        ids += torch.randint(3, 500, (2,), generator=generator).tolist()
        tiles += rows * cols + 1
    if not num_images:
        return ids, None
    pixels = torch.randn(1, tiles, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    return ids, {"pixel_values": pixels, "pixel_attention_mask": torch.ones(1, tiles, IMAGE_SIZE, IMAGE_SIZE,
                                                                            dtype=torch.bool)}


def idefics3_processor():
    """Idefics3's processor: its PIL image processor (images resized to 32 pixels on their longer side, cut in 16x16
    crops plus the whole image at 16) and the stories260K tokenizer with ``<image>`` (512) and the processor's
    markers added, as in ``tiled_case``."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    require_stories()
    tokenizer = transformers.AutoTokenizer.from_pretrained(STORIES)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<image>", "<fake_token_around_image>", "<global-img>",
        *[f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)], "<end_of_utterance>"]})
    assert tokenizer.convert_tokens_to_ids(["<image>", "<global-img>"]) == [IMAGE_TOKEN_ID, GLOBAL_IMAGE]
    images = Idefics3ImageProcessorPil(do_image_splitting=True, size={"longest_edge": 2 * IMAGE_SIZE},
                                       max_image_size={"longest_edge": IMAGE_SIZE})
    return transformers.Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=TILE_TOKENS)


def qwen2_vl_images(images: list) -> dict:
    """Qwen2-VL's PIL image processor on ``images`` (resized to 64..1024 pixels, 4x4 patches, 2x2 merge)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(min_pixels=8 * 8, max_pixels=32 * 32, patch_size=4, merge_size=2,
                                         temporal_patch_size=2)
    return dict(processor(images, return_tensors="pt"))


def qwen2_vl_processor():
    """Qwen2-VL's processor: ``qwen2_vl_images``' image processor and the stories260K tokenizer with its vision tokens
    added (<|vision_start|> 513, <|vision_end|> 514, <|image_pad|> 515, <|video_pad|> 516). Its video processor needs
    torchvision, which this project's tests do without: the processor is built without one (no video is asked of it)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    require_stories()
    tokenizer = transformers.AutoTokenizer.from_pretrained(STORIES)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|unused|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]})
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == QWEN_IMAGE_TOKEN_ID
    images = Qwen2VLImageProcessorPil(min_pixels=8 * 8, max_pixels=32 * 32, patch_size=4, merge_size=2,
                                      temporal_patch_size=2)
    return without_video_processor(transformers.Qwen2VLProcessor, image_processor=images, tokenizer=tokenizer)


def qwen2_vl_prompt(image_inputs: dict, seed: int, text_len: int = 3) -> list[int]:
    """Token ids: text, then per image <vision_start>, its merged patches' placeholders, <vision_end>, text."""
    generator = torch.Generator().manual_seed(seed)
    ids = [1] + torch.randint(3, 500, (text_len,), generator=generator).tolist()
    grid = image_inputs["image_grid_thw"] if image_inputs else torch.zeros(0, 3, dtype=torch.long)
    for count in (grid.prod(-1) // 4).tolist():
        ids += [VISION_START] + [QWEN_IMAGE_TOKEN_ID] * count + [VISION_END]
        ids += torch.randint(3, 500, (2,), generator=generator).tolist()
    return ids


# ------------------------------------------------------------------------------------------------ both families
VISION_FAMILIES = ("llava", "llava_next", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
                   "gemma3", "idefics3", "smolvlm")
TILED = ("idefics3", "smolvlm")
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")  # the same processor, ids and M-RoPE form
QWEN_SIZES = ((28, 20), (16, 16), (40, 12), (20, 20))  # images of 8, 4, 6 and 4 placeholders


def vision_model(family: str):
    if family == "gemma3":
        model = tiny_gemma3()
        model.set_attn_implementation("sdpa")
        return model
    if family in TILED:
        return tiny_tiled(family)
    if family == "llava_next":
        return tiny_llava_next()
    if family == "llava_onevision":
        return tiny_llava_onevision()
    if family.startswith("qwen3_vl"):
        return tiny_qwen3_vl(moe=family == "qwen3_vl_moe")
    return tiny_llava() if family == "llava" else tiny_qwen2_vl() if family == "qwen2_vl" else tiny_qwen2_5_vl()


def vision_case(family: str, num_images: int, seed: int) -> tuple[list[int], dict | None]:
    """A prompt of ``num_images`` random images for ``family``: its token ids and the engine's ``images``."""
    if family in TILED:
        return tiled_case(num_images, seed)
    if family in ("llava_next", "llava_onevision"):
        return llava_next_case(num_images, seed, family)
    if family == "llava":
        ids = prompt_with_images(num_images, seed)
        return ids, ({"pixel_values": random_pixels(num_images, seed)} if num_images else None)
    if family == "gemma3":  # <start_of_image>, 4 image tokens, <end_of_image>
        generator = torch.Generator().manual_seed(seed)
        ids = [1] + torch.randint(3, 500, (3,), generator=generator).tolist()
        for _ in range(num_images):
            ids += [513] + [GEMMA_IMAGE_TOKEN_ID] * 4 + [514] + torch.randint(3, 500, (2,), generator=generator).tolist()
        return ids, ({"pixel_values": random_pixels(num_images, seed)} if num_images else None)
    images = qwen2_vl_images([random_image(seed * 10 + i, QWEN_SIZES[(seed + i) % 4]) for i in range(num_images)]) \
        if num_images else None
    return qwen2_vl_prompt(images, seed), images


def generate_kwargs(family: str, ids: list[int], images: dict | None) -> dict:
    """What ``model.generate`` takes besides the ids for ``images`` (Qwen2-VL, Qwen2.5-VL: the token types of their
    M-RoPE)."""
    if images is None:
        return {}
    if family in QWEN_FAMILIES:
        return {**images, "mm_token_type_ids": (torch.tensor([ids]) == QWEN_IMAGE_TOKEN_ID).int()}
    if family == "gemma3":  # its image tokens attend to each other both ways
        return {**images, "token_type_ids": (torch.tensor([ids]) == GEMMA_IMAGE_TOKEN_ID).long()}
    return dict(images)


def tiny_gemma3(seed: int = 0, boi: int = 513, eoi: int = 514, image: int = 515):
    """A 2-layer Gemma 3 (sliding window 8) with a 2-layer SigLIP tower on 16x16 images pooled to 4 tokens; ``boi``,
    ``eoi``, ``image``: its begin-of-image, end-of-image and image token ids."""
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=8, bos_token_id=1,
                eos_token_id=2, pad_token_id=0, query_pre_attn_scalar=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=PATCH)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=image, boi_token_index=boi, eoi_token_index=eoi)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers starts the projector at zeros: every image would embed the same
        projector = model.model.multi_modal_projector.mm_input_projection_weight
        projector.normal_(0.0, projector.shape[0] ** -0.5)
    return model


def gemma3_processor():
    """Gemma 3's processor: its PIL image processor (16x16, no pan and scan) and the stories260K tokenizer with its
    image tokens added (<start_of_image> 512, <end_of_image> 513, <image_soft_token> 514), 4 tokens per image."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    require_stories()
    tokenizer = transformers.AutoTokenizer.from_pretrained(STORIES, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    images = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False)
    return transformers.Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=4)
