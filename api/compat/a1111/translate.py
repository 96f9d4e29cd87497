"""A1111 request bodies as slotq jobs, and finished jobs as the ``info`` A1111's clients read.

The tables come first: A1111's samplers and schedule types as slotq's samplers run them, and the
fields slotq accepts without applying, with the values that mean "not set" (A1111 1.10's defaults,
and webuiapi's where they differ). A field left at such a value is not reported; any other value is
listed in ``info.not_applied``.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from shared.contract.errors import InvalidRequestError, UnknownModelError
from shared.contract.jobs import MAX_IMAGES, MAX_SEED, JobRequest, JobView, output_size
from shared.contract.models import ModelInfo, Scheduler

VERSION = "slotq"  # what A1111 reports as its version in info and infotexts


@dataclass(frozen=True)
class Sampler:
    """One A1111 sampler: its name, aliases and options as ``/samplers`` lists them, and the slotq
    sampler it runs as under each schedule type it can apply; ``own`` is the one "Automatic" means."""

    name: str
    aliases: tuple[str, ...]
    options: dict[str, Any]
    runs: dict[str, Scheduler]

    @property
    def own(self) -> str:
        return self.options.get("scheduler", "normal")


# In A1111's order: its first sampler is what an unknown name falls back to.
SAMPLERS: tuple[Sampler, ...] = (
    Sampler("DPM++ 2M", ("k_dpmpp_2m",), {"scheduler": "karras"},
            {"karras": "dpmpp_2m_karras", "normal": "dpmpp_2m"}),
    Sampler("Euler a", ("k_euler_a", "k_euler_ancestral"), {"uses_ensd": True}, {"normal": "euler_a"}),
    Sampler("Euler", ("k_euler",), {}, {"normal": "euler"}),
    Sampler("Euler", ("k_euler",), {}, {"normal": "flow_euler"}),  # a flow-matching model's (Flux)
    Sampler("DDIM", ("ddim",), {}, {"normal": "ddim"}),
    Sampler("UniPC", ("unipc",), {}, {"normal": "unipc"}),
)
DEFAULT_SAMPLER = "Euler"  # A1111's API default (its `sampler_index`) when a body names none

# A1111's schedule types (sd_schedulers.py): name -> label, aliases, default_rho, need_inner_model.
SCHEDULES: dict[str, tuple[str, tuple[str, ...], float, bool]] = {
    "automatic": ("Automatic", (), -1, False),
    "uniform": ("Uniform", (), -1, True),
    "karras": ("Karras", (), 7.0, False),
    "exponential": ("Exponential", (), -1, False),
    "polyexponential": ("Polyexponential", (), 1.0, False),
    "sgm_uniform": ("SGM Uniform", ("SGMUniform",), -1, True),
    "kl_optimal": ("KL Optimal", (), -1, False),
    "align_your_steps": ("Align Your Steps", (), -1, False),
    "simple": ("Simple", (), -1, True),
    "normal": ("Normal", (), -1, True),
    "ddim": ("DDIM", (), -1, True),
    "beta": ("Beta", (), -1, True),
}

# Accepted and not applied, with the values that leave them unset (None, "", [] and {} always do).
# Fields that only matter beside another (subseed with subseed_strength, script_args with
# script_name) are not listed apart; enable_hr and its hr_* fields are read by `hires_of`, and
# alwayson_scripts by controlnet.py (its ControlNet units applied, any other script listed).
NOT_APPLIED: dict[str, tuple[Any, ...]] = {
    "restore_faces": (False,), "tiling": (False,), "styles": (),
    "subseed_strength": (0,), "seed_resize_from_w": (-1, 0), "seed_resize_from_h": (-1, 0),
    "clip_skip": (1,), "eta": (1,), "s_churn": (0,), "s_tmax": (0,), "s_tmin": (0,), "s_noise": (1,),
    "s_min_uncond": (0,), "script_name": (), "refiner_checkpoint": (),
    "refiner_switch_at": (), "send_images": (True,), "save_images": (False,),
    "disable_extra_networks": (False,), "firstpass_image": (), "force_task_id": (), "infotext": (),
    "resize_mode": (0,), "image_cfg_scale": (1.5,), "inpainting_fill": (0,), "inpaint_full_res": (True,),
    "inpaint_full_res_padding": (0,), "initial_noise_multiplier": (1,), "latent_mask": (),
}

# What GET /options shows beside the caller's checkpoint; an override_settings key equal to its
# value here changes nothing, so is not reported.
OPTIONS: dict[str, Any] = {
    "sd_vae": "Automatic", "CLIP_stop_at_last_layers": 1, "samples_format": "png", "eta_ancestral": 1.0,
    "live_previews_enable": True, "live_previews_image_format": "jpeg", "show_progress_every_n_steps": 1,
}

# slotq's request fields as A1111's clients name them, for the `loc` of a refusal's details.
# A nested field is named by its path's first two parts ("hires.scale").
A1111_FIELDS = {"guidance_scale": "cfg_scale", "strength": "denoising_strength", "num_images": "batch_size",
                "image": "init_images", "scheduler": "sampler_name", "loras": "prompt",
                "model": "override_settings.sd_model_checkpoint", "hires": "enable_hr",
                "hires.scale": "hr_scale", "hires.steps": "hr_second_pass_steps",
                "hires.denoise": "denoising_strength", "hires.upscaler": "hr_upscaler",
                "controlnets": "alwayson_scripts.controlnet.args"}

# txt2img's hires fix (enable_hr) as slotq's hires pass. A1111's "Latent" resizes the latents
# bilinearly, as slotq's `latent` does; its "Lanczos" and "None" (a plain resize, which A1111 makes
# with Lanczos) resize the image, as `lanczos` does. Any other upscaler runs as the nearer of the two
# and is listed in not_applied: A1111's other latent modes (bicubic, nearest, antialiased) as
# `latent`, its upscaling models (ESRGAN, SwinIR, LDSR...), which slotq has none of, as `lanczos`.
HIRES_UPSCALERS = {"Latent": "latent", "Lanczos": "lanczos", "None": "lanczos"}
DEFAULT_UPSCALER = "Latent"  # A1111's latent_upscale_default_mode: what an hr_upscaler of null runs
HIRES_SCALE, HIRES_DENOISE = 2.0, 0.75  # StableDiffusionProcessingTxt2Img's hr_scale, denoising_strength
# The second pass's own choices, and the first pass's field each means "the same" when equal to
# (A1111's "Use same ..." choices too): slotq's hires pass runs the first pass's; any other is listed.
HIRES_SAME: dict[str, str | None] = {
    "hr_sampler_name": "sampler_name", "hr_scheduler": "scheduler", "hr_prompt": "prompt",
    "hr_negative_prompt": "negative_prompt", "hr_cfg": "cfg_scale", "hr_checkpoint_name": None}
SAME_CHOICES = ("Use same sampler", "Use same scheduler", "Use same checkpoint")

# A1111's extra-network syntax for a LoRA (and LyCORIS, its older name): <lora:name[:weight[:...]]>.
LORA_TAG = re.compile(r"<(?:lora|lyco):([^:>]+)(?::([^:>]*))?((?::[^:>]*)*)>", re.IGNORECASE)
UNSET: tuple[Any, ...] = (None, "", [], {})


@dataclass
class Call:
    """One txt2img or img2img body, translated: the slotq job body and what ``info`` reports of it."""

    body: dict[str, Any]
    model: ModelInfo
    img2img: bool = False
    job: dict[str, Any] = field(default_factory=dict)
    size: tuple[int, int] | None = None  # img2img's: its start image's, once added
    sampler: str = DEFAULT_SAMPLER
    schedule: str = "automatic"
    seed: int = 0
    not_applied: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # A1111's extra_generation_params: hires, units


# --- checkpoints -------------------------------------------------------------------------------------

def model_hash(name: str) -> str:
    """A stable sha256 standing for the model of this name (slotq names models, not files)."""
    return hashlib.sha256(f"slotq-model:{name}".encode()).hexdigest()


def title(name: str) -> str:
    """A model's A1111 title, "<name> [<short hash>]"."""
    return f"{name} [{model_hash(name)[:10]}]"


