"""The RQ task the API enqueues by name: one job (text-to-image, image-to-image or inpainting), in two stages.

``render`` is the GPU section (denoise and decode); ``worker.finisher.store_result`` encodes and
stores the PNGs. The slotq worker runs the second in its finishing process, so that finishing one
job overlaps the next one's GPU section; ``generate`` runs both in turn, for any plain RQ worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from pydantic import ValidationError
from redis.exceptions import RedisError
from rq import get_current_job
from rq.job import Job

from shared.contract import images
from shared.contract.adapters import available_adapters
from shared.contract.controlnets import available_controlnets
from shared.contract.errors import (
    InvalidImageError,
    JobCanceledError,
    JobFailedError,
    JobInterruptedError,
    StorageUnavailableError,
)
from shared.contract.ip_adapters import available_ip_adapters
from shared.contract.jobs import JobRequest, validate_request
from shared.contract.settings import Settings, get_settings
from shared.store import records, results
from worker import lifecycle, previews, progress, whole_calls
from worker.finisher import store_result
from worker.messages import Rendered
from worker.pipeline import NAN_OUTPUT, Inputs, current_pipeline, nan_rows
from worker.previews import Previewer

log = logging.getLogger(__name__)


# The input images each kind of job is run with, and Pillow's mode for each.
INPUT_MODES: dict[str, dict[str, str]] = {"text": {}, "image": {"image": "RGB"},
                                          "inpaint": {"image": "RGB", "mask": "L"}}
RenderResult = Rendered | Exception  # a member of a batch either has its images or the error that ended it


class NothingLeft(Exception):
    """Every member of an execution has ended before its last step, not all of them canceled: the
    denoising stops, and each member keeps its own outcome."""


def generate(request: dict[str, Any]) -> dict[str, Any]:
    """Generate the images of one request and store them for the result TTL."""
    job = get_current_job()
    assert job is not None, "generate runs inside an RQ worker"
    (outcome,) = render([job])
    if isinstance(outcome, Exception):
        raise outcome
    return store_result(job, get_settings(), outcome)


def render(jobs: list[Job], announced: bool = False,
           last_step: Callable[[], None] | None = None) -> list[RenderResult]:
    """The GPU section: validate each stored request, then denoise and decode them all as one batch.

    A member canceled while the batch runs ends canceled and its images are dropped; the others go
    on (the batch stops only when every member is canceled). A member whose latents or images hold
    NaN fails alone (``nan_output``): the latents are looked at after the first step and at each
    progress report, so such a job ends then, not after its last step. Any other error ends the
    whole batch.
    ``announced``: step 0 is recorded already (the slotq worker records it as it starts the jobs).
    ``last_step`` is called once the last denoising step is done, before the decoding.
    """
    prepared = [prepared_request(job) for job in jobs]
    outcomes: list[RenderResult | None] = [each if isinstance(each, Exception) else None for each in prepared]
    members = [index for index, each in enumerate(prepared) if not isinstance(each, Exception)]
    if not members:
        return outcomes  # type: ignore[return-value]
    requests = [prepared[index][0] for index in members]  # type: ignore[index]
    inputs = [prepared[index][1] for index in members]  # type: ignore[index]
    running = Running(jobs, outcomes, members, requests[0].num_images)
    settings, pipeline = get_settings(), current_pipeline()
    faults, cadence = settings.fault_injection, progress.Cadence(settings.progress_interval_ms / 1000)
    show = PreviewOffers(pipeline.previewer, settings, requests, pipeline.info.side_multiple)

    def on_step(step: int, total: int, latents: torch.Tensor | None = None) -> None:
        running.step_done(step, total, cadence.due(step, total), latents)
        if faults and step == 1:
            for request in requests:
                inject_fault(request)
        live = running.live
        show.offer([jobs[index] if index in live else None for index in members], step, total, latents)
        if step == total and last_step is not None:
            last_step()

    single = len(members) == 1
    resume, keep = whole_calls.steps_of(jobs[members[0]], requests[0], settings) if single else (None, None)
    # Step 0: reported here, or (announced) only the start the cadence counts its interval from.
    (cadence.due if announced else on_step)(0, requests[0].steps_run)
    try:
        made_by_job = pipeline.generate_batch(requests, on_step, inputs, resume, keep)
    except NothingLeft:
        return outcomes  # type: ignore[return-value]  # each member has ended
    finally:
        show.flush()
    for index, request, made in zip(members, requests, made_by_job, strict=True):
        if index in running.live:
            outcomes[index] = made if isinstance(made, JobFailedError) else (request, made)
    return outcomes  # type: ignore[return-value]


class PreviewOffers:
    """Which rows of a batch's latents go to the preview thread, and when."""

    def __init__(self, previewer: Previewer, settings: Settings, requests: list[JobRequest],
                 side_multiple: int = 8) -> None:
        self.previewer, self.requests = previewer, requests
        self.larger = requests[0].output_size(side_multiple)
        self.cadence = previews.Cadence(settings.preview_interval_ms / 1000)
        self.wanted = any(request.previews for request in requests)

    def offer(self, members: list[Job | None], step: int, total: int, latents: torch.Tensor | None) -> None:
        """Offer the first image's latents of each live member that asked (None: canceled)."""
        if not self.wanted or latents is None:
            return
        asking = enumerate(zip(members, self.requests, strict=True))
        wanted = [(place, job) for place, (job, request) in asking if job is not None and request.previews]
        if not wanted or not self.cadence.due(step, total):
            return
        per_job, first = self.requests[0].num_images, self.requests[0]
        rows = [place * per_job for place, _ in wanted]  # diffusers orders a prompt's images together
        # A hires job's second pass denoises at the larger size.
        width, height = (first.width, first.height) if step <= first.first_steps_run else self.larger
        chosen = latents[rows]
        if first.is_video:  # a clip's latents hold every frame: its middle one is the preview
            chosen = previews.middle_frame(chosen, first, current_pipeline().pipe)
        self.previewer.offer([job for _, job in wanted], step, chosen, width, height)

    def flush(self) -> None:
        """Once the execution is over, before its end is recorded: so that no preview follows it."""
        if self.wanted:
            self.previewer.flush()


