"""Step-level scheduling: slotq's own denoising loop around a loaded diffusers pipeline's components.

A diffusers pipeline call runs a batch from its first step to its last: a job that arrives one step
later waits for the whole batch. Here each image is a ``Flight`` with its own latents, its own
scheduler object (a sampler keeps its step index, and a multistep one its past predictions, on the
object) and its own CPU generator, and one ``SteppingLoop.step`` runs one denoising step of every
flight in a single UNet (or Flux transformer) call, each row at its own timestep. A flight
joins at a step boundary, leaves after its last step, and can be paused and resumed where it stopped;
its state can be read out between steps and put into a new flight of the same request, in another
process (worker/resuming.py's step checkpoints).

Each flight makes the image diffusers' own pipeline makes for its seed alone: the noise, timesteps,
classifier-free guidance and sampler step below mirror ``StableDiffusionPipeline``,
``StableDiffusionXLPipeline`` and ``FluxPipeline.__call__`` (diffusers 0.42); the tests compare them.
Not thread-safe: one call at a time, between steps.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
)
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.utils.torch_utils import randn_tensor

from shared.contract.jobs import JobRequest
from shared.contract.models import FAMILY_SPECS, PIPELINE_CLASSES, Family, FamilySpec, Scheduler, family_spec
from worker.samplers import Samplers

# The samplers the loop runs, by family (its record's ``steppable``): each one keeps all its state on
# its scheduler object and takes one model call per entry of its ``timesteps``, so a flight's own copy
# steps it alone; each is compared with diffusers' own pipeline by tests/worker/test_stepping.py.
STEPPABLE: dict[Family, tuple[Scheduler, ...]] = {family: spec.steppable
                                                   for family, spec in FAMILY_SPECS.items()}
# A model's own scheduler (a job that names no sampler) runs where it is one of these classes, those
# the names above build. Others (PNDM, LMS, Heun...) are refused as untested, not as known broken.
STEPPABLE_CLASSES = (DDIMScheduler, EulerDiscreteScheduler, EulerAncestralDiscreteScheduler,
                     DPMSolverMultistepScheduler, UniPCMultistepScheduler, FlowMatchEulerDiscreteScheduler)


class NotSteppableError(ValueError):
    """A job the loop cannot run: it runs as a whole pipeline call instead (``ImagePipeline``)."""


class SteppingError(RuntimeError):
    """A flight asked to do what its state does not allow (resume a running one, pause past the bound)."""


class FlightState(StrEnum):
    """Where a flight is: in the batch, set aside, or out of the loop for good."""

    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"
    CANCELED = "canceled"


@dataclass(eq=False)
class Flight:
    """One image in flight: its latents, its own sampler and generator, and its conditioning rows."""

    request: JobRequest
    image: int  # which of the request's images: its seed is the request's + this
    scheduler: Any  # its own copy: a sampler's step index and history live on the object
    generator: torch.Generator  # made the noise; an ancestral sampler draws from it at each step
    latents: torch.Tensor  # (1, ...) as the pipeline's own callbacks see them (Flux's packed)
    # The model call's per-row inputs: [uncond, cond] rows with classifier-free guidance, else [cond].
    conditioning: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor]  # inputs one call takes once for all rows (Flux's position ids)
    rows: int
    step: int = 0  # steps done
    state: FlightState = FlightState.RUNNING
    home: torch.device | None = None  # while paused on the CPU: the device its tensors go back to
    offloaded: tuple[str, ...] = ()  # while paused on the CPU: the sampler's attributes moved there

    @property
    def total(self) -> int:
        """Its model calls: one per entry of the sampler's timesteps."""
        return len(self.scheduler.timesteps)

    @property
    def timestep(self) -> torch.Tensor:
        """The timestep of its next step."""
        return self.scheduler.timesteps[self.step]

    @property
    def group(self) -> tuple[Any, ...]:
        """What flights must have in common to share a model call: the shapes of a row of each input,
        and the shared inputs (equal where their shapes are: position ids of one size)."""
        rows = {"latents": self.latents, **self.conditioning}
        return (*((name, tuple(tensor.shape[1:])) for name, tensor in sorted(rows.items())),
                *((name, tuple(tensor.shape)) for name, tensor in sorted(self.shared.items())))