def checkpoint(info: ModelInfo) -> dict[str, Any]:
    """A model as ``/sd-models`` lists it."""
    digest = model_hash(info.name)
    return {"title": title(info.name), "model_name": info.name, "hash": digest[:10], "sha256": digest,
            "filename": info.checkpoint or info.name, "config": None}


def model_named(value: Any, offered: Sequence[str], aliases: dict[str, str]) -> str:
    """The model an A1111 checkpoint name means (its title, name, hash or sha256, or a
    SLOTQ_MODEL_ALIASES name), or ``UnknownModelError``."""
    for name in offered:
        digest = model_hash(name)
        if value in (name, title(name), digest, digest[:10]):
            return name
    if isinstance(value, str) and aliases.get(value) in offered:
        return aliases[value]
    known = ", ".join(title(name) for name in offered)
    raise UnknownModelError(f"No checkpoint named {str(value)[:80]!r}; this service has {known}.")


# --- samplers ----------------------------------------------------------------------------------------

def samplers_of(model: ModelInfo) -> list[Sampler]:
    """The A1111 samplers a job on this model can run, in A1111's order."""
    return [sampler for sampler in SAMPLERS if set(sampler.runs.values()) <= set(model.schedulers)]


def schedules_of(model: ModelInfo) -> list[str]:
    """The schedule types a job on this model can apply: "automatic" and those its samplers run."""
    applied = {schedule for sampler in samplers_of(model) for schedule in sampler.runs}
    return [name for name in SCHEDULES if name == "automatic" or name in applied]


