"""img2img's inputs and ControlNet units' images as A1111 takes them, handed to slotq as ``data:``
URLs: base64 with or without a ``data:image/...;base64,`` prefix, in any format Pillow reads; the start
image resized to the call's width x height (A1111's "just resize"), the mask made as A1111 makes it (an
RGBA mask's alpha, else its grey levels; inverted on request; blurred by ``mask_blur``) at the image's
size, a control image cropped to the job's shape where its unit asks.

The pixels are bounded before anything is decoded; slotq's own checks run on the result as on any
job's inputs (``shared/contract/images.py``).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import warnings
from typing import Any

from PIL import Image, ImageFilter, ImageOps

from api.compat import uploads
from api.compat.a1111.translate import Call
from shared.contract.errors import InvalidImageError, InvalidRequestError
from shared.contract.images import UNREADABLE
from shared.contract.settings import Settings

KEPT = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}  # passed on as sent
DEFAULT_STRENGTH = 0.75  # A1111's denoising_strength when a body has none
DEFAULT_BLUR = 4  # A1111's mask_blur
MAX_BLUR = 256  # a radius past which any mask is one grey (A1111's slider stops at 64)


def add_inputs(call: Call, settings: Settings) -> None:
    """Give an img2img call's job its start image, mask and strength; the image's size is the job's."""
    body, job = call.body, call.job
    images = body.get("init_images")
    if not isinstance(images, list) or not images:
        raise InvalidRequestError(details=[{"loc": ["init_images"], "msg": "img2img needs an image: "
                                            "a list of base64 images, of which the first is used"}])
    if len(images) > 1:
        call.not_applied.append("init_images after the first")
    width, height = job.pop("width", None), job.pop("height", None)
    size = (width, height) if isinstance(width, int) and isinstance(height, int) else None
    job["image"], size = start_image(images[0], size, settings, call.model.side_multiple)
    call.size = size
    strength = body.get("denoising_strength")
    job["strength"] = DEFAULT_STRENGTH if strength is None else strength
    if isinstance(job["strength"], int) and not isinstance(job["strength"], bool):
        job["strength"] = float(job["strength"])
    if body.get("mask"):
        job["mask"] = mask(body["mask"], size, settings, invert=bool(body.get("inpainting_mask_invert")),
                           blur=body.get("mask_blur", DEFAULT_BLUR))


def start_image(value: Any, size: tuple[int, int] | None, settings: Settings, multiple: int
                ) -> tuple[str, tuple[int, int]]:
    """The start image as a ``data:`` URL, resized to ``size`` where one is given, else to the nearest
    size the model makes (sides multiples of ``multiple``), and its size."""
    data = decoded("init_images", value, settings)
    image = opened("init_images", data, settings)
    size = size or uploads.fitted(image.size, settings.max_side, multiple)
    if image.format in KEPT and size == image.size:
        return data_url(data, KEPT[image.format]), image.size
    converted = image.convert("RGB")
    if converted.size != size:
        converted = converted.resize(size, Image.Resampling.LANCZOS)
    return png_url(converted), converted.size


def mask(value: Any, size: tuple[int, int], settings: Settings, invert: bool, blur: Any) -> str:
    """The mask as a ``data:`` URL of the image's size: white repaints, black keeps."""
    if not isinstance(blur, int | float) or isinstance(blur, bool) or not 0 <= blur <= MAX_BLUR:
        message = f"must be a number from 0 to {MAX_BLUR}"
        raise InvalidRequestError(details=[{"loc": ["mask_blur"], "msg": message}])
    grey = grey_mask(opened("mask", decoded("mask", value, settings), settings))
    if invert:
        grey = ImageOps.invert(grey)
    if blur > 0:
        grey = grey.filter(ImageFilter.GaussianBlur(blur))
    if grey.size != size:
        grey = grey.resize(size, Image.Resampling.LANCZOS)
    return png_url(grey)


def control_image(name: str, value: Any, size: tuple[int, int] | None, crop: bool, settings: Settings
                  ) -> tuple[str, bool]:
    """A ControlNet unit's image as a ``data:`` URL, and whether its shape is another than ``size``
    (the job's): cropped to that shape, centred, where ``crop`` (the extension's "Crop and Resize"), and
    within the pixels a job's input may have. The pipeline resizes it to each pass's size."""
    data = decoded(name, value, settings)
    image = opened(name, data, settings)
    width, height = image.size
    if size is not None:  # the largest box of the job's shape in the image
        width, height = (max(1, min(width, round(height * size[0] / size[1]))),
                         max(1, min(height, round(width * size[1] / size[0]))))
    reshaped = (width, height) != image.size
    if not crop:
        width, height = image.size
    shrink = min(1.0, settings.max_side / math.sqrt(width * height))
    target = (max(1, int(width * shrink)), max(1, int(height * shrink)))
    if image.format in KEPT and target == image.size:
        return data_url(data, KEPT[image.format]), reshaped
    return png_url(ImageOps.fit(image.convert("RGB"), target, Image.Resampling.LANCZOS)), reshaped


def grey_mask(image: Image.Image) -> Image.Image:
    """A1111's ``create_binary_mask``: an RGBA mask that is not fully opaque is its alpha, rounded
    to black or white; any other its grey levels."""
    if image.mode == "RGBA" and image.getextrema()[-1] != (255, 255):
        return image.getchannel("A").point(lambda alpha: 255 if alpha > 128 else 0)
    return image.convert("L")


def decoded(name: str, value: Any, settings: Settings) -> bytes:
    """The bytes of one base64 image, its ``data:`` prefix (if any) dropped; bounded before decoding."""
    if not isinstance(value, str):
        raise InvalidImageError(f"`{name}` must be a base64 image (with or without a data: prefix)")
    encoded = value.partition(",")[2] if value.startswith("data:") else value
    if len(encoded) > 4 * -(-settings.max_image_bytes // 3) + 4 + encoded.count("\n"):
        raise InvalidImageError(f"`{name}` is over {settings.max_image_bytes} bytes")
    try:
        return base64.b64decode(encoded)
    except (binascii.Error, ValueError):
        raise InvalidImageError(f"`{name}` is not valid base64") from None


def opened(name: str, data: bytes, settings: Settings) -> Image.Image:
    """The image Pillow reads in these bytes, decoded once its header shows at most UPLOAD_MAX_PIXELS
    (it is resized to the job's size after)."""
    max_pixels = uploads.UPLOAD_MAX_PIXELS
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > max_pixels:
                raise InvalidImageError(f"`{name}` is {image.width}x{image.height}: over {max_pixels} pixels")
            image.load()
            return image
    except InvalidImageError:
        raise
    except UNREADABLE as exc:
        raise InvalidImageError(f"`{name}` could not be read as an image: {exc}") from None


def data_url(data: bytes, media_type: str) -> str:
    """Image bytes as the ``data:`` URL a slotq job takes."""
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_url(image: Image.Image) -> str:
    """A Pillow image as a PNG ``data:`` URL."""
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return data_url(buffer.getvalue(), "image/png")