def model_refusal(pipe: Any, samplers: Samplers | None = None, own_sampler: bool = True) -> str | None:
    """Why the loop cannot run this pipeline's jobs, or None where it can; ``own_sampler``: jobs that
    name no sampler (they run with the model's own)."""
    family = PIPELINE_CLASSES.get(type(pipe).__name__)
    if family is None:
        return f"{type(pipe).__name__} is not a text-to-image pipeline the loop knows"
    default = (samplers.default if samplers is not None else pipe.scheduler)
    if own_sampler and not isinstance(default, STEPPABLE_CLASSES):
        return (f"the model's own sampler, {type(default).__name__}, is not steppable; name one of "
                f"{', '.join(STEPPABLE[family])}")
    denoiser = getattr(pipe, "unet", None)
    if denoiser is not None and denoiser.config.time_cond_proj_dim is not None:
        return "a UNet with a guidance embedding (LCM) is not steppable yet"
    return None


def refusal(request: JobRequest, pipe: Any, samplers: Samplers | None = None) -> str | None:
    """Why the loop cannot run this request on this pipeline, or None where it can."""
    family = PIPELINE_CLASSES.get(type(pipe).__name__)
    if family is None:
        return f"{type(pipe).__name__} is not a text-to-image pipeline the loop knows"
    missing = [*request.not_steppable, *(["no seed"] if request.seed is None else [])]
    if missing:
        return f"step-level scheduling does not run jobs with {', '.join(missing)} yet"
    if request.scheduler is not None and request.scheduler not in STEPPABLE[family]:
        return (f"the sampler {request.scheduler!r} is not steppable on {family} models; steppable: "
                f"{', '.join(STEPPABLE[family])}")
    return model_refusal(pipe, samplers, own_sampler=request.scheduler is None)


def supports(request: JobRequest, pipe: Any, samplers: Samplers | None = None) -> bool:
    """Whether the loop can run this request on this pipeline (``refusal`` says why not)."""
    return refusal(request, pipe, samplers) is None