def schedule_named(value: str) -> str | None:
    """A1111's schedule type by its name, label or alias, in any case."""
    wanted = value.strip().lower()
    for name, (label, aliases, _, _) in SCHEDULES.items():
        if wanted in (name, label.lower(), *(alias.lower() for alias in aliases)):
            return name
    return None


def split_name(sampler: str, schedule: str) -> tuple[str, str]:
    """A sampler's name and schedule type, where the name ends in one ("DPM++ 2M Karras", as A1111
    listed them before 1.9): that one wins over the body's ``scheduler``."""
    for name, (label, aliases, _, _) in SCHEDULES.items():
        for suffix in (label, *aliases):
            if sampler.lower().endswith(" " + suffix.lower()):
                return sampler[:-len(suffix) - 1], name
    return sampler, schedule


def choose_sampler(call: Call) -> Scheduler | None:
    """The slotq sampler for the body's ``sampler_name`` (else the deprecated ``sampler_index``)
    and ``scheduler``, as A1111 1.10 reads them: a combined name such as "DPM++ 2M Karras" is split,
    and an unknown sampler falls back to the model's first (listed in ``not_applied``)."""
    asked, schedule = split_name(str(call.body.get("sampler_name") or call.body.get("sampler_index")
                                     or DEFAULT_SAMPLER), str(call.body.get("scheduler") or "automatic"))
    usable = samplers_of(call.model)
    wanted = asked.strip().lower()
    found = next((s for s in usable if wanted in (s.name.lower(), *s.aliases)), None)
    if found is None:
        call.not_applied.append("sampler_name")
        if not usable:
            return None  # a model no A1111 sampler fits runs its own
        found = usable[0]
    named = schedule_named(str(schedule))
    if named == "automatic":
        named = found.own
    if named not in found.runs:
        call.not_applied.append("scheduler")
        named = found.own
    call.sampler, call.schedule = found.name, named
    return found.runs[named]


# --- the body ----------------------------------------------------------------------------------------