def prepared_request(job: Job) -> tuple[JobRequest, Inputs] | Exception:
    """A claimed job's request and its decoded input images, or the failure that ends it now."""
    request = _validated(job)
    return request if isinstance(request, Exception) else _with_inputs(job, request)


def _validated(job: Job) -> JobRequest | Exception:
    settings, info = get_settings(), current_pipeline().info
    try:
        # The queue is a trust boundary too: re-validate what came out of Redis, for this model.
        request = validate_request(job.kwargs["request"], max_side=settings.max_side,
                                   max_steps=settings.max_steps, side_multiple=info.side_multiple,
                                   frame_multiple=info.frame_multiple or 0, max_frames=settings.max_frames)
    except (ValidationError, KeyError) as exc:
        return JobFailedError("invalid_request", f"the stored request is invalid: {exc}")
    # The tier the worker chose as it started the job ("auto" resolved); a plain RQ worker chooses none.
    speed = job.meta.get("tier") or ("normal" if request.speed == "auto" else request.speed)
    if speed != request.speed:
        request = request.model_copy(update={"speed": speed})
    served = settings.served_models
    if request.model not in (None, *served):  # never claimed from another model's line
        return JobFailedError("unknown_model", f"this worker serves {', '.join(served)}, not {request.model}")
    if request.scheduler is not None and request.scheduler not in info.schedulers:
        return JobFailedError("invalid_request", f"a {info.family} model cannot use the "
                              f"{request.scheduler} sampler; it takes {', '.join(info.schedulers)}")
    model = request.model or served[0]
    held = available_adapters(settings.lora_dir_of(model))
    missing = sorted({lora.name for lora in request.loras} - set(held))
    if missing:  # removed from the folder since its admission, or not mounted on this worker
        return JobFailedError("unknown_lora", f"this worker has no LoRA adapter named {', '.join(missing)}")
    missing = sorted({control.name for control in request.controlnets}
                     - set(available_controlnets(settings.controlnet_dir, model)))
    if missing:
        names = ", ".join(missing)
        return JobFailedError("unknown_controlnet", f"this worker has no ControlNet named {names}"
                              " (SLOTQ_CONTROLNET_DIR)")
    wanted = request.ip_adapter
    if wanted is not None and wanted.name not in available_ip_adapters(settings.ip_adapter_dir, model):
        return JobFailedError("unknown_ip_adapter", f"this worker has no IP-Adapter named {wanted.name} "
                              "(SLOTQ_IP_ADAPTER_DIR)")
    return request