class SteppingLoop:
    """Flights over one loaded pipeline, stepped together: admit, step until they finish, decode."""

    def __init__(self, pipe: Any, samplers: Samplers | None = None, *, max_paused: int = 16,
                 offload_paused: bool | None = None) -> None:
        family = PIPELINE_CLASSES.get(type(pipe).__name__)
        if family is None:
            raise NotSteppableError(f"{type(pipe).__name__} is not a text-to-image pipeline the loop knows")
        self.pipe = pipe
        self.family = family
        self.samplers = samplers or Samplers(pipe.scheduler)
        spec = family_spec(family)
        self.denoiser: _Denoiser = _FluxDenoiser() if spec.denoiser == "transformer" else _UNetDenoiser(spec)
        # Where the pipeline's own call runs the models (the GPU under CPU offload hooks too).
        self.device: torch.device = pipe._execution_device
        self.max_paused = max_paused  # paused flights hold memory (on the CPU where offloaded): a bound
        # Paused flights' tensors to the CPU (None: where the models run elsewhere), so that device
        # memory holds the batch's flights only.
        self.offload_paused = self.device.type != "cpu" if offload_paused is None else offload_paused
        self.running: list[Flight] = []
        self.paused: list[Flight] = []

    def admit(self, request: JobRequest, image: int = 0) -> Flight:
        """Image ``image`` of a request as a new flight, in the batch from the next ``step``."""
        if not 0 <= image < request.num_images:
            raise ValueError(f"the request makes {request.num_images} images: there is no image {image}")
        return self._admit(request, [image])[0]

    def admit_all(self, request: JobRequest) -> list[Flight]:
        """Every image of a request as a flight (its prompt encoded once), in the batch from the next
        ``step``."""
        return self._admit(request, list(range(request.num_images)))

    @torch.inference_mode()
    def _admit(self, request: JobRequest, images: list[int]) -> list[Flight]:
        reason = refusal(request, self.pipe, self.samplers)
        if reason is not None:
            raise NotSteppableError(reason)
        assert request.seed is not None  # refusal() refuses none
        conditioning, shared, rows = self.denoiser.condition(self.pipe, request, self.device)
        template = self.samplers.get(request.scheduler)
        flights = []
        for image in images:
            scheduler = type(template).from_config(template.config)  # its own, fresh: no shared step index
            generator = torch.Generator("cpu").manual_seed(request.seed + image)  # as ImagePipeline seeds
            latents, positions = self.denoiser.start(self.pipe, request, scheduler, generator, self.device,
                                                     conditioning["encoder_hidden_states"].dtype)
            flights.append(Flight(request, image, scheduler, generator, latents, conditioning,
                                  shared | positions, rows))
        self.running.extend(flights)
        return flights

    @torch.inference_mode()
    def step(self) -> list[Flight]:
        """One denoising step of every running flight, one model call per group of equal shapes; the
        flights that took their last step, out of the batch now."""
        groups: dict[tuple[Any, ...], list[Flight]] = defaultdict(list)
        for flight in self.running:
            groups[flight.group].append(flight)
        for group in groups.values():
            self._advance(group)
        finished = [flight for flight in self.running if flight.step == flight.total]
        for flight in finished:
            flight.state = FlightState.FINISHED
            self.running.remove(flight)
        return finished

    def _advance(self, flights: list[Flight]) -> None:
        """One step of flights whose inputs have equal shapes: one model call, then each its own sampler."""
        samples, timesteps = [], []
        for flight in flights:
            sample = torch.cat([flight.latents] * flight.rows) if flight.rows > 1 else flight.latents
            if hasattr(flight.scheduler, "scale_model_input"):
                sample = flight.scheduler.scale_model_input(sample, flight.timestep)
            samples.append(sample)
            timesteps.append(flight.timestep.reshape(1).expand(flight.rows))
        conditioning = {name: torch.cat([flight.conditioning[name] for flight in flights])
                        for name in flights[0].conditioning}
        predictions = self.denoiser.predict(self.pipe, torch.cat(samples), timesteps, conditioning,
                                            flights[0].shared)
        for flight, prediction in zip(flights, predictions.split([f.rows for f in flights]), strict=True):
            if flight.rows > 1:  # classifier-free guidance at the flight's own scale
                uncond, cond = prediction.chunk(2)
                prediction = uncond + flight.request.guidance_scale * (cond - uncond)
            extra = self.denoiser.step_arguments(flight)
            flight.latents = flight.scheduler.step(prediction, flight.timestep, flight.latents, **extra,
                                                   return_dict=False)[0]
            flight.step += 1

    @torch.inference_mode()
    def decode(self, flights: Sequence[Flight]) -> list[np.ndarray]:
        """Each flight's image from its latents, as the pipeline decodes them: (height, width, 3) floats
        in [0, 1], one VAE call per group of one size. NaN stays NaN: the caller checks."""
        images: dict[int, np.ndarray] = {}
        sizes: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for index, flight in enumerate(flights):
            sizes[(*flight.latents.shape, flight.request.width, flight.request.height)].append(index)
        for indices in sizes.values():
            group = [flights[index] for index in indices]
            pixels = self.denoiser.decode(self.pipe, torch.cat([flight.latents for flight in group]),
                                          group[0].request.width, group[0].request.height)
            images.update(zip(indices, pixels, strict=True))
        return [images[index] for index in range(len(flights))]

    @torch.inference_mode()
    def pause(self, flight: Flight) -> None:
        """Take a running flight out of the batch, its latents and sampler state kept (on the CPU where
        the loop offloads) until ``resume``."""
        self._expect(flight, FlightState.RUNNING)
        if len(self.paused) >= self.max_paused:
            raise SteppingError(f"{len(self.paused)} flights are paused already, the most this loop keeps")
        self.running.remove(flight)
        if self.offload_paused:
            _park(flight, self.device)
        flight.state = FlightState.PAUSED
        self.paused.append(flight)

    @torch.inference_mode()
    def resume(self, flight: Flight) -> None:
        """Put a paused flight back in the batch: its next step is the one it stopped before."""
        self._expect(flight, FlightState.PAUSED)
        self.paused.remove(flight)
        if flight.home is not None:
            _unpark(flight)
        flight.state = FlightState.RUNNING
        self.running.append(flight)

    @torch.inference_mode()
    def state_of(self, flight: Flight) -> dict[str, Any]:
        """What a flight between steps needs to go on elsewhere, on the CPU: its step, latents, sampler's
        state and generator's. Its conditioning is not in it: ``restore`` encodes the prompt again."""
        return {"image": flight.image, "step": flight.step, "sampler": type(flight.scheduler).__name__,
                "latents": flight.latents.cpu(), "state": sampler_state(flight.scheduler),
                "generator": flight.generator.get_state()}

    @torch.inference_mode()
    def restore(self, flight: Flight, state: dict[str, Any]) -> None:
        """Put a flight just admitted (at step 0) where ``state_of`` read one of the same request out:
        its next step is the one that flight stopped before. ``ValueError`` where the state does not
        fit this flight (another sampler, size or image, a step outside its run), which it leaves as
        it was."""
        self._expect(flight, FlightState.RUNNING)
        if flight.step != 0:
            raise ValueError("only a flight at step 0 takes a saved state")
        latents, sampler = state.get("latents"), state.get("state")
        if state.get("image") != flight.image or state.get("sampler") != type(flight.scheduler).__name__:
            raise ValueError("the state is another image's, or another sampler's")
        if not (isinstance(latents, torch.Tensor) and latents.shape == flight.latents.shape
                and latents.dtype == flight.latents.dtype):
            raise ValueError("the state's latents are not this flight's shape and type")
        sampler = checked_sampler_state(flight.scheduler, sampler)
        step = state.get("step")
        if not isinstance(step, int) or not 0 < step < flight.total:
            raise ValueError(f"the state's step, {step!r}, is not one this flight resumes at")
        generator = state.get("generator")
        if not isinstance(generator, torch.Tensor):
            raise ValueError("the state has no generator state")
        flight.generator.set_state(generator)
        put_sampler_state(flight.scheduler, sampler, self.device)
        flight.latents = latents.to(flight.latents.device)
        flight.step = step

    def cancel(self, flight: Flight) -> None:
        """End a running or paused flight for good; its tensors are let go."""
        if flight.state not in (FlightState.RUNNING, FlightState.PAUSED):
            raise SteppingError(f"a {flight.state} flight cannot be canceled")
        (self.running if flight.state == FlightState.RUNNING else self.paused).remove(flight)
        flight.state = FlightState.CANCELED
        flight.conditioning, flight.shared = {}, {}

    @staticmethod
    def _expect(flight: Flight, state: FlightState) -> None:
        if flight.state != state:
            raise SteppingError(f"the flight is {flight.state}, not {state}")


