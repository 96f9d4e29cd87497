"""Images as foreign clients upload them (a phone's photo, any size), fitted to what a model makes.

OpenAI and A1111 take an input of any size and resize it; slotq's jobs take sides that are multiples
of the model's and at most SLOTQ_MAX_SIDE. The surfaces decode an upload under a larger bound than a
job's, then resize it to the job's size, and the job contract checks the result as any input.
"""

from __future__ import annotations

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