def loras_in(prompt: str) -> tuple[str, list[dict[str, Any]], list[str]]:
    """The prompt without its ``<lora:name:weight>`` tags, the adapters they name (weight absent:
    1.0) and the tags whose further arguments (A1111's separate UNet weight, ...) are not applied."""
    loras: list[dict[str, Any]] = []
    ignored: list[str] = []
    for match in LORA_TAG.finditer(prompt):
        name, weight, rest = match[1].strip(), match[2], match[3]
        try:
            scale = float(weight) if weight not in (None, "") else 1.0
        except ValueError:
            raise InvalidRequestError(details=[{"loc": ["prompt"], "msg": f"the weight of <lora:{name}:"
                                                f"{weight}> is not a number"}]) from None
        loras.append({"name": name, "scale": scale})
        if rest:
            ignored.append(f"prompt <lora:{name}> arguments after its weight")
    return LORA_TAG.sub("", prompt).strip(), loras, ignored


def images_of(body: dict[str, Any]) -> int:
    """``batch_size`` x ``n_iter``: the job's images (at most MAX_IMAGES)."""
    counts = [body.get(name, 1) if body.get(name) is not None else 1 for name in ("batch_size", "n_iter")]
    if not all(isinstance(count, int) and not isinstance(count, bool) and count >= 1 for count in counts):
        raise InvalidRequestError(details=[{"loc": ["batch_size"], "msg": "batch_size and n_iter must be "
                                            "whole numbers of at least 1"}])
    total = counts[0] * counts[1]
    if total > MAX_IMAGES:
        raise InvalidRequestError(details=[{"loc": ["batch_size"], "msg": f"batch_size x n_iter is {total}: "
                                            f"a call makes at most {MAX_IMAGES} images"}])
    return total


def seed_of(body: dict[str, Any]) -> Any:
    """The seed to run: the body's, or for -1 (or none) one drawn here, so that ``info`` can say it."""
    seed = body.get("seed")
    return secrets.randbelow(MAX_SEED + 1) if seed is None or seed == -1 else seed


def unapplied(body: dict[str, Any]) -> list[str]:
    """The body's fields that slotq accepts without applying, where they are set."""
    listed = [name for name, unset in NOT_APPLIED.items()
              if name in body and body[name] not in UNSET and body[name] not in unset]
    overrides = body.get("override_settings")
    if isinstance(overrides, dict):
        listed += [f"override_settings.{key}" for key, value in overrides.items()
                   if key != "sd_model_checkpoint" and value not in UNSET and OPTIONS.get(key, ...) != value]
    return listed


def translate(call: Call) -> Call:
    """Fill in the call's slotq job body; its model is chosen, its images (img2img) added after."""
    body = call.body
    prompt, loras, ignored = loras_in(str(body.get("prompt") or ""))
    call.seed, call.not_applied = seed_of(body), unapplied(body) + ignored
    scheduler = choose_sampler(call)
    # A1111's prompts weigh their words: (word:1.3), (word), [word] (weighted prompts, docs/models.md).
    job: dict[str, Any] = {"prompt": prompt, "model": call.model.name, "seed": call.seed,
                           "num_images": images_of(body), "loras": loras, "previews": True,
                           "prompt_syntax": "weighted"}
    if scheduler is not None:
        job["scheduler"] = scheduler
    if body.get("negative_prompt"):
        job["negative_prompt"] = body["negative_prompt"]
    for a1111, slotq in (("width", "width"), ("height", "height"), ("steps", "steps"),
                         ("cfg_scale", "guidance_scale")):
        if body.get(a1111) is not None:
            job[slotq] = body[a1111]
    if isinstance(job.get("guidance_scale"), int) and not isinstance(job["guidance_scale"], bool):
        job["guidance_scale"] = float(job["guidance_scale"])  # A1111 takes 7 for 7.0
    call.job = job
    hires = hires_of(call)
    if hires is not None:
        job["hires"] = hires
    return call


# --- the hires fix -----------------------------------------------------------------------------------