def _with_inputs(job: Job, request: JobRequest) -> tuple[JobRequest, Inputs] | Exception:
    """A request with its input images decoded, or the failure of a job whose inputs are gone or bad."""
    controls = {f"control{index}": "RGB" for index in range(len(request.controlnets))}
    if request.ip_adapter is not None:
        controls["ip_adapter"] = "RGB"
    modes = INPUT_MODES[request.kind] | controls
    if not modes:
        return request, {}
    try:
        stored = results.of(get_settings()).inputs(job)
    except StorageUnavailableError as exc:  # a read: the job fails now (a write is retried)
        return JobFailedError("storage_unavailable", str(exc))
    if set(modes) - set(stored):
        return JobFailedError("inputs_missing", "the job's input images are no longer stored")
    settings = get_settings()
    try:
        decoded = {name: images.decode(stored[name], mode, settings.max_side ** 2)  # type: ignore[arg-type]
                   for name, mode in modes.items()}
    except InvalidImageError as exc:
        return JobFailedError("invalid_image", str(exc))
    # A control image may have any size (the pipeline resizes it); a start image and mask are the job's.
    if any(decoded[name].size != (request.width, request.height) for name in INPUT_MODES[request.kind]):
        return JobFailedError("invalid_image", "the stored input images do not have the job's size")
    return request, decoded


class Running:
    """The members of one execution (indexes of ``jobs`` and ``outcomes``, in the batch's order)
    and which of them still run: those without an outcome yet."""

    def __init__(self, jobs: list[Job], outcomes: list[RenderResult | None], members: list[int],
                 per_job: int) -> None:
        self.jobs, self.outcomes, self.members, self.per_job = jobs, outcomes, members, per_job
        self.live = list(members)

    def step_done(self, step: int, total: int, due: bool, latents: torch.Tensor | None) -> None:
        """End the members that this step ended: canceled by their clients (seen when a report is
        ``due``), or with NaN latents (looked at after the first step and at each report: one read
        of the device each). Raises once none is left."""
        for index in check_in([self.jobs[index] for index in self.live], step, total, due):
            self.outcomes[self.live[index]] = JobCanceledError()
        if latents is not None and (due or step == 1):
            self._end_overflowed(nan_rows(latents))
        self.live = [index for index in self.live if self.outcomes[index] is None]
        if self.live:
            return
        if all(isinstance(self.outcomes[index], JobCanceledError) for index in self.members):
            raise JobCanceledError()  # as one job's cancel always ended
        raise NothingLeft()

    def _end_overflowed(self, rows: list[bool]) -> None:
        """``nan_output`` for each running member with NaN in any of its rows of the latents
        (diffusers puts a prompt's images together): a NaN latent decodes to a NaN image."""
        for place, index in enumerate(self.members):
            if self.outcomes[index] is None and any(rows[place * self.per_job:(place + 1) * self.per_job]):
                self.outcomes[index] = JobFailedError("nan_output", NAN_OUTPUT)


def check_in(jobs: list[Job], step: int, total: int, due: bool) -> list[int]:
    """Report progress when due; the indexes of the jobs canceled by their clients. Raises when
    the worker must stop now."""
    if lifecycle.interrupting.is_set():
        raise JobInterruptedError()
    if not due:
        return []
    try:
        canceled = records.report_progress(jobs, step, total)
    except RedisError as exc:
        # Progress is best effort: the images are still worth making while Redis restarts.
        log.warning("could not report progress of %d job(s): %s", len(jobs), exc)
        return []
    return [index for index, flag in enumerate(canceled) if flag]


def inject_fault(request: JobRequest) -> None:
    """Test hook (SLOTQ_FAULT_INJECTION=true): raise a device fault named by the prompt."""
    if request.prompt.startswith("__oom__"):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
    if request.prompt.startswith("__device_lost__"):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered (injected)")
