"""Image inputs: a job's start image and mask, as a client sends them and as the service keeps them.

A client sends each as a base64 ``data:`` URL. The API checks it here, without torch: the bytes are
bounded (SLOTQ_MAX_IMAGE_BYTES), Pillow reads the header and refuses too many pixels before it
decodes anything (no decompression bomb reaches memory), then decodes it whole, so a truncated file
is refused at the door and never in the worker. The job keeps the bytes beside its record and
shows an :class:`ImageRef` in their place.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict

from shared.contract.errors import InvalidImageError

# A job's start image and mask, the images of its ControlNets in order (``controlnets[i].image``) and
# its IP-Adapter's reference image (``ip_adapter.image``).
InputName = Literal["image", "mask", "control0", "control1", "ip_adapter"]
INPUT_NAMES: tuple[InputName, ...] = ("image", "mask", "control0", "control1", "ip_adapter")
# Pillow's format names for the media types a job may send.
FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP"}
# What Pillow raises on a file it cannot read: not an image, truncated, corrupt, too many pixels.
UNREADABLE = (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError, ValueError)
DATA_URL = re.compile(r"data:(?P<type>[a-z/+.-]+);base64,", re.IGNORECASE)


def input_reference(request: dict[str, Any], name: str) -> Any:
    """Where a stored request (JSON) holds the reference of its input of this name; None where it has
    no such input. ``control<i>`` is the image of its ``i``-th ControlNet."""
    if name == "ip_adapter":
        return (request.get("ip_adapter") or {}).get("image")
    if name.startswith("control"):
        controls, index = request.get("controlnets") or [], int(name.removeprefix("control"))
        return controls[index].get("image") if index < len(controls) else None
    return request.get(name)


class ImageRef(BaseModel):
    """What a job's view shows of an input image: never its bytes, enough to recognise them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    media_type: str
    width: int
    height: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class InputImage:
    """One checked input: its bytes as the client sent them, and their reference."""

    data: bytes
    ref: ImageRef


def read_data_url(name: str, url: str, *, max_bytes: int, max_pixels: int) -> InputImage:
    """Decode and check one input sent as a ``data:`` URL, or raise ``InvalidImageError`` naming it
    as the body does (``name``)."""
    match = DATA_URL.match(url)
    if not match:
        raise InvalidImageError(f"`{name}` must be a data: URL such as data:image/png;base64,...")
    media_type = match["type"].lower()
    if media_type not in FORMATS:
        raise InvalidImageError(f"`{name}` is {media_type}; send PNG, JPEG or WebP")
    encoded = url[match.end():]
    if len(encoded) > 4 * -(-max_bytes // 3) + 4:  # checked before decoding: never more than the bound
        raise InvalidImageError(f"`{name}` is over {max_bytes} bytes")
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidImageError(f"`{name}` is not valid base64") from None
    if len(data) > max_bytes:
        raise InvalidImageError(f"`{name}` is over {max_bytes} bytes")
    width, height = _check_pixels(name, data, media_type, max_pixels)
    ref = ImageRef(media_type=media_type, width=width, height=height, bytes=len(data),
                   sha256=hashlib.sha256(data).hexdigest())
    return InputImage(data, ref)


def _check_pixels(name: str, data: bytes, media_type: str, max_pixels: int) -> tuple[int, int]:
    """The image's size, once its header and its whole decode pass the checks."""
    try:
        with warnings.catch_warnings():
            # Pillow warns (DecompressionBombWarning) on its own bound; ours is lower and exact.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=[FORMATS[media_type]]) as image:
                width, height = image.size  # from the header: nothing is decoded yet
                if width * height > max_pixels:
                    raise InvalidImageError(f"`{name}` is {width}x{height}: over {max_pixels} pixels")
                if getattr(image, "n_frames", 1) > 1:
                    raise InvalidImageError(f"`{name}` is animated; send a single frame")
                image.load()  # the whole decode: a truncated or corrupt file fails here
    except InvalidImageError:
        raise
    except Image.DecompressionBombError:  # Pillow's own bound, far above ours, refused at open
        raise InvalidImageError(f"`{name}` is over {max_pixels} pixels") from None
    except UNREADABLE as exc:
        raise InvalidImageError(f"`{name}` could not be read as {media_type}: {exc}") from None
    return width, height


def decode(data: bytes, mode: Literal["RGB", "L"], max_pixels: int) -> Image.Image:
    """Input bytes checked at admission, as a Pillow image of this mode (the worker's side, which
    checks the pixels again: what comes out of Redis is not trusted either)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data), formats=list(FORMATS.values())) as image:
                if image.width * image.height > max_pixels:
                    raise InvalidImageError(f"the input is {image.width}x{image.height}: too many pixels")
                return image.convert(mode)
        except UNREADABLE as exc:
            raise InvalidImageError(f"the input could not be read: {exc}") from None