def hires_of(call: Call) -> dict[str, Any] | None:
    """txt2img's ``enable_hr`` and its ``hr_*`` fields as slotq's hires pass (None without one), with
    what A1111 writes of it in ``extra``; img2img has no such pass (``enable_hr`` is listed there)."""
    body = call.body
    if not body.get("enable_hr"):
        return None
    if call.img2img:
        call.not_applied.append("enable_hr")
        return None
    asked = body.get("hr_upscaler")
    named = asked if isinstance(asked, str) and asked else DEFAULT_UPSCALER
    upscaler, latent = HIRES_UPSCALERS.get(named), call.model.spec.takes_latent_upscale
    if upscaler is None or (upscaler == "latent" and not latent):  # Flux's latents are packed: images resized
        upscaler = "latent" if named.startswith("Latent") and latent else "lanczos"
        call.not_applied.append("hr_upscaler")
    denoise = body.get("denoising_strength")
    hires: dict[str, Any] = {"scale": hires_scale(call), "upscaler": upscaler,
                             "denoise": HIRES_DENOISE if denoise is None else denoise}
    if body.get("hr_second_pass_steps"):  # 0: the first pass's steps
        hires["steps"] = call.extra["Hires steps"] = body["hr_second_pass_steps"]
    if asked is not None:  # A1111 writes the upscaler only where the body names one
        call.extra["Hires upscaler"] = asked
    call.not_applied += [name for name in HIRES_SAME if not same_as_first_pass(call, name)]
    return hires


def hires_scale(call: Call) -> Any:
    """The hires pass's scale: ``hr_scale``, or where ``hr_resize_x`` or ``hr_resize_y`` is set, the
    scale that makes that size; a size of another shape than the first pass's is refused (slotq's
    pass scales both sides alike, where A1111 would crop)."""
    body = call.body
    resize = (body.get("hr_resize_x") or 0, body.get("hr_resize_y") or 0)
    if resize == (0, 0):
        scale = HIRES_SCALE if body.get("hr_scale") is None else body["hr_scale"]
        call.extra["Hires upscale"] = float(scale) if type(scale) is int else scale  # A1111's float
        return scale
    call.extra["Hires resize"] = f"{resize[0]}x{resize[1]}"
    defaults = call.model.defaults
    first = (call.job.get("width", defaults.width), call.job.get("height", defaults.height))
    if not all(type(side) is int and side >= 0 for side in resize) or not all(
            type(side) is int and side > 0 for side in first):
        raise InvalidRequestError(details=[{"loc": ["hr_resize_x"], "msg": "hr_resize_x, hr_resize_y, width "
                                            "and height must be whole numbers"}])
    scales = [side / before for side, before in zip(resize, first, strict=True) if side]
    made = {output_size(*first, scale, call.model.side_multiple) for scale in scales}
    if len(made) > 1:
        message = (f"{resize[0]}x{resize[1]} is not {first[0]}x{first[1]} scaled: slotq's hires pass scales "
                   "both sides alike; send hr_scale, or one of hr_resize_x and hr_resize_y")
        raise InvalidRequestError(details=[{"loc": ["hr_resize_x"], "msg": message}])
    return scales[0]


def same_as_first_pass(call: Call, name: str) -> bool:
    """Whether the second pass's own choice ``name`` is unset, or the first pass's."""
    value, body = call.body.get(name), call.body
    if value in UNSET or value in SAME_CHOICES:
        return True
    first = HIRES_SAME[name]
    if first is None:  # the checkpoint
        return value in (call.model.name, title(call.model.name))
    if value == body.get(first):
        return True
    if name == "hr_sampler_name":
        return str(value).lower() == call.sampler.lower()
    if name == "hr_scheduler":  # "Automatic": the sampler's own schedule
        own = next((sampler.own for sampler in SAMPLERS if sampler.name == call.sampler), None)
        named = schedule_named(str(value))
        return call.schedule in (named, own if named == "automatic" else None)
    return name == "hr_cfg" and value == call.job.get("guidance_scale", call.model.defaults.guidance_scale)


