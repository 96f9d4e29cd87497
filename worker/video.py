"""A video job's frames as the files the finishing process stores: an MP4 and its poster PNG.

Frames come as diffusers' video pipelines return them with ``output_type="np"``: floats in [0, 1],
(count, height, width, 3), one video. Everything is encoded in memory, as the PNGs are: the store
takes bytes, and a temporary file would only add a disk to the finishing process's path.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any

import av
import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

# The usual "visually lossless" point of x264 (its own default is 23): a clip is generated once and
# watched many times, so bytes matter less than artefacts. "medium" is x264's default trade of
# encoding time for size; a short clip takes well under a second of the finishing process.
CRF = 18
PRESET = "medium"
AVIO_FLAG_WRITE = 2  # FFmpeg's avio.h; PyAV does not export it


def encode_mp4(frames: np.ndarray, fps: int, *, lossless: bool = False) -> bytes:
    """H.264 in MP4 (yuv420p, moov first), or with ``lossless`` exact frames (libx264rgb, qp 0, rgb24)."""
    # lossless is for tests: libx264 in yuv444p at qp 0 is lossless only in YUV, and the RGB -> YUV
    # conversion alone rounds by up to 2 levels, so the exact mode encodes RGB itself (x264's
    # High 4:4:4 profile, which browsers do not play).
    pixels = to_uint8(frames)
    count, height, width, _ = pixels.shape
    if height % 2 or width % 2:
        raise ValueError(f"yuv420p needs even sides, not {width}x{height}")
    if fps < 1:
        raise ValueError(f"the frame rate must be a positive whole number, not {fps}")
    output = io.BytesIO()
    # +faststart: the moov atom (the index) goes before the frames, so that a browser or a ranged
    # read can start playing before the end arrives.
    with av.open(output, mode="w", format="mp4", options={"movflags": "+faststart"},
                 io_open=_reopened(output)) as container:
        if lossless:
            stream = container.add_stream("libx264rgb", rate=fps, options={"qp": "0"})
            stream.pix_fmt = "rgb24"
        else:
            stream = container.add_stream("libx264", rate=fps, options={"crf": str(CRF), "preset": PRESET})
            stream.pix_fmt = "yuv420p"
        stream.width, stream.height = width, height
        for pixel_rows in pixels:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixel_rows, format="rgb24")))
        container.mux(stream.encode(None))  # flush the frames x264 holds back for its lookahead
    data = output.getvalue()
    log.debug("encoded %d frames of %dx%d at %d fps: %d bytes", count, width, height, fps, len(data))
    return data


def poster_png(frames: np.ndarray) -> bytes:
    """The first frame as PNG bytes: the clip's thumbnail."""
    buffer = io.BytesIO()
    Image.fromarray(to_uint8(frames)[0]).save(buffer, format="PNG")
    return buffer.getvalue()


def read_mp4(data: bytes) -> tuple[np.ndarray, float]:
    """An MP4's frames as (count, height, width, 3) uint8 RGB, and its frame rate."""
    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.video:
            raise ValueError("the MP4 has no video stream")
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        rate = stream.average_rate or stream.guessed_rate
    if not frames or rate is None:
        raise ValueError("the MP4 has no frames or no frame rate")
    return np.stack(frames), float(rate)


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """A clip's float frames as uint8 pixels, rounded as diffusers' ``numpy_to_pil`` rounds them."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or not len(frames):
        raise ValueError(f"frames must be (count, height, width, 3) with count > 0, not {frames.shape}")
    if frames.dtype == np.uint8:
        return np.ascontiguousarray(frames)  # pixels already
    # Clipped first: a float just outside [0, 1] would wrap around in uint8 (diffusers' own
    # postprocess clamps, so for its output this changes nothing). Contiguous for PyAV's frames.
    return np.ascontiguousarray((np.clip(frames, 0, 1) * 255).round().astype(np.uint8))


def _reopened(output: io.BytesIO) -> Callable[[str, int, dict[str, Any]], io.BytesIO]:
    """FFmpeg's opener of the output's second handle, over a buffer rather than a file name."""
    # faststart moves the frames back to make room for the moov atom: FFmpeg flushes the output,
    # then re-opens it by name to read it back. A buffer has no name, so the re-open reads a copy of
    # it (the clip is in memory twice for that moment).
    def io_open(url: str, flags: int, options: dict[str, Any]) -> io.BytesIO:
        if flags & AVIO_FLAG_WRITE:
            raise OSError(f"the MP4 muxer asked to write a second output ({url!r}); only reads are expected")
        return io.BytesIO(output.getvalue())

    return io_open
