"""Images as foreign clients upload them (a phone's photo, any size), fitted to what a model makes.

OpenAI and A1111 take an input of any size and resize it; slotq's jobs take sides that are multiples
of the model's and at most SLOTQ_MAX_SIDE. The surfaces decode an upload under a larger bound than a
job's, then resize it to the job's size, and the job contract checks the result as any input.
"""

from __future__ import annotations

import base64
import io

from PIL import Image

from shared.contract.errors import InvalidImageError
from shared.contract.images import FORMATS, read_data_url
from shared.contract.jobs import MIN_SIDE

# The most pixels an upload may have before it is resized: a 16-megapixel photo, about 50 MB decoded.
UPLOAD_MAX_PIXELS = 4096 * 4096


def fitted(size: tuple[int, int], max_side: int, multiple: int) -> tuple[int, int]:
    """The size nearest an upload's that a model makes: scaled down (keeping its shape) to fit
    ``max_side``, each side rounded down to a multiple. A side under MIN_SIDE stays under it: so
    small an image is refused by the contract, not blown up."""
    scale = min(1.0, max_side / max(size))
    width, height = (int(side * scale) // multiple * multiple if side >= MIN_SIDE else side for side in size)
    return width, height


def opened(name: str, data: bytes, max_bytes: int) -> tuple[Image.Image, str]:
    """An uploaded file as an image, once the contract's door checks pass (size, pixels, a whole
    decode), with its ``data:`` URL; ``InvalidImageError`` naming the field where it is none."""
    media_type = media_type_of(data)
    if media_type is None:
        raise InvalidImageError(f"`{name}` is not a PNG, JPEG or WebP image")
    url = f"data:{media_type};base64,{base64.b64encode(data).decode()}"
    read_data_url(name, url, max_bytes=max_bytes, max_pixels=UPLOAD_MAX_PIXELS)
    image = Image.open(io.BytesIO(data), formats=[FORMATS[media_type]])
    image.load()
    return image, url


def media_type_of(data: bytes) -> str | None:
    """An upload's media type from its first bytes (a client's Content-Type may say anything)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    return "image/webp" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else None


def png_url(image: Image.Image) -> str:
    """An image as a PNG ``data:`` URL, as a job's input is sent."""
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"
