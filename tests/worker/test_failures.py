"""What a job's error says (worker/failures.py): a stable code, and no path of the server's."""

from __future__ import annotations

from pathlib import Path

import torch
from rq.timeouts import JobTimeoutException

from shared.contract.errors import JobFailedError
from worker.checkpoints import CheckpointError
from worker.failures import MAX_ERROR_MESSAGE, classify


def test_files_in_the_worker_s_folders_are_named_within_them(tmp_path: Path) -> None:
    models, loras = tmp_path / "models", tmp_path / "models" / "loras"
    loaded = CheckpointError(f"{models / 'bad.safetensors'}: the file lacks weights of its UNet or VAE")
    wrapped = JobFailedError("model_load_failed", f"the worker could not load model bad: {loaded}")
    said = "the worker could not load model bad: bad.safetensors: the file lacks weights of its UNet or VAE"
    assert classify(wrapped, [models, loras]) == ("model_load_failed", said)
    # The inner folder first: a file of it keeps no part of the outer one's path either.
    assert classify(OSError(f"cannot read {loras / 'ink.safetensors'}"), [models, loras]) == (
        "job_failed", "OSError: cannot read ink.safetensors")


def test_a_folder_named_through_a_link_is_cut_as_it_resolves(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    error = ValueError(f"{real / 'x.safetensors'} and {tmp_path / 'link' / 'y.safetensors'}")
    said = "ValueError: x.safetensors and y.safetensors"
    assert classify(error, [tmp_path / "link"]) == ("job_failed", said)


def test_codes_of_known_failures() -> None:
    assert classify(torch.OutOfMemoryError("CUDA out of memory"))[0] == "out_of_memory"
    assert classify(JobTimeoutException("late"))[0] == "timeout"
    assert len(classify(RuntimeError("x" * 5000))[1]) == MAX_ERROR_MESSAGE
