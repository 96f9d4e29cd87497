"""sd-webui-controlnet's units (``alwayson_scripts.controlnet.args``) as slotq's ``controlnets``.

A unit is a dict as the extension's ``to_processing_unit`` reads one (webuiapi's
``ControlNetUnit.to_dict()`` sends every field): ``model`` names a ControlNet the call's model offers
(SLOTQ_CONTROLNET_DIR), by its name or as the extension lists one, ``name [hash]``; ``image`` (older
clients: ``input_image``) is base64 with or without a ``data:`` prefix, or ``{"image", "mask"}``, and
img2img takes its start image for a unit without one, as the extension does; ``weight``,
``guidance_start`` and ``guidance_end`` are the control's scale, start and end; ``module`` is its
preprocessor. A disabled unit is dropped. A field that changes the image and is not applied is listed
in ``info.not_applied`` unless at the extension's default (or webuiapi's); ``low_vram``,
``save_detected_map`` and the like change nothing in the image and are taken silently.
"""

from __future__ import annotations

from typing import Any

from api.compat.a1111 import images
from api.compat.a1111.translate import UNSET, Call
from shared.contract.errors import InvalidRequestError, UnknownControlNetError
from shared.contract.jobs import MAX_CONTROLNETS
from shared.contract.models import ModelInfo
from shared.contract.settings import Settings

VERSION = 2  # the extension's API version whose unit fields this module reads
SCRIPT = "controlnet"  # the extension's script title: A1111 finds an alwayson script by title, in any case
# The preprocessors slotq runs, by the extension's module names ("None" too). Any other is refused:
# the unit would steer with the picture itself where the extension makes a map of it (a pose, a depth),
# another image rather than a near one; a client can send the map with module "none".
MODULES = {"none": "none", "canny": "canny"}
# The extension's older names for a unit's fields (its ext_compat_keys).
OLD_NAMES = {"input_image": "image", "lowvram": "low_vram", "guidance": "guidance_end",
             "guessmode": "guess_mode"}
# How the control image meets the job's shape. The pipeline stretches it ("Just Resize"); "Crop and
# Resize", the extension's default, crops it to the job's shape first (here); "Resize and Fill" is not
# applied, and listed where the shapes differ. The extension's older names and its numbers alike.
RESIZE_MODES: dict[str | int, str] = {
    "Just Resize": "resize", "Crop and Resize": "crop", "Resize and Fill": "fill",
    "Inner Fit (Scale to Fit)": "crop", "Scale to Fit (Inner Fit)": "crop",
    "Outer Fit (Shrink to Fit)": "fill", "Envelope (Outer Fit)": "fill", 0: "resize", 1: "crop", 2: "fill",
    3: "resize"}
# A unit's fields that change the image, accepted and not applied, with the values that leave them
# unset (None, "", [] and {} always do). Canny's only with module canny (its thresholds, threshold_a and
# threshold_b, are applied); hr_option only with a hires pass, in both of whose passes slotq's controls
# act ("Both").
NOT_APPLIED: dict[str, tuple[Any, ...]] = {"control_mode": ("Balanced", 0), "advanced_weighting": ()}
CANNY_NOT_APPLIED: dict[str, tuple[Any, ...]] = {"processor_res": (-1, 512), "pixel_perfect": (False,)}
HIRES_NOT_APPLIED: dict[str, tuple[Any, ...]] = {"hr_option": ("Both", 0)}


def add_controls(call: Call, settings: Settings) -> None:
    """Give the call's job a ControlNet for each enabled unit, and list any other alwayson script."""
    scripts = call.body.get("alwayson_scripts")
    if scripts in UNSET:
        return
    if not isinstance(scripts, dict):
        raise InvalidRequestError(details=[{"loc": ["alwayson_scripts"], "msg": "must be an object of "
                                            "scripts by name, each {\"args\": [...]}"}])
    units: list[tuple[int, dict[str, Any]]] = []
    for name, script in scripts.items():
        if name.lower() == SCRIPT:
            units = enabled_units(script)
        elif script not in UNSET and not (isinstance(script, dict) and script.get("args") in UNSET):
            call.not_applied.append(f"alwayson_scripts.{name}")
    if len(units) > MAX_CONTROLNETS:
        message = f"{len(units)} enabled units: a job runs at most {MAX_CONTROLNETS} ControlNets"
        raise InvalidRequestError(details=[{"loc": ["alwayson_scripts", SCRIPT, "args"], "msg": message}])
    if units:
        call.job["controlnets"] = [control(call, index, unit, settings) for index, unit in units]


def enabled_units(script: Any) -> list[tuple[int, dict[str, Any]]]:
    """The script's enabled units with their places in ``args``, each in the extension's current names."""
    args = script.get("args") if isinstance(script, dict) else None
    if args in UNSET:
        return []
    if not isinstance(args, list):
        raise InvalidRequestError(details=[{"loc": ["alwayson_scripts", SCRIPT, "args"], "msg": "must be a "
                                            "list of ControlNet units"}])
    units = [(index, {OLD_NAMES.get(str(key), str(key)): value for key, value in arg.items()})
             for index, arg in enumerate(args) if isinstance(arg, dict)]  # the extension skips the rest
    return [(index, unit) for index, unit in units if unit.get("enabled", True)]