def _park(flight: Flight, device: torch.device) -> None:
    """A paused flight's tensors moved to the CPU: its latents, conditioning and its sampler's state
    (a multistep sampler's past predictions). The sampler's attributes that moved are noted, so that
    only they go back (Euler keeps its sigmas on the CPU on purpose)."""
    flight.offloaded = tuple(name for name, value in vars(flight.scheduler).items() if _on(value, device))
    flight.home = device
    _move(flight, torch.device("cpu"))


def _unpark(flight: Flight) -> None:
    """A parked flight's tensors back on the device they came from."""
    assert flight.home is not None
    _move(flight, flight.home)
    flight.home, flight.offloaded = None, ()


def _move(flight: Flight, to: torch.device) -> None:
    flight.latents = flight.latents.to(to)
    flight.conditioning = {name: tensor.to(to) for name, tensor in flight.conditioning.items()}
    flight.shared = {name: tensor.to(to) for name, tensor in flight.shared.items()}
    state = vars(flight.scheduler)
    for name in flight.offloaded:
        state[name] = _to(state[name], to)


def _on(value: object, device: torch.device) -> bool:
    """Whether a scheduler attribute is a tensor, or a list holding one, on a device of this type (by
    type: "cuda" and "cuda:0" are one device to a loop)."""
    if isinstance(value, list):
        return any(isinstance(each, torch.Tensor) and each.device.type == device.type for each in value)
    return isinstance(value, torch.Tensor) and value.device.type == device.type