# --- the answer --------------------------------------------------------------------------------------

def info(call: Call, request: JobRequest, view: JobView | None, job_id: str | None) -> dict[str, Any]:
    """What A1111 puts in ``info`` (a JSON text in the answer), for the job this call ran; without
    ``view``, for one that was interrupted."""
    body, count = call.body, request.num_images
    prompt, negative = str(body.get("prompt") or ""), str(body.get("negative_prompt") or "")
    seeds = [call.seed + index for index in range(count)]  # the worker seeds image i with seed + i
    digest = model_hash(call.model.name)[:10]
    schedule = SCHEDULES[call.schedule][0]
    strength = request.strength if request.image is not None else None
    if request.hires is not None:  # txt2img's denoising_strength is its hires pass's
        strength = request.hires.denoise
    made = (view.started_at or view.created_at) if view else None
    head = (f"Steps: {request.steps}, Sampler: {call.sampler}, Schedule type: {schedule}, "
            f"CFG scale: {request.guidance_scale}, Seed: ")
    extra = "".join(f", {key}: {quote(value)}" for key, value in call.extra.items())
    tail = (f", Size: {request.width}x{request.height}, Model hash: {digest}, Model: {call.model.name}"
            + (f", Denoising strength: {strength}" if strength is not None else "")
            + f"{extra}, Version: {VERSION}")
    texts = [f"{prompt}\n" + (f"Negative prompt: {negative}\n" if negative else "") + f"{head}{seed}{tail}"
             for seed in seeds]
    return {
        "prompt": prompt, "all_prompts": [prompt] * count, "negative_prompt": negative,
        "all_negative_prompts": [negative] * count, "seed": call.seed, "all_seeds": seeds,
        "subseed": call.seed, "all_subseeds": seeds, "subseed_strength": 0.0,
        "width": request.width, "height": request.height, "sampler_name": call.sampler,
        "cfg_scale": request.guidance_scale, "steps": request.steps, "batch_size": count,
        "restore_faces": False, "face_restoration_model": None, "sd_model_name": call.model.name,
        "sd_model_hash": digest, "sd_vae_name": None, "sd_vae_hash": None,
        "seed_resize_from_w": -1, "seed_resize_from_h": -1, "denoising_strength": strength,
        "extra_generation_params": {"Schedule type": schedule, **call.extra}, "index_of_first_image": 0,
        "infotexts": texts, "styles": [], "job_timestamp": timestamp(made), "clip_skip": 1,
        "is_using_inpainting_conditioning": False, "version": VERSION,
        "job_id": job_id, "interrupted": view is None, "not_applied": call.not_applied,
    }


def quote(value: Any) -> Any:
    """An infotext value as A1111 writes it: JSON-quoted where it holds a comma, colon or newline."""
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if any(char in text for char in ",:\n") else value


def timestamp(moment: datetime | None) -> str:
    """A1111's job timestamp, "YYYYmmddHHMMSS" ("0" for none)."""
    return moment.astimezone(UTC).strftime("%Y%m%d%H%M%S") if moment else "0"


def parameters(body: dict[str, Any]) -> dict[str, Any]:
    """The request as received, as A1111 echoes it: without the input images unless
    ``include_init_images``, and never SillyTavern's ``auth`` (its credentials in clear)."""
    echoed = {key: value for key, value in body.items() if key != "auth"}
    if not body.get("include_init_images"):
        for name in ("init_images", "mask"):
            if name in echoed:
                echoed[name] = None
    return echoed


def answer(call: Call, request: JobRequest, pngs: list[str], view: JobView | None,
           job_id: str | None) -> dict[str, Any]:
    """A txt2img or img2img answer: raw base64 PNGs, the parameters and ``info`` as JSON text."""
    return {"images": pngs, "parameters": parameters(call.body),
            "info": json.dumps(info(call, request, view, job_id))}