def control(call: Call, index: int, unit: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """One unit as a slotq control, with what the extension writes of it in the infotext."""
    module = preprocessor(index, unit.get("module"))
    name = controlnet_named(unit.get("model"), call.model)
    scale, start, end = (value_of(unit, key, default) for key, default in
                         (("weight", 1.0), ("guidance_start", 0.0), ("guidance_end", 1.0)))
    image = control_image(call, index, unit, settings)
    call.not_applied += unapplied(call, index, unit, module)
    call.extra[f"ControlNet {index}"] = (f"Module: {module}, Model: {name}, Weight: {scale}, "
                                         f"Guidance Start: {start}, Guidance End: {end}")
    control = {"name": name, "image": image, "scale": scale, "start": start, "end": end, "preprocess": module}
    if module == "canny":  # the extension's thresholds: threshold_a low, threshold_b high
        control["low"] = threshold(unit.get("threshold_a"), 100)
        control["high"] = threshold(unit.get("threshold_b"), 200)
    return control


def threshold(value: Any, default: int) -> Any:
    """A canny threshold as the extension sends it: -1 or none for its default; 64.0 is 64."""
    if value is None or value == -1:
        return default
    return int(value) if isinstance(value, float) and value.is_integer() else value


def preprocessor(index: int, value: Any) -> str:
    """The slotq preprocessing a unit's ``module`` names, or a refusal naming those slotq runs."""
    module = MODULES.get("none" if value in UNSET else str(value).strip().lower())
    if module is None:
        raise InvalidRequestError(
            f"ControlNet module {str(value)[:80]!r} is not one slotq runs: it runs {', '.join(MODULES)}. "
            "Send the preprocessed image (its map) with module none.",
            details=[{"loc": unit_loc(index, "module"), "msg": f"must be one of {', '.join(MODULES)}"}])
    return module


def controlnet_named(value: Any, model: ModelInfo) -> str:
    """The ControlNet a unit's ``model`` means: one the model offers, by name or as ``name [hash]``."""
    if isinstance(value, str):
        for name in (value, value.split(" [", 1)[0]):
            if name in model.controlnets:
                return name
    offered = ", ".join(model.controlnets) or "none"
    raise UnknownControlNetError(f"No ControlNet model named {str(value)[:80]!r} for {model.name}; it has "
                                 f"{offered}.")


def value_of(unit: dict[str, Any], key: str, default: Any) -> Any:
    return default if unit.get(key) is None else unit[key]


def control_image(call: Call, index: int, unit: dict[str, Any], settings: Settings) -> str:
    """A unit's control image as a ``data:`` URL (img2img's start image where it has none); its mask
    and a "Resize and Fill" of another shape than the job's are listed as not applied."""
    image: Any = unit.get("image")
    mask: Any = unit.get("mask") or unit.get("mask_image")
    if isinstance(image, dict):
        image, mask = image.get("image"), image.get("mask") or mask
    if mask not in UNSET:
        call.not_applied.append(unit_label(index, "mask"))
    if image in UNSET:
        if call.img2img:
            return str(call.job["image"])  # as the extension takes img2img's image
        raise InvalidRequestError(details=[{"loc": unit_loc(index, "image"), "msg": "an enabled unit needs "
                                            "an image: base64, or {\"image\": base64, \"mask\": ...}"}])
    mode = resize_mode(index, unit.get("resize_mode"))
    url, reshaped = images.control_image(f"{SCRIPT} unit {index} image", image, first_pass_size(call),
                                         mode == "crop", settings)
    if reshaped and mode == "fill":
        call.not_applied.append(unit_label(index, "resize_mode"))
    return url


def resize_mode(index: int, value: Any) -> str:
    """How a unit's image meets the job's shape: ``resize``, ``crop`` (the default) or ``fill``."""
    if value in UNSET:
        return "crop"
    mode = RESIZE_MODES.get(value) if isinstance(value, str | int) and not isinstance(value, bool) else None
    if mode is None:
        message = "must be Just Resize, Crop and Resize or Resize and Fill (or 0, 1, 2)"
        raise InvalidRequestError(details=[{"loc": unit_loc(index, "resize_mode"), "msg": message}])
    return mode


def first_pass_size(call: Call) -> tuple[int, int] | None:
    """The size the job's first pass makes (img2img's: its start image's), where the body gives one
    that can be; None where it cannot (the job is refused for it)."""
    if call.size is not None:
        return call.size
    defaults = call.model.defaults
    size = (call.job.get("width", defaults.width), call.job.get("height", defaults.height))
    return size if all(type(side) is int and side > 0 for side in size) else None


def unapplied(call: Call, index: int, unit: dict[str, Any], module: str) -> list[str]:
    """The unit's fields that would change the image and are not applied, where set."""
    fields = NOT_APPLIED | (CANNY_NOT_APPLIED if module == "canny" else {}) | (
        HIRES_NOT_APPLIED if "hires" in call.job else {})
    return [unit_label(index, key) for key, unset in fields.items()
            if unit.get(key) not in UNSET and unit[key] not in unset]


def unit_loc(index: int, key: str) -> list[str | int]:
    return ["alwayson_scripts", SCRIPT, "args", index, key]


def unit_label(index: int, key: str) -> str:
    return f"alwayson_scripts.{SCRIPT}.args[{index}].{key}"