def sampler_state(scheduler: Any) -> dict[str, Any]:
    """A sampler's state between two steps, on the CPU: its tensors, numbers, flags and lists of them (a
    multistep sampler's past predictions), not its config."""
    cpu = torch.device("cpu")
    return {name: _to(value, cpu) for name, value in vars(scheduler).items() if _kept(value)}


def checked_sampler_state(scheduler: Any, state: object) -> dict[str, Any]:
    """A saved state (:func:`sampler_state`) that can stand for this fresh sampler's (the same class, its
    timesteps set); ``ValueError`` where one of its attributes is of another kind or shape."""
    fresh = vars(scheduler)
    # Some attributes appear at a sampler's first step (UniPC's last sample): those are taken as saved.
    if not isinstance(state, dict) or any(
            name in fresh and not _fits(value, fresh[name]) for name, value in state.items()):
        raise ValueError("the state's sampler attributes are not this sampler's")
    return state


def put_sampler_state(scheduler: Any, state: dict[str, Any], device: torch.device) -> None:
    """Put a checked saved state into the sampler, each tensor on the device its fresh one is on (Euler
    keeps its sigmas on the CPU), else on ``device``."""
    fresh = vars(scheduler)
    for name, value in state.items():
        home = fresh.get(name)
        fresh[name] = _to(value, home.device if isinstance(home, torch.Tensor) else device)


def _kept(value: object) -> bool:
    """Whether a sampler attribute is state a checkpoint keeps: tensors, numbers, flags and lists of
    them (a multistep sampler's past predictions), not its config."""
    if isinstance(value, list):
        return all(each is None or isinstance(each, torch.Tensor | int | float | bool) for each in value)
    return value is None or isinstance(value, torch.Tensor | int | float | bool | str)


def _to(value: Any, device: torch.device) -> Any:
    """A sampler attribute on a device: a tensor, or a list's tensors (other values as they are)."""
    if isinstance(value, list):
        return [each.to(device) if isinstance(each, torch.Tensor) else each for each in value]
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _fits(saved: Any, fresh: Any) -> bool:
    """Whether a saved sampler attribute can stand for a fresh sampler's: the same kind, and a tensor
    of the same shape."""
    if isinstance(fresh, torch.Tensor):
        return isinstance(saved, torch.Tensor) and saved.shape == fresh.shape and saved.dtype == fresh.dtype
    if isinstance(fresh, list):
        return isinstance(saved, list) and len(saved) == len(fresh)
    return fresh is None or saved is None or type(saved) is type(fresh)


_accepts: dict[type, frozenset[str]] = {}


def _step_parameters(scheduler: Any) -> frozenset[str]:
    """The keyword arguments a scheduler class's ``step`` takes (read once a class)."""
    kind = type(scheduler)
    if kind not in _accepts:
        _accepts[kind] = frozenset(inspect.signature(kind.step).parameters)
    return _accepts[kind]


