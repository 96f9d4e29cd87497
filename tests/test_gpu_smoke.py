"""``python -m bench.gpu_smoke``, what a GPU host runs once, runs on the CPU but for its out-of-memory check.

A file of its own, beside tests/test_bench.py: the two smoke runs are the suite's longest, and the
suite's two processes each take whole files.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_the_gpu_smoke_passes_on_the_cpu_but_for_its_out_of_memory_check() -> None:
    # bench.gpu_smoke is what a GPU host runs once (CI has no GPU); on the CPU it runs every check
    # but the real out-of-memory, which needs a CUDA allocator to cap.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "bench.gpu_smoke", "--device", "cpu", "--side", "64",
                           "--big-side", "128"], capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    lines = done.stdout.splitlines()
    assert not [line for line in lines if line.startswith("FAILED")], done.stdout
    assert len([line for line in lines if line.startswith("-- ") and "loaded and registered" in line]) == 5
    assert "ok     sd-fp16 with LoRA ink at 2: an image, or the job fails nan_output: failed, nan_output" \
        in lines, done.stdout  # the tiny adapter overflows float16 at that scale
    assert any(line.startswith("ok     sd-fp16: a 1000-step 128x128 job of 4 images canceled mid-run")
               for line in lines), done.stdout
    assert "-- out-of-memory: skipped on the CPU" in lines
    assert "-- sharing the device: skipped on the CPU" in lines
