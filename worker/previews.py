"""Live previews: a small picture of each running job's latents, made off the GPU section.

Inside the GPU section the step callback only copies the latents of the jobs that asked for
previews (a few kilobytes: one image's latents each) and hands the copy to the :class:`Previewer`
thread, which keeps only the newest. That thread turns latents into RGB (a fixed linear map per
family, or a tiny decoder such as TAESD when SLOTQ_PREVIEW_DECODER names one), scales the picture
to at most ``MAX_SIDE`` and encodes it as a JPEG ``data:`` URL, then writes it through
``shared/store/records.py``'s ``report_preview``, under the attempt's fence. On a GPU even the
copy to host memory happens on that thread: the GPU section never waits for a preview.
"""

from __future__ import annotations

import base64
import io
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderTiny
from PIL import Image
from redis.exceptions import RedisError
from rq.job import Job

from shared.contract.jobs import JobRequest
from shared.contract.models import Family, LatentFormat, family_spec
from shared.store import records
from shared.store.fencing import held

log = logging.getLogger(__name__)

MAX_SIDE = 256  # a preview's long side, in pixels, at most
JPEG_QUALITY = 70
FLUSH_TIMEOUT_S = 2.0  # how long the end of an execution waits for its last preview to be written

# Latent channels -> RGB, per latent format (a family's record names its own): the factors ComfyUI
# publishes (comfy/latent_formats.py), fitted against each format's VAE, applied to the latents as the
# sampler holds them (scaled, as diffusers' step callback sees them). RGB comes out in [-1, 1].
LATENT_RGB: dict[LatentFormat, tuple[list[list[float]], list[float]]] = {
    "sd15": ([[0.3512, 0.2297, 0.3227], [0.3250, 0.4974, 0.2350], [-0.2829, 0.1762, 0.2721],
              [-0.2120, -0.2616, -0.7177]], [0.0, 0.0, 0.0]),
    "sdxl": ([[0.3651, 0.4232, 0.4341], [-0.2533, -0.0042, 0.1068], [0.1076, 0.1111, -0.0362],
              [-0.3165, -0.2492, -0.2188]], [0.1084, -0.0175, -0.0011]),
    "flux": ([[-0.0346, 0.0244, 0.0681], [0.0034, 0.0210, 0.0687], [0.0275, -0.0668, -0.0433],
              [-0.0174, 0.0160, 0.0617], [0.0859, 0.0721, 0.0329], [0.0004, 0.0383, 0.0115],
              [0.0405, 0.0861, 0.0915], [-0.0236, -0.0185, -0.0259], [-0.0245, 0.0250, 0.1180],
              [0.1008, 0.0755, -0.0421], [-0.0515, 0.0201, 0.0011], [0.0428, -0.0012, -0.0036],
              [0.0817, 0.0765, 0.0749], [-0.1264, -0.0522, -0.1103], [-0.0280, -0.0881, -0.0499],
              [-0.1262, -0.0982, -0.0778]], [-0.0329, -0.0718, -0.0851]),
    "wan21": ([[-0.1299, -0.1692, 0.2932], [0.0671, 0.0406, 0.0442], [0.3568, 0.2548, 0.1747],
               [0.0372, 0.2344, 0.1420], [0.0313, 0.0189, -0.0328], [0.0296, -0.0956, -0.0665],
               [-0.3477, -0.4059, -0.2925], [0.0166, 0.1902, 0.1975], [-0.0412, 0.0267, -0.1364],
               [-0.1293, 0.0740, 0.1636], [0.0680, 0.3019, 0.1128], [0.0032, 0.0581, 0.0639],
               [-0.1251, 0.0927, 0.1699], [0.0060, -0.0633, 0.0005], [0.3477, 0.2275, 0.2950],
               [0.1984, 0.0913, 0.1861]], [-0.1835, -0.0868, -0.3360]),
    "ltxv": ([], [0.0, 0.0, 0.0]),  # no map fitted here for its 128 channels: the plain projection
}


class Cadence:
    """Which steps get a preview: the first denoising step (so every job of two steps or more has
    one), then one once ``interval_s`` has passed since the last; never the last step, whose
    picture is the image itself a moment later."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self.last: float | None = None

    def due(self, step: int, total: int) -> bool:
        if step < 1 or step >= total:
            return False
        now = self.clock()
        if self.last is None or now - self.last >= self.interval_s:
            self.last = now
            return True
        return False


@dataclass(frozen=True)
class Latents:
    """One step's latents of the jobs that want a preview, row by row, as the GPU section copied them."""

    jobs: list[Job]
    tokens: list[str]  # each job's fence token ('' for none), read on the worker's thread
    step: int
    tensor: torch.Tensor  # (jobs, channels, h, w), or Flux's packed (jobs, h/2 * w/2, channels * 4)
    width: int  # the image's size
    height: int