class _Denoiser:
    """What differs by family: conditioning, start noise, the model call, the decode."""

    def condition(self, pipe: Any, request: JobRequest, device: torch.device
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
        raise NotImplementedError

    def start(self, pipe: Any, request: JobRequest, scheduler: Any, generator: torch.Generator,
              device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError

    def predict(self, pipe: Any, sample: torch.Tensor, timesteps: list[torch.Tensor],
                conditioning: dict[str, torch.Tensor], shared: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def step_arguments(self, flight: Flight) -> dict[str, Any]:
        return {}

    def decode(self, pipe: Any, latents: torch.Tensor, width: int, height: int) -> np.ndarray:
        raise NotImplementedError


class _UNetDenoiser(_Denoiser):
    """SD 1.x/2.x and SDXL: classifier-free guidance as two rows, a UNet that takes a timestep a row."""

    def __init__(self, spec: FamilySpec) -> None:
        # The steps below mirror StableDiffusionXLPipeline's call, else StableDiffusionPipeline's.
        self.xl = spec.pipeline_class == "StableDiffusionXLPipeline"

    def condition(self, pipe: Any, request: JobRequest, device: torch.device
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
        """The prompt's embeddings (and SDXL's pooled ones and size ids), negative rows first."""
        guided = request.guidance_scale > 1  # as the pipelines decide (no LCM UNet: refused)
        # None where the job has none, as ImagePipeline passes a lone job's: SDXL makes zeros of None
        # (force_zeros_for_empty_prompt) but encodes "".
        negative_prompt = request.negative_prompt or None
        if not self.xl:
            positive, negative = pipe.encode_prompt(request.prompt, device, 1, guided, negative_prompt)
            rows = [negative, positive] if guided else [positive]
            return {"encoder_hidden_states": torch.cat(rows)}, {}, len(rows)
        positive, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=request.prompt, device=device, num_images_per_prompt=1, do_classifier_free_guidance=guided,
            negative_prompt=negative_prompt)
        # original size, crop top-left, target size: what the pipeline's _get_add_time_ids makes by default
        size = (request.height, request.width)
        ids = torch.tensor([[*size, 0, 0, *size]], dtype=positive.dtype, device=device)
        if not guided:
            return {"encoder_hidden_states": positive, "text_embeds": pooled, "time_ids": ids}, {}, 1
        return {"encoder_hidden_states": torch.cat([negative, positive]),
                "text_embeds": torch.cat([negative_pooled, pooled]), "time_ids": torch.cat([ids, ids])}, {}, 2

    def start(self, pipe: Any, request: JobRequest, scheduler: Any, generator: torch.Generator,
              device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The sampler's timesteps, and the noise scaled by its initial sigma (prepare_latents)."""
        scheduler.set_timesteps(request.steps, device=device)
        if self.xl and hasattr(scheduler, "set_begin_index"):  # SDXL's call sets it; SD's does not
            scheduler.set_begin_index(0)
        scale = pipe.vae_scale_factor
        shape = (1, pipe.unet.config.in_channels, request.height // scale, request.width // scale)
        noise = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
        return noise * scheduler.init_noise_sigma, {}

    def predict(self, pipe: Any, sample: torch.Tensor, timesteps: list[torch.Tensor],
                conditioning: dict[str, torch.Tensor], shared: dict[str, torch.Tensor]) -> torch.Tensor:
        # The UNet embeds timesteps as float32 (get_timestep_embedding's .float()), so int (DDIM) and
        # float (Euler) ones of different samplers stack without changing any row's value.
        timestep = torch.cat([each.to(torch.float32) for each in timesteps])
        added = ({"text_embeds": conditioning["text_embeds"], "time_ids": conditioning["time_ids"]}
                 if self.xl else None)
        return pipe.unet(sample, timestep, encoder_hidden_states=conditioning["encoder_hidden_states"],
                         added_cond_kwargs=added, return_dict=False)[0]

    def step_arguments(self, flight: Flight) -> dict[str, Any]:
        """eta and the generator where the sampler takes them (prepare_extra_step_kwargs)."""
        accepted = _step_parameters(flight.scheduler)
        extra: dict[str, Any] = {"eta": 0.0} if "eta" in accepted else {}
        if "generator" in accepted:
            extra["generator"] = flight.generator
        return extra

    def decode(self, pipe: Any, latents: torch.Tensor, width: int, height: int) -> np.ndarray:
        vae = pipe.vae
        if not self.xl:
            pixels = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
            pixels, unsafe = pipe.run_safety_checker(pixels, latents.device, latents.dtype)
            denormalize = [True] * len(pixels) if unsafe is None else [not each for each in unsafe]
            return pipe.image_processor.postprocess(pixels, output_type="np", do_denormalize=denormalize)
        upcast = vae.dtype == torch.float16 and vae.config.force_upcast  # SDXL's VAE overflows in float16
        if upcast:
            vae.to(dtype=torch.float32)
            latents = latents.to(torch.float32)
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:
            std_of = torch.tensor(std).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            mean_of = torch.tensor(mean).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            latents = latents * std_of / vae.config.scaling_factor + mean_of
        else:
            latents = latents / vae.config.scaling_factor
        pixels = vae.decode(latents, return_dict=False)[0]
        if upcast:
            vae.to(dtype=torch.float16)
        if pipe.watermark is not None:
            pixels = pipe.watermark.apply_watermark(pixels)
        return pipe.image_processor.postprocess(pixels, output_type="np")


class _FluxDenoiser(_Denoiser):
    """Flux: guidance is an input of the transformer (one row a flight), packed latents, flow matching."""

    def condition(self, pipe: Any, request: JobRequest, device: torch.device
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
        """The T5 and pooled CLIP embeddings and the guidance; the pipeline ignores a negative prompt
        without ``true_cfg_scale`` (slotq passes none), and so does this."""
        embeddings, pooled, text_ids = pipe.encode_prompt(prompt=request.prompt, prompt_2=None, device=device,
                                                          num_images_per_prompt=1, max_sequence_length=512)
        conditioning = {"encoder_hidden_states": embeddings, "pooled_projections": pooled}
        if pipe.transformer.config.guidance_embeds:  # a row's own guidance scale
            conditioning["guidance"] = torch.full([1], request.guidance_scale, device=device,
                                                  dtype=torch.float32)
        return conditioning, {"txt_ids": text_ids}, 1

    def start(self, pipe: Any, request: JobRequest, scheduler: Any, generator: torch.Generator,
              device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The packed noise, then the sampler's sigmas shifted for the image's token count."""
        channels = pipe.transformer.config.in_channels // 4
        latents, image_ids = pipe.prepare_latents(1, channels, request.height, request.width, dtype, device,
                                                  generator)
        steps = request.steps
        config = scheduler.config
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(latents.shape[1], config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        if sigmas is None:
            scheduler.set_timesteps(steps, device=device, mu=mu)
        else:
            scheduler.set_timesteps(sigmas=sigmas, device=device, mu=mu)
        scheduler.set_begin_index(0)
        return latents, {"img_ids": image_ids}

    def predict(self, pipe: Any, sample: torch.Tensor, timesteps: list[torch.Tensor],
                conditioning: dict[str, torch.Tensor], shared: dict[str, torch.Tensor]) -> torch.Tensor:
        timestep = torch.cat([each.to(sample.dtype) for each in timesteps])
        return pipe.transformer(hidden_states=sample, timestep=timestep / 1000,
                                guidance=conditioning.get("guidance"),
                                pooled_projections=conditioning["pooled_projections"],
                                encoder_hidden_states=conditioning["encoder_hidden_states"],
                                txt_ids=shared["txt_ids"], img_ids=shared["img_ids"],
                                joint_attention_kwargs={}, return_dict=False)[0]

    def decode(self, pipe: Any, latents: torch.Tensor, width: int, height: int) -> np.ndarray:
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        pixels = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(pixels, output_type="np")


__all__ = ["STEPPABLE", "STEPPABLE_CLASSES", "Flight", "FlightState", "NotSteppableError", "SteppingError",
           "SteppingLoop", "model_refusal", "refusal", "supports"]
