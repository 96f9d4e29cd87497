"""worker/video.py: a clip's MP4 and poster, read back and compared with the frames they came from."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
from PIL import Image

from worker.video import encode_mp4, poster_png, read_mp4

COUNT, HEIGHT, WIDTH, FPS = 9, 48, 64, 8
# Measured with x264 of PyAV 18.1 (FFmpeg 8): 3.43 levels of 255 for this clip (3.34-3.46 over seeds
# 0-4), of which 2.97 is yuv420p's chroma subsampling alone (the same clip at qp 0); 5 leaves room
# for another x264 build, and a broken encoding (a wrong size, colours or frame order) is far above.
MEAN_ERROR_BOUND = 5.0


@pytest.fixture(scope="module")
def clip() -> np.ndarray:
    """A seeded random clip as a video pipeline returns it: smooth random colour fields, one per
    frame, as floats in [0, 1] (white noise would measure x264 on the one input it cannot compress)."""
    rng = np.random.default_rng(0)
    coarse = rng.random((COUNT, 4, 5, 3))
    rows = _interpolation(HEIGHT, 4)
    columns = _interpolation(WIDTH, 5)
    return np.einsum("hy,fyxc,wx->fhwc", rows, coarse, columns)


def _interpolation(size: int, points: int) -> np.ndarray:
    """(size, points) weights that interpolate ``points`` values linearly over ``size`` pixels."""
    at = np.linspace(0, points - 1, size)
    return np.stack([np.interp(at, np.arange(points), unit) for unit in np.eye(points)], axis=1)


@pytest.fixture(scope="module")
def pixels(clip: np.ndarray) -> np.ndarray:
    """The clip as uint8, as diffusers' numpy_to_pil rounds it."""
    return (clip * 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def mp4(clip: np.ndarray) -> bytes:
    return encode_mp4(clip, FPS)


def _top_level_boxes(data: bytes) -> list[str]:
    """The types of an MP4's top-level boxes in file order (each: 4-byte size, 4-byte type)."""
    boxes, offset = [], 0
    while offset < len(data):
        size = int.from_bytes(data[offset:offset + 4], "big")
        kind = data[offset + 4:offset + 8].decode("latin-1")
        if size == 1:  # the real size follows as 8 bytes (a box over 4 GiB)
            size = int.from_bytes(data[offset + 8:offset + 16], "big")
        elif size == 0:  # the box runs to the end of the file
            size = len(data) - offset
        assert size >= 8, f"a malformed box {kind!r} at {offset}"
        boxes.append(kind)
        offset += size
    assert offset == len(data), "the boxes do not end at the end of the file"
    return boxes


def test_the_clip_reads_back_with_its_count_size_and_rate(mp4: bytes) -> None:
    frames, fps = read_mp4(mp4)
    assert frames.shape == (COUNT, HEIGHT, WIDTH, 3)
    assert frames.dtype == np.uint8
    assert fps == FPS


def test_the_default_encoding_is_h264_yuv420p(mp4: bytes) -> None:
    with av.open(io.BytesIO(mp4), mode="r") as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        assert stream.codec_context.pix_fmt == "yuv420p"
        assert stream.frames == COUNT


def test_the_default_encoding_is_close_to_the_frames(mp4: bytes, pixels: np.ndarray) -> None:
    frames, _ = read_mp4(mp4)
    error = np.abs(frames.astype(np.int16) - pixels).mean()
    assert 0 < error < MEAN_ERROR_BOUND  # not 0: it is the lossy encoding, not the lossless one


def test_lossless_gives_back_the_exact_frames(clip: np.ndarray, pixels: np.ndarray) -> None:
    frames, fps = read_mp4(encode_mp4(clip, FPS, lossless=True))
    assert fps == FPS
    np.testing.assert_array_equal(frames, pixels)
    # Rounded, not truncated: about half of the random floats truncate one level lower.
    assert (frames != (clip * 255).astype(np.uint8)).mean() > 0.4


@pytest.mark.parametrize("lossless", [False, True])
def test_the_moov_atom_comes_before_the_frames(clip: np.ndarray, mp4: bytes, lossless: bool) -> None:
    boxes = _top_level_boxes(encode_mp4(clip, FPS, lossless=True) if lossless else mp4)
    assert boxes[0] == "ftyp"
    assert "moov" in boxes and "mdat" in boxes
    assert boxes.index("moov") < boxes.index("mdat"), boxes


@pytest.mark.parametrize("shape", [(COUNT, HEIGHT - 1, WIDTH, 3), (COUNT, HEIGHT, WIDTH - 1, 3)])
def test_odd_sides_are_refused(shape: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError, match="even sides"):
        encode_mp4(np.zeros(shape), FPS)


def test_the_poster_is_the_first_frame_as_png(clip: np.ndarray, pixels: np.ndarray) -> None:
    with Image.open(io.BytesIO(poster_png(clip))) as poster:
        assert poster.format == "PNG"
        assert poster.size == (WIDTH, HEIGHT)
        assert poster.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(poster), pixels[0])