class Previewer:
    """The preview thread of a loaded pipeline: takes the newest offered latents, paints, writes."""

    def __init__(self, family: Family, vae_scale_factor: int, decoder: AutoencoderTiny | None = None) -> None:
        self.family, self.vae_scale_factor, self.decoder = family, vae_scale_factor, decoder
        self._ready = threading.Condition()
        self._next: Latents | None = None
        self._busy = False
        self._thread = threading.Thread(target=self._run, name="previews", daemon=True)
        self._thread.start()

    def offer(self, jobs: list[Job], step: int, tensor: torch.Tensor, width: int, height: int) -> None:
        """From the GPU section: these jobs' latents (one row each) at this step. Returns at once;
        an offer not yet taken gives way to a newer one."""
        tokens = {fence.job_id: fence.token for fence in held()}
        latents = Latents(jobs, [tokens.get(job.id, "") for job in jobs], step,
                          tensor.detach().clone(), width, height)  # on a GPU an async copy: no wait
        with self._ready:
            self._next = latents
            self._ready.notify()

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Wait until what was offered is written (or dropped), so no preview follows a job's end."""
        with self._ready:
            self._ready.wait_for(lambda: self._next is None and not self._busy, timeout_s)

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._next is not None)
                latents, self._next, self._busy = self._next, None, True
            try:
                self._write(latents)  # type: ignore[arg-type]
            except Exception:  # a preview is never worth a job: log it and go on
                log.exception("could not make a preview at step %s", latents.step)  # type: ignore[union-attr]
            finally:
                with self._ready:
                    self._busy = False
                    self._ready.notify_all()

    def _write(self, latents: Latents) -> None:
        pictures = self.paint(latents.tensor, latents.width, latents.height)
        urls = [data_url(picture) for picture in pictures]
        try:
            records.report_preview(latents.jobs, latents.tokens, latents.step, urls)
        except RedisError as exc:  # best effort, like progress
            log.warning("could not store the preview of %d job(s): %s", len(latents.jobs), exc)

    def paint(self, tensor: torch.Tensor, width: int, height: int) -> list[Image.Image]:
        """Each row's picture, at most ``MAX_SIDE`` on its long side, in the image's aspect."""
        if self.decoder is not None:
            rgb = self._decoded(tensor)
        else:
            # NumPy, not torch: torch's ops here would start its intra-op threads beside the
            # pipeline's, and on a small machine their spinning costs the GPU section more than
            # the arithmetic does. On a GPU the copy to host
            # memory waits for the device here, on this thread.
            latents = tensor.detach().to("cpu", torch.float32).numpy()
            if latents.ndim == 3:  # Flux packs 2x2 patches of the latent image into its tokens
                latents = unpack(latents, width, height, self.vae_scale_factor)
            rgb = to_rgb(latents, self.family)
        pixels = np.clip((rgb + 1) * 127.5, 0, 255).round().astype(np.uint8).transpose(0, 2, 3, 1)
        scale = min(1.0, MAX_SIDE / max(width, height))
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        return [Image.fromarray(np.ascontiguousarray(array), "RGB").resize(size, Image.Resampling.BILINEAR)
                for array in pixels]

    def _decoded(self, tensor: torch.Tensor) -> np.ndarray:
        decoder = self.decoder
        assert decoder is not None
        config = decoder.config
        with torch.inference_mode():
            # As a pipeline decodes with its VAE: the sampler's latents back to the VAE's own scale.
            latents = tensor.to(decoder.device, decoder.dtype) / config.scaling_factor + config.shift_factor
            return decoder.decode(latents).sample.float().cpu().numpy()


def to_rgb(latents: np.ndarray, family: Family) -> np.ndarray:
    """(rows, channels, h, w) latents as (rows, 3, h, w) RGB in about [-1, 1], by the family's
    linear map; latents of another channel count (a custom VAE) by a plain projection."""
    factors, bias = LATENT_RGB[family_spec(family).latent_format]
    if latents.shape[1] == len(factors):
        weights = np.asarray(factors, dtype=np.float32)
        offsets = np.asarray(bias, dtype=np.float32)[:, None, None]
        return np.einsum("bchw,cr->brhw", latents, weights) + offsets
    # No published map: the first three channels (repeated if fewer), each stretched to the range.
    channels = latents[:, [index % latents.shape[1] for index in range(3)]]
    low = channels.min(axis=(2, 3), keepdims=True)
    high = channels.max(axis=(2, 3), keepdims=True)
    return (channels - low) / np.maximum(high - low, 1e-6) * 2 - 1


def unpack(latents: np.ndarray, width: int, height: int, vae_scale_factor: int) -> np.ndarray:
    """Flux's packed latents (rows, h/2 * w/2, channels * 4) as a latent image (rows, channels, h, w),
    the layout diffusers' FluxPipeline packs them in."""
    rows, _, packed = latents.shape
    h, w = 2 * (height // (vae_scale_factor * 2)), 2 * (width // (vae_scale_factor * 2))
    grid = latents.reshape(rows, h // 2, w // 2, packed // 4, 2, 2).transpose(0, 3, 1, 4, 2, 5)
    return grid.reshape(rows, packed // 4, h, w)


def data_url(picture: Image.Image) -> str:
    """A picture as a JPEG ``data:`` URL."""
    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def load_decoder(path: Path, device: torch.device, dtype: torch.dtype) -> AutoencoderTiny:
    """A tiny preview decoder (TAESD, TAESDXL, TAEF1) from a folder in diffusers' format."""
    decoder = AutoencoderTiny.from_pretrained(path, torch_dtype=dtype)
    return decoder.to(device).eval()


def middle_frame(latents: torch.Tensor, request: JobRequest, pipe: Any) -> torch.Tensor:
    """The middle latent frame of a clip's latents as the pipeline's loop holds them, (rows, channels,
    h, w): Wan's are (rows, channels, frames, h, w); LTX-Video packs them into tokens (rows, frames *
    h * w, channels), which its pipeline unpacks so."""
    if latents.ndim == 3:  # as LTXPipeline.__call__ unpacks them before decoding
        spatial, frames = pipe.vae_spatial_compression_ratio, request.frames or 1
        patches = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        latents = pipe._unpack_latents(latents, (frames - 1) // pipe.vae_temporal_compression_ratio + 1,
                                       request.height // spatial, request.width // spatial, *patches)
    return latents[:, :, latents.shape[2] // 2]
