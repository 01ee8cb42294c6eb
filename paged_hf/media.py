"""Images from where a prompt names them: ``data:`` URLs (base64), local files under an allowed folder, remote URLs of
allowed domains, or PIL images and uint8 numpy arrays / torch tensors given directly; each decoded with Pillow under
a pixel limit.

``MediaPolicy`` says what may be read: by default only data URLs and PIL images; ``allowed_local_media_path`` lets
``file://`` URLs (and plain paths) inside that folder through, ``allowed_media_domains`` lets ``http(s)`` URLs of
those hosts through (read with a timeout and a byte limit). Everything else, and anything that does not decode as
an image or is larger than ``max_image_pixels``, raises ``ParameterError`` naming the field (the server answers 400).
Pillow is imported only when an image is read (``pip install 'paged_hf[vision]'``).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass

import numpy as np
import torch

from .config import ParameterError

DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
REMOTE_TIMEOUT_S = 10.0
MAX_REMOTE_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class MediaPolicy:
    """What ``load_image`` may read. ``allowed_media_domains``: hosts whose ``http(s)`` URLs are fetched (None or
    empty: no remote URL); ``allowed_local_media_path``: a folder whose files may be read (None: no file);
    ``max_image_pixels``: the most width x height of one image."""

    allowed_media_domains: tuple[str, ...] | None = None
    allowed_local_media_path: str | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __post_init__(self) -> None:
        if isinstance(self.max_image_pixels, bool) or not isinstance(self.max_image_pixels, int) or \
                self.max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be an int >= 1, got {self.max_image_pixels!r}")
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(f"allowed_local_media_path must be a folder, got {self.allowed_local_media_path!r}")


def load_image(source, policy: MediaPolicy = MediaPolicy(), field: str = "image_url"):
    """The RGB PIL image ``source`` names (a URL string or a PIL image); ``ParameterError(field)`` when it may not be
    read, cannot be read or is not an image within the limits."""
    from PIL import Image  # noqa: PLC0415 - an optional dependency

    if isinstance(source, Image.Image):
        _check_size(source.size, policy, field)
        return source.convert("RGB")
    if isinstance(source, (np.ndarray, torch.Tensor)):
        return _array_image(source, policy, field)
    if not isinstance(source, str):
        raise ParameterError(field, f"an image must be a URL string, a PIL image or a uint8 numpy array / torch "
                                    f"tensor, got {type(source).__name__}")
    if source.startswith("data:"):
        data = _data_url_bytes(source, field)
    else:
        scheme = urllib.parse.urlsplit(source).scheme.lower()
        if scheme in ("http", "https"):
            data = _remote_bytes(source, policy, field)
        elif scheme in ("file", ""):
            data = _local_bytes(source, policy, field)
        else:
            raise ParameterError(field, f"image URLs must be data:, http(s): or file: URLs, got scheme {scheme!r:.20}")
    return decode_image(data, policy, field)


def _array_image(array, policy: MediaPolicy, field: str):
    """A numpy array or torch tensor of pixels as an RGB PIL image: uint8, ``[H, W]`` (grey), ``[C, H, W]`` or
    ``[H, W, C]`` with C in 1, 3, 4 (channels first where both read so, as transformers' image processors decide)."""
    from PIL import Image  # noqa: PLC0415

    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().numpy()
    channels = (1, 3, 4)
    if array.dtype != np.uint8 or array.ndim not in (2, 3) or (
            array.ndim == 3 and array.shape[0] not in channels and array.shape[-1] not in channels):
        raise ParameterError(field, f"an image array must be uint8 of shape [H, W], [C, H, W] or [H, W, C] with C "
                                    f"in {list(channels)}, got {array.dtype} {list(array.shape)}")
    if array.ndim == 3 and array.shape[0] in channels:
        array = array.transpose(1, 2, 0)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    _check_size((array.shape[1], array.shape[0]), policy, field)
    return Image.fromarray(np.ascontiguousarray(array)).convert("RGB")


def decode_image(data: bytes, policy: MediaPolicy = MediaPolicy(), field: str = "image_url"):
    """Decodes ``data`` as an image (its size checked from the header, before its pixels are decoded)."""
    from PIL import Image, ImageOps, UnidentifiedImageError  # noqa: PLC0415

    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as error:
        raise ParameterError(field, f"the image is too large to decode: {error}") from None
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise ParameterError(field, f"the image could not be decoded (not an image, or a format Pillow does not "
                                    f"read): {error}") from None
    _check_size(image.size, policy, field)
    try:  # upright as the camera meant it (EXIF orientation), as transformers' and vLLM's loaders turn it
        return ImageOps.exif_transpose(image).convert("RGB")  # decodes the pixels
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise ParameterError(field, f"the image could not be decoded: {error}") from None


def _check_size(size: tuple[int, int], policy: MediaPolicy, field: str) -> None:
    width, height = size
    if width < 1 or height < 1 or width * height > policy.max_image_pixels:
        raise ParameterError(field, f"the image is {width}x{height} pixels; at most {policy.max_image_pixels} pixels "
                                    f"(max_image_pixels) are allowed")


def _data_url_bytes(url: str, field: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ParameterError(field, "a data URL must be data:<media type>;base64,<data>")
    media_type = header[len("data:"):-len(";base64")]
    if media_type and not media_type.startswith("image/"):
        raise ParameterError(field, f"a data URL's media type must be image/*, got {media_type!r:.50}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ParameterError(field, f"the data URL's base64 does not decode: {error}") from None


def _check_host(url: str, policy: MediaPolicy, field: str) -> None:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if not policy.allowed_media_domains or host not in policy.allowed_media_domains:
        raise ParameterError(field, f"remote image URLs are not allowed for host {host!r:.100}: send the image as a "
                                    f"data: URL, or start the server with --allowed-media-domains")


class _AllowedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an http(s) URL of an allowed host: the allowlist bounds every hop."""

    def __init__(self, policy: MediaPolicy, field: str) -> None:
        self.policy, self.field = policy, field

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise ParameterError(self.field, f"the image URL redirects to {newurl!r:.200}: not an http(s) URL")
        _check_host(newurl, self.policy, self.field)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _remote_bytes(url: str, policy: MediaPolicy, field: str) -> bytes:
    _check_host(url, policy, field)
    opener = urllib.request.build_opener(_AllowedRedirects(policy, field))
    try:
        with opener.open(url, timeout=REMOTE_TIMEOUT_S) as response:
            data = response.read(MAX_REMOTE_BYTES + 1)
    except OSError as error:
        raise ParameterError(field, f"the image at {url!r:.200} could not be fetched: {error}") from None
    if len(data) > MAX_REMOTE_BYTES:
        raise ParameterError(field, f"the image at {url!r:.200} is larger than {MAX_REMOTE_BYTES} bytes")
    return data


def _local_bytes(url: str, policy: MediaPolicy, field: str) -> bytes:
    if policy.allowed_local_media_path is None:
        raise ParameterError(field, "local image files are not allowed: send the image as a data: URL, or start the "
                                    "server with --allowed-local-media-path")
    path = urllib.parse.unquote(urllib.parse.urlsplit(url).path) if url.startswith("file:") else url
    root = os.path.realpath(policy.allowed_local_media_path)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise ParameterError(field, f"the image file {path!r:.200} is outside --allowed-local-media-path")
    try:
        with open(real, "rb") as handle:
            return handle.read()
    except OSError as error:
        raise ParameterError(field, f"the image file {path!r:.200} could not be read: {error}") from None
