"""ComfyUI API-format graphs as slotq jobs: ``translate`` maps one graph to one native job body, or
refuses it with a ``GraphError`` whose ``node_errors`` name the nodes at fault, in ComfyUI's shape.

A graph is read as ComfyUI runs it, from its outputs (SaveImage, PreviewImage) back through their links:
a node no output reaches is not run, though it must be of a class slotq knows. ``CLASSES`` declares each
class that maps, its inputs as ComfyUI declares them (``nodes.py`` lists them at ``/object_info``), and
a graph is checked against it as ComfyUI checks one (inputs present, links and their types, numbers in
bounds, choices in lists) before it is mapped:

- model: CheckpointLoaderSimple; for a Flux model, UNETLoader with DualCLIPLoader (type flux) and
  VAELoader, which stand for the model's own encoders and VAE (their stock files: clip_l, t5xxl*, ae).
  LoraLoader and LoraLoaderModelOnly chains become ``loras``: slotq gives an adapter one scale for
  its model and text-encoder weights, so a LoraLoader whose strengths differ is refused (and
  LoraLoaderModelOnly's adapter acts on the text encoder too, where its file has weights for it);
- prompts: CLIPTextEncode, positive or negative by the sampler input it feeds. FluxGuidance is a Flux
  model's ``guidance_scale`` (3.5 without one, ComfyUI's), the sampler's cfg any other's;
- sampling: KSampler; KSamplerAdvanced to its schedule's end (from a start step on an image);
  SamplerCustomAdvanced with RandomNoise, BasicGuider or CFGGuider, KSamplerSelect and BasicScheduler;
  ModelSamplingFlux at the shifts diffusers gives Flux (1.15 and 0.5 at the image's size). ``SAMPLERS``
  maps sampler_name and scheduler;
- latents: EmptyLatentImage, EmptySD3LatentImage (text-to-image); LoadImage into VAEEncode
  (image-to-image), with SetLatentNoiseMask or VAEEncodeForInpaint and a mask from LoadImageMask or
  LoadImage (inpainting); LatentUpscale or LatentUpscaleBy into a second sampler (``hires``);
- ControlNetLoader with ControlNetApply or ControlNetApplyAdvanced (``controlnets``).

Anything else is refused, naming its node: another class, a second model, a sampler apart from the
one whose images the outputs show (but a hires pass's first), a value slotq would run otherwise.

Seeds: ComfyUI's run from 0 to 2**64-1, slotq's to 2**32-1. A seed below 2**32 is the job's; a larger
one runs as ``seed % 2**32``, its low 32 bits (Open WebUI sends seeds up to 2**50).

Steps: a sampler with denoise d < 1 runs its ``steps`` as the last of a schedule of ``int(steps / d)``
(ComfyUI's rule); the job (or its hires pass) takes that schedule as ``steps`` and, as ``strength``
(``denoise``), the share of it that runs ComfyUI's steps exactly under diffusers' rounding: steps /
int(steps / d), within one step of d. KSamplerAdvanced from start_at_step k of n: the share (n-k)/n.

Prompt weights: ComfyUI reads ``(words:1.2)`` as that weight, ``(words)`` as x1.1 (an explicit weight
inside brackets replaces theirs), and ``\\(`` as a bracket. A graph whose prompts weigh any words
sends both prompts in slotq's weighted syntax (``prompt_syntax: weighted``), each run of text at
ComfyUI's weight; one that weighs none sends plain text, so a plain graph makes the plain job. slotq's
weighted prompts are compel's (``worker/prompts.py``): a weight above 1 acts as ComfyUI's, one below
1 fades the words by masking them, and a prompt over 75 tokens is split at phrase ends.

Not ComfyUI's, by design: the noise (slotq draws it from the job's seed, and its hires pass from the
same), and Flux's shift where no ModelSamplingFlux is given (ComfyUI's fixed 1.15, diffusers' by the
image's size: equal at 1024x1024).
"""

from __future__ import annotations

import base64
import io
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from PIL import Image, ImageChops, ImageFilter, ImageOps

from api.compat.a1111 import images
from shared.contract.adapters import MAX_LORAS
from shared.contract.errors import InvalidImageError
from shared.contract.jobs import MAX_CONTROLNETS, MAX_IMAGES, MIN_SIDE, output_size
from shared.contract.models import FLOW_SCHEDULERS, ModelInfo, Scheduler
from shared.contract.settings import Settings

# ComfyUI's pairs of sampler_name and scheduler that slotq's samplers run, each as the first of its
# samplers that the job's model takes (ModelInfo.schedulers): Euler is a flow model's own Euler there.
# ComfyUI's "normal" and "simple" space the steps evenly in time, as diffusers' schedulers do for the
# models' own configs; "karras" and "ddim_uniform" are their namesakes. ComfyUI's "ddim" is Euler's
# deterministic step, which DDIM is; diffusers' UniPC is the bh2 variant (ComfyUI's "uni_pc" is bh1,
# which slotq does not run). Any other pair, or one the model does not run, is refused.
SAMPLERS: dict[tuple[str, str], tuple[Scheduler, ...]] = {
    ("euler", "normal"): ("euler", "flow_euler"),
    ("euler", "simple"): ("euler", "flow_euler"),
    ("euler_ancestral", "normal"): ("euler_a",),
    ("dpmpp_2m", "normal"): ("dpmpp_2m",),
    ("dpmpp_2m", "karras"): ("dpmpp_2m_karras",),
    ("ddim", "ddim_uniform"): ("ddim",),
    ("ddim", "normal"): ("ddim",),
    ("uni_pc_bh2", "normal"): ("unipc",),
}
SAMPLER_NAMES = tuple(dict.fromkeys(name for name, _ in SAMPLERS))  # in ComfyUI's order
SCHEDULER_NAMES = tuple(dict.fromkeys(schedule for _, schedule in SAMPLERS))

MAX_COMFY_SEED = 2**64 - 1  # ComfyUI's seeds: 0 .. 2**64 - 1
SEED_MODULUS = 2**32  # slotq's: 0 .. 2**32 - 1 (shared.contract.jobs.MAX_SEED)
MAX_RESOLUTION = 16384  # ComfyUI's bound on a size input
MAX_PROMPT = 2000  # JobRequest's bounds: a prompt's characters, guidance, a LoRA's or ControlNet's scale
MAX_GUIDANCE = 30.0
MAX_SCALE = 2.0
# Bounds on what is read at all. No stock graph comes near them: ComfyUI's reading of brackets costs
# their depth times the text's length, and a graph's checks its nodes times its outputs.
MAX_NODES = 1000
MAX_TEXT = 4 * MAX_PROMPT  # a CLIPTextEncode's text, its syntax included
MAX_NESTING = 32
FLUX_GUIDANCE = 3.5  # what ComfyUI guides a Flux model by without FluxGuidance
FLUX_SHIFTS = {"max_shift": 1.15, "base_shift": 0.5}  # diffusers' FluxPipeline shifts, as ModelSamplingFlux's
FULL_DENOISE = 0.9999  # KSampler runs a whole schedule above this denoise (comfy/samplers.py)
# The stock file names (lower case, no folder or extension) that stand for a Flux model's own encoders
# (T5 in any of ComfyUI's precisions) and VAE.
FLUX_ENCODERS = ("clip_l", "t5xxl")
FLUX_VAE = "ae"
MODEL_EXTENSIONS = (".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".sft", ".gguf")
DIGITS = re.compile(r"[0-9]{1,18}")  # a node id ComfyUI's UI numbers
ANNOTATION = re.compile(r"\s*\[(input|output|temp)\]$")  # ComfyUI's "name.png [input]": where the file is
WIDGETS = ("INT", "FLOAT", "STRING", "COMBO")


@dataclass(frozen=True)
class Input:
    """One input of a node class as ComfyUI declares it: a link of ``type`` ("MODEL", "LATENT"...) or a
    widget ("INT", "FLOAT", "STRING", "COMBO") with its options (default, min, max, ...) and a combo's
    ``choices``, fixed or, where ``source`` names one, the service's (checkpoints, LoRAs...)."""

    type: str
    options: Mapping[str, Any] = field(default_factory=dict)
    choices: tuple[str, ...] = ()
    source: str = ""
    optional: bool = False


@dataclass(frozen=True)
class NodeClass:
    """A node class slotq maps: its inputs in ComfyUI's order and the types of its outputs."""

    inputs: dict[str, Input]
    outputs: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()  # where ComfyUI names its outputs apart from their types


def _int(default: int, low: int, high: int, **more: Any) -> Input:
    return Input("INT", {"default": default, "min": low, "max": high, **more})


def _float(default: float, low: float, high: float, step: float, **more: Any) -> Input:
    return Input("FLOAT", {"default": default, "min": low, "max": high, "step": step, **more})


def _combo(*choices: str, source: str = "", **options: Any) -> Input:
    return Input("COMBO", options, choices, source)


MODEL, CLIP, VAE, LATENT = Input("MODEL"), Input("CLIP"), Input("VAE"), Input("LATENT")
CONDITIONING, IMAGE, MASK = Input("CONDITIONING"), Input("IMAGE"), Input("MASK")
SEED = _int(0, 0, MAX_COMFY_SEED)
STEPS = _int(20, 1, 10000)
CFG = _float(8.0, 0.0, MAX_GUIDANCE, 0.1, round=0.01)
DENOISE = _float(1.0, 0.0, 1.0, 0.01)
STRENGTH = _float(1.0, -MAX_SCALE, MAX_SCALE, 0.01)  # a LoRA's
SIDE, SD3_SIDE = _int(512, MIN_SIDE, MAX_RESOLUTION, step=8), _int(1024, MIN_SIDE, MAX_RESOLUTION, step=16)
BATCH = _int(1, 1, MAX_IMAGES)
UPLOAD = _combo(source="images", image_upload=True)

# Every class slotq maps, as ComfyUI declares it, but for bounds and choices narrowed to what slotq runs.
CLASSES: dict[str, NodeClass] = {
    "CheckpointLoaderSimple": NodeClass({"ckpt_name": _combo(source="checkpoints")},
                                        ("MODEL", "CLIP", "VAE")),
    "UNETLoader": NodeClass({"unet_name": _combo(source="unets"), "weight_dtype": _combo("default")},
                            ("MODEL",)),
    "DualCLIPLoader": NodeClass({"clip_name1": _combo(source="encoders"),
                                 "clip_name2": _combo(source="encoders"), "type": _combo("flux")}, ("CLIP",)),
    "VAELoader": NodeClass({"vae_name": _combo(source="vaes")}, ("VAE",)),
    "LoraLoader": NodeClass({"model": MODEL, "clip": CLIP, "lora_name": _combo(source="loras"),
                             "strength_model": STRENGTH, "strength_clip": STRENGTH}, ("MODEL", "CLIP")),
    "LoraLoaderModelOnly": NodeClass({"model": MODEL, "lora_name": _combo(source="loras"),
                                      "strength_model": STRENGTH}, ("MODEL",)),
    "CLIPSetLastLayer": NodeClass({"clip": CLIP, "stop_at_clip_layer": _int(-1, -1, -1, step=1)}, ("CLIP",)),
    "ModelSamplingFlux": NodeClass({"model": MODEL, "max_shift": _float(1.15, 0.0, 100.0, 0.01),
                                    "base_shift": _float(0.5, 0.0, 100.0, 0.01),
                                    "width": _int(1024, 16, MAX_RESOLUTION, step=8),
                                    "height": _int(1024, 16, MAX_RESOLUTION, step=8)}, ("MODEL",)),
    "CLIPTextEncode": NodeClass({"text": Input("STRING", {"multiline": True, "dynamicPrompts": True}),
                                 "clip": CLIP}, ("CONDITIONING",)),
    "FluxGuidance": NodeClass({"conditioning": CONDITIONING, "guidance": _float(3.5, 0.0, MAX_GUIDANCE, 0.1)},
                              ("CONDITIONING",)),
    "ControlNetLoader": NodeClass({"control_net_name": _combo(source="controlnets")}, ("CONTROL_NET",)),
    "ControlNetApply": NodeClass({"conditioning": CONDITIONING, "control_net": Input("CONTROL_NET"),
                                  "image": IMAGE, "strength": _float(1.0, 0.0, MAX_SCALE, 0.01)},
                                 ("CONDITIONING",)),
    "ControlNetApplyAdvanced": NodeClass(
        {"positive": CONDITIONING, "negative": CONDITIONING, "control_net": Input("CONTROL_NET"),
         "image": IMAGE, "strength": _float(1.0, 0.0, MAX_SCALE, 0.01),
         "start_percent": _float(0.0, 0.0, 1.0, 0.001), "end_percent": _float(1.0, 0.0, 1.0, 0.001),
         "vae": Input("VAE", optional=True)},
        ("CONDITIONING", "CONDITIONING"), ("positive", "negative")),
    "EmptyLatentImage": NodeClass({"width": SIDE, "height": SIDE, "batch_size": BATCH}, ("LATENT",)),
    "EmptySD3LatentImage": NodeClass({"width": SD3_SIDE, "height": SD3_SIDE, "batch_size": BATCH},
                                     ("LATENT",)),
    "LoadImage": NodeClass({"image": UPLOAD}, ("IMAGE", "MASK")),
    "LoadImageMask": NodeClass({"image": UPLOAD, "channel": _combo("alpha", "red", "green", "blue")},
                               ("MASK",)),
    "VAEEncode": NodeClass({"pixels": IMAGE, "vae": VAE}, ("LATENT",)),
    "VAEEncodeForInpaint": NodeClass({"pixels": IMAGE, "vae": VAE, "mask": MASK,
                                      "grow_mask_by": _int(6, 0, 64, step=1)}, ("LATENT",)),
    "SetLatentNoiseMask": NodeClass({"samples": LATENT, "mask": MASK}, ("LATENT",)),
    "LatentUpscale": NodeClass({"samples": LATENT, "upscale_method": _combo("bilinear"),
                                "width": _int(512, 0, MAX_RESOLUTION, step=8),
                                "height": _int(512, 0, MAX_RESOLUTION, step=8), "crop": _combo("disabled")},
                               ("LATENT",)),
    "LatentUpscaleBy": NodeClass({"samples": LATENT, "upscale_method": _combo("bilinear"),
                                  "scale_by": _float(1.5, 0.01, 8.0, 0.01)}, ("LATENT",)),
    "KSampler": NodeClass({"model": MODEL, "seed": SEED, "steps": STEPS, "cfg": CFG,
                           "sampler_name": _combo(*SAMPLER_NAMES), "scheduler": _combo(*SCHEDULER_NAMES),
                           "positive": CONDITIONING, "negative": CONDITIONING, "latent_image": LATENT,
                           "denoise": DENOISE}, ("LATENT",)),
    "KSamplerAdvanced": NodeClass({"model": MODEL, "add_noise": _combo("enable"), "noise_seed": SEED,
                                   "steps": STEPS, "cfg": CFG, "sampler_name": _combo(*SAMPLER_NAMES),
                                   "scheduler": _combo(*SCHEDULER_NAMES), "positive": CONDITIONING,
                                   "negative": CONDITIONING, "latent_image": LATENT,
                                   "start_at_step": _int(0, 0, 10000), "end_at_step": _int(10000, 0, 10000),
                                   "return_with_leftover_noise": _combo("disable")}, ("LATENT",)),
    "RandomNoise": NodeClass({"noise_seed": _int(0, 0, MAX_COMFY_SEED, control_after_generate=True)},
                             ("NOISE",)),
    "BasicGuider": NodeClass({"model": MODEL, "conditioning": CONDITIONING}, ("GUIDER",)),
    "CFGGuider": NodeClass({"model": MODEL, "positive": CONDITIONING, "negative": CONDITIONING, "cfg": CFG},
                           ("GUIDER",)),
    "KSamplerSelect": NodeClass({"sampler_name": _combo(*SAMPLER_NAMES)}, ("SAMPLER",)),
    "BasicScheduler": NodeClass({"model": MODEL, "scheduler": _combo(*SCHEDULER_NAMES), "steps": STEPS,
                                 "denoise": DENOISE}, ("SIGMAS",)),
    "SamplerCustomAdvanced": NodeClass({"noise": Input("NOISE"), "guider": Input("GUIDER"),
                                        "sampler": Input("SAMPLER"), "sigmas": Input("SIGMAS"),
                                        "latent_image": LATENT},
                                       ("LATENT", "LATENT"), ("output", "denoised_output")),
    "VAEDecode": NodeClass({"samples": LATENT, "vae": VAE}, ("IMAGE",)),
    "SaveImage": NodeClass({"images": IMAGE, "filename_prefix": Input("STRING", {"default": "ComfyUI"})}),
    "PreviewImage": NodeClass({"images": IMAGE}),
}
OUTPUTS = {"SaveImage": "output", "PreviewImage": "temp"}  # the output classes and their images' type
PREVIEW_PREFIX = "ComfyUI_temp"
SAMPLER_CLASSES = ("KSampler", "KSamplerAdvanced", "SamplerCustomAdvanced")
LOADERS = ("CheckpointLoaderSimple", "UNETLoader")
LORA_LOADERS = ("LoraLoader", "LoraLoaderModelOnly")
UPSCALES = ("LatentUpscale", "LatentUpscaleBy")
EMPTY_LATENTS = ("EmptyLatentImage", "EmptySD3LatentImage")
ENCODES = ("VAEEncode", "SetLatentNoiseMask", "VAEEncodeForInpaint")


# --- the interface -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Output:
    """One SaveImage or PreviewImage node the graph ends in."""

    node: str
    class_type: str
    filename_prefix: str  # SaveImage's filename_prefix; PreviewImage's "ComfyUI_temp"
    type: str  # "output" for SaveImage, "temp" for PreviewImage


@dataclass(frozen=True)
class Mapped:
    """A graph as one job: its native body, the nodes it runs, the sampler that counts its progress, and
    its outputs."""

    body: dict[str, Any]
    order: list[str]  # the nodes the outputs reach, each after the nodes it reads
    sampler: str  # the first sampler: the job's progress reports its steps
    outputs: list[Output]  # in node-id order


class GraphError(Exception):
    """A graph slotq cannot run: ComfyUI's envelope data."""

    def __init__(self, message: str, node_errors: dict[str, dict[str, Any]],
                 type: str = "prompt_outputs_failed_validation", details: str | None = None) -> None:
        self.message, self.node_errors, self.type = message, node_errors, type
        self.details = summary(node_errors) if details is None else details
        super().__init__(f"{message}: {self.details}" if self.details else message)

    def envelope(self) -> dict[str, Any]:
        """What ComfyUI answers a refused ``POST /prompt`` with (status 400)."""
        error = {"type": self.type, "message": self.message, "details": self.details, "extra_info": {}}
        return {"error": error, "node_errors": self.node_errors}


def summary(node_errors: Mapping[str, Mapping[str, Any]]) -> str:
    """The node errors as lines, "<class> <id>: <message>: <details>", as ComfyUI's details list them."""
    return "\n".join(f"{entry['class_type']} {node}: {error['message']}: {error['details']}"
                     for node, entry in node_errors.items() for error in entry["errors"])


def translate(graph: Any, models: Sequence[ModelInfo], uploads: Callable[[str], bytes | None],
              settings: Settings) -> Mapped:
    """The job a ComfyUI API-format graph makes, on one of ``models``, its LoadImage nodes read with
    ``uploads``; ``GraphError`` for any graph slotq cannot run as ComfyUI would."""
    nodes, problems = parsed(graph)
    outputs = sorted((node.id for node in nodes.values() if node.type in OUTPUTS), key=id_order)
    if not outputs:
        raise GraphError("Prompt has no outputs", {}, "prompt_no_outputs", "")
    order = checked_order(nodes, outputs, problems)
    problems.check()
    reader = Reader(nodes, problems, models, uploads, settings)
    body, sampler = reader.job(outputs, order)
    return Mapped(body, order, sampler, [output_of(nodes[node]) for node in outputs])


def output_of(node: Node) -> Output:
    """An output node as the interface names it."""
    prefix = node.inputs["filename_prefix"] if node.type == "SaveImage" else PREVIEW_PREFIX
    return Output(node.id, node.type, prefix, OUTPUTS[node.type])


# --- reading a graph: its nodes, their inputs and links ----------------------------------------------

@dataclass(frozen=True)
class Link:
    """An input linked to another node's output."""

    node: str
    index: int


@dataclass
class Node:
    """A node as sent (``raw`` inputs) and, once checked, its inputs: values converted, links as ``Link``."""

    id: str
    type: str
    raw: dict[str, Any]
    inputs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Param:
    """A node's input that the job reads, so that a refusal names where it is."""

    node: Node
    name: str

    @property
    def value(self) -> Any:
        return self.node.inputs[self.name]


class Problems:
    """The node errors found so far, in ComfyUI's shape, with each node's class and the outputs it feeds."""

    def __init__(self, classes: Mapping[str, str], dependents: Mapping[str, list[str]]) -> None:
        self.classes, self.dependents = classes, dependents
        self.errors: dict[str, list[dict[str, Any]]] = {}

    def add(self, node: str, type: str, message: str, details: str, **extra: Any) -> None:
        """One error of a node (once: a node read twice is not reported twice)."""
        error = {"type": type, "message": message, "details": details, "extra_info": extra}
        if error not in self.errors.setdefault(node, []):
            self.errors[node].append(error)

    def refusal(self, message: str = "Prompt outputs failed validation",
                type: str = "prompt_outputs_failed_validation") -> GraphError:
        """The graph's refusal, naming every node with an error."""
        node_errors = {node: {"errors": self.errors[node], "dependent_outputs": self.dependents.get(node, []),
                              "class_type": self.classes.get(node, "")}
                       for node in sorted(self.errors, key=id_order)}
        return GraphError(message, node_errors, type)

    def fail(self, param: Param | Node, type: str, message: str, details: str) -> GraphError:
        """A refusal for this error, with those found before it; for a value, naming its input."""
        if isinstance(param, Param):
            self.add(param.node.id, type, message, details, input_name=param.name,
                     received_value=param.node.raw.get(param.name))
        else:
            self.add(param.id, type, message, details)
        return self.refusal()

    def check(self) -> None:
        """Refuse the graph if any error was found."""
        if self.errors:
            raise self.refusal()


def id_order(node: str) -> tuple[int, int, str]:
    """Node ids in ComfyUI's order: numbers by value ("9" before "10"), then any others."""
    return (0, int(node), node) if DIGITS.fullmatch(node) else (1, 0, node)


def parsed(graph: Any) -> tuple[dict[str, Node], Problems]:
    """The graph's nodes by id, each of a class slotq maps; else the refusal ComfyUI gives a prompt it
    cannot read (``invalid_prompt``)."""
    if not isinstance(graph, dict):
        raise GraphError("Cannot execute because the prompt is not an object of nodes by id", {},
                         "invalid_prompt", f"got {type(graph).__name__}")
    if len(graph) > MAX_NODES:
        raise GraphError(f"Cannot execute a prompt of more than {MAX_NODES} nodes", {}, "invalid_prompt",
                         f"it has {len(graph)}")
    classes = {str(key): raw["class_type"] for key, raw in graph.items()
               if isinstance(raw, dict) and isinstance(raw.get("class_type"), str)}
    problems = Problems(classes, dependents(graph))
    nodes: dict[str, Node] = {}
    for key, raw in graph.items():
        node = parsed_node(key, raw, problems)
        if node is not None:
            nodes[node.id] = node
    if problems.errors:
        first = next(iter(problems.errors.values()))[0]["message"]
        raise problems.refusal(first, "invalid_prompt")
    return nodes, problems


def parsed_node(key: Any, raw: Any, problems: Problems) -> Node | None:
    """One node, or None with its error noted: not ``{class_type, inputs}``, or of a class slotq lacks."""
    node_id = str(key)
    if not isinstance(key, str) or not isinstance(raw, dict) or not isinstance(raw.get("class_type"), str):
        problems.add(node_id, "invalid_prompt", "Cannot execute because a node is missing the class_type "
                     "property.", f"Node ID '#{node_id}'")
    elif raw["class_type"] not in CLASSES:
        problems.add(node_id, "node_not_supported", f"Cannot execute because node {raw['class_type']} is not "
                     "supported by slotq.", f"Node ID '#{node_id}': slotq runs {', '.join(CLASSES)}")
    elif not isinstance(raw.get("inputs", {}), dict):
        problems.add(node_id, "invalid_prompt", "Cannot execute because a node's inputs are not an object.",
                     f"Node ID '#{node_id}'")
    else:
        return Node(node_id, raw["class_type"], raw.get("inputs", {}))
    return None


def dependents(graph: dict[Any, Any]) -> dict[str, list[str]]:
    """Each node id and the outputs that reach it, read leniently (before the graph is checked)."""
    def links(node_id: str) -> list[str]:
        raw = graph.get(node_id)
        inputs = raw.get("inputs") if isinstance(raw, dict) else None
        values = inputs.values() if isinstance(inputs, dict) else ()
        return [value[0] for value in values if isinstance(value, list) and len(value) == 2
                and isinstance(value[0], str) and value[0] in graph]

    outputs = [key for key, raw in graph.items() if isinstance(key, str) and isinstance(raw, dict)
               and isinstance(raw.get("class_type"), str) and raw["class_type"] in OUTPUTS]
    reached: dict[str, list[str]] = {}
    for output in sorted(outputs, key=id_order):
        seen, pending = set(), [output]
        while pending:
            node = pending.pop()
            if node not in seen:
                seen.add(node)
                reached.setdefault(node, []).append(output)
                pending += links(node)
    return reached


def checked_order(nodes: dict[str, Node], outputs: list[str], problems: Problems) -> list[str]:
    """The nodes the outputs reach, each after those it reads (from each output in turn, inputs in
    ComfyUI's order), each node's inputs checked on the way; a cycle is noted."""
    order: list[str] = []
    done: set[str] = set()
    for output in outputs:
        if output in done:
            continue
        active = {output}
        stack = [(output, iter(checked_inputs(nodes[output], nodes, problems)))]
        while stack:
            node, sources = stack[-1]
            source = next(sources, None)
            if source is None:
                stack.pop()
                active.discard(node)
                done.add(node)
                order.append(node)
            elif source in active:
                problems.add(node, "dependency_cycle", "Dependency cycle detected",
                             f"{nodes[node].type} {node} reads {nodes[source].type} {source}, which reads it")
            elif source not in done:
                active.add(source)
                stack.append((source, iter(checked_inputs(nodes[source], nodes, problems))))
    return order


def checked_inputs(node: Node, nodes: Mapping[str, Node], problems: Problems) -> list[str]:
    """Check a node's inputs against its class, keeping the good ones in ``node.inputs``; the ids of the
    nodes its good links read, in its inputs' order."""
    sources = []
    for name, declared in CLASSES[node.type].inputs.items():
        if name not in node.raw:
            if not declared.optional:
                problems.add(node.id, "required_input_missing", "Required input is missing", name,
                             input_name=name)
            continue
        value = node.raw[name]
        checked = (checked_link(node, name, value, declared, nodes, problems) if isinstance(value, list)
                   else checked_value(node, name, value, declared, problems))
        if checked is not None:
            node.inputs[name] = checked
            if isinstance(checked, Link):
                sources.append(checked.node)
    return sources


def checked_link(node: Node, name: str, value: list[Any], declared: Input, nodes: Mapping[str, Node],
                 problems: Problems) -> Link | None:
    """A link, if it reads an existing output of the input's type; else None, its error noted."""
    extra = {"input_name": name, "received_value": value}
    if len(value) != 2 or not isinstance(value[0], str) or type(value[1]) is not int:
        problems.add(node.id, "bad_linked_input", "Bad linked input, must be a length-2 list of "
                     "[node_id, slot_index]", name, **extra)
        return None
    source = nodes.get(value[0])
    if source is None:
        problems.add(node.id, "bad_linked_input", f"Bad linked input: node {value[0]} does not exist", name,
                     **extra)
        return None
    outputs = CLASSES[source.type].outputs
    if not 0 <= value[1] < len(outputs):
        problems.add(node.id, "bad_linked_input",
                     f"Bad linked input: {source.type} {source.id} has no output {value[1]}", name, **extra)
        return None
    if outputs[value[1]] != declared.type:
        problems.add(node.id, "return_type_mismatch", "Return type mismatch between linked nodes",
                     f"{name}, received_type({outputs[value[1]]}) mismatch input_type({declared.type})",
                     **extra)
        return None
    return Link(source.id, value[1])


def checked_value(node: Node, name: str, value: Any, declared: Input, problems: Problems) -> Any:
    """A widget's value converted to its type and within its bounds and choices; else None, noted."""
    extra = {"input_name": name, "received_value": value}
    converted = converted_value(declared.type, value)
    if converted is None:
        problems.add(node.id, "invalid_input_type", f"Failed to convert an input value to a {declared.type} "
                     "value", f"{name}, {value!r}"[:200], **extra)
        return None
    low, high = declared.options.get("min"), declared.options.get("max")
    if low is not None and converted < low:
        problems.add(node.id, "value_smaller_than_min", f"Value {converted} smaller than min of {low}", name,
                     **extra)
    elif high is not None and converted > high:
        problems.add(node.id, "value_bigger_than_max", f"Value {converted} bigger than max of {high}", name,
                     **extra)
    elif declared.choices and converted not in declared.choices:
        problems.add(node.id, "value_not_in_list", "Value not in list",
                     f"{name}: '{converted}' not in {list(declared.choices)}"[:300], **extra)
    else:
        return converted
    return None


def converted_value(kind: str, value: Any) -> Any:
    """A JSON value as a widget of this kind takes it (an integral number as an INT, any finite number
    as a FLOAT, null as an empty STRING), or None."""
    if isinstance(value, bool) or kind not in WIDGETS:
        return None
    if kind == "STRING" and value is None:
        # Open WebUI writes null where its node map has a text it was not given (a negative prompt);
        # ComfyUI would run it as the text "None".
        return ""
    if kind in ("STRING", "COMBO"):
        return value if isinstance(value, str) else None
    if isinstance(value, int):
        return value if kind == "INT" else as_float(value)
    if isinstance(value, float) and math.isfinite(value):
        return int(value) if kind == "INT" and value.is_integer() else value if kind == "FLOAT" else None
    return None


def as_float(value: int) -> float | None:
    """An integer as a float, or None past a float's range."""
    try:
        return float(value)
    except OverflowError:
        return None


# --- mapping a checked graph ------------------------------------------------------------------------

@dataclass(frozen=True)
class Sampling:
    """A sampler as slotq reads it, whichever class it is: what it links to and the values it runs with."""

    node: Node
    models: tuple[Link, ...]  # every MODEL it reads: its own, or its guider's and its scheduler's
    positive: Link
    negative: Link | None  # None under a BasicGuider (no CFG)
    seed: Param
    steps: Param
    cfg: Param | None  # None under a BasicGuider: 1
    sampler: Param  # sampler_name
    schedule: Param  # scheduler
    denoise: Param | None  # None for KSamplerAdvanced
    start: Param | None  # KSamplerAdvanced's start_at_step


@dataclass(frozen=True)
class Conditioning:
    """A prompt as a sampler receives it: its text encoder, the FluxGuidance nearest the sampler, and
    the ControlNet nodes on the way (nearest the sampler first)."""

    encoder: Node
    guidance: Param | None
    controls: tuple[Node, ...]


class Reader:
    """Maps a checked graph to a job body, noting or raising its refusals."""

    def __init__(self, nodes: dict[str, Node], problems: Problems, models: Sequence[ModelInfo],
                 uploads: Callable[[str], bytes | None], settings: Settings) -> None:
        self.nodes, self.problems, self.models = nodes, problems, models
        self.uploads, self.settings = uploads, settings

    def source(self, node: Node, name: str) -> Node:
        """The node an input links to."""
        link: Link = node.inputs[name]
        return self.nodes[link.node]

    def job(self, outputs: list[str], order: list[str]) -> tuple[dict[str, Any], str]:
        """The job's body and its first sampler's id."""
        final = self.final_sampler(outputs)
        latent = self.source(final, "latent_image")
        first = self.source(latent, "samples") if latent.type in UPSCALES else None
        self.check_samplers(final, first, latent, set(order))
        passes = [self.sampling(node) for node in (first, final) if node is not None]
        model, lora_nodes = self.model(passes[0])
        self.check_loaders(order, model)
        sampled = self.sampled(passes[0], model, lora_nodes)
        body = dict(sampled)
        if first is None:
            body |= self.latent_fields(passes[0], model)
        else:
            body |= self.text_fields(passes[0], model)
            body["hires"] = self.hires(passes[0], passes[1], latent, model, sampled,
                                       (body["width"], body["height"]))
        self.check_shifts(order, model, (body["width"], body["height"]))
        body |= self.controlnets(passes[-1], model, (body["width"], body["height"]))
        self.problems.check()
        return body, passes[0].node.id

    # --- the samplers --------------------------------------------------------------------------------

    def final_sampler(self, outputs: list[str]) -> Node:
        """The sampler whose images every output shows."""
        found: Node | None = None
        for output in outputs:
            decode = self.source(self.nodes[output], "images")
            if decode.type != "VAEDecode":
                raise self.problems.fail(self.nodes[output], "graph_not_supported", "Output not supported",
                                         f"it shows {decode.type} {decode.id}'s image: a slotq job's outputs "
                                         "are the images its sampler made (through VAEDecode)")
            sampler = self.source(decode, "samples")
            if sampler.type not in SAMPLER_CLASSES:
                raise self.problems.fail(decode, "graph_not_supported", "Latent not supported",
                                         f"it decodes {sampler.type} {sampler.id}'s latent, which no sampler "
                                         "made: slotq decodes the images a sampler made")
            if found is not None and sampler.id != found.id:
                raise self.problems.fail(self.nodes[output], "graph_not_supported", "Two samplers' outputs",
                                         f"it shows {sampler.type} {sampler.id}'s images, another output "
                                         f"{found.type} {found.id}'s: a slotq job makes one set of images")
            found = sampler
        assert found is not None  # there is an output
        return found

    def check_samplers(self, final: Node, first: Node | None, latent: Node, reached: set[str]) -> None:
        """Refuse a graph with other samplers than its final one and (for a hires pass) its first, whether
        an output reaches them or not."""
        if first is not None and first.type not in SAMPLER_CLASSES:
            raise self.problems.fail(latent, "graph_not_supported", "Upscale not supported",
                                     f"it upscales {first.type} {first.id}'s latent: slotq's hires pass "
                                     "upscales a text-to-image sampler's")
        if first is not None and self.source(first, "latent_image").type not in EMPTY_LATENTS:
            raise self.problems.fail(first, "graph_not_supported", "Hires pass not supported",
                                     "slotq's hires pass follows a text-to-image pass (an empty latent)")
        kept = {final.id, first.id if first is not None else final.id}
        for node in self.nodes.values():
            if node.type in SAMPLER_CLASSES and node.id not in kept:
                where = "feeds no output" if node.id not in reached else "is a third sampler"
                raise self.problems.fail(node, "graph_not_supported", "Sampler not supported",
                                         f"it {where}: a slotq job runs one sampler (two for a hires pass), "
                                         f"here {final.type} {final.id}, whose images the outputs show")

    def sampling(self, node: Node) -> Sampling:
        """A sampler node as slotq reads it."""
        if node.type == "SamplerCustomAdvanced":
            return self.custom_sampling(node)
        advanced = node.type == "KSamplerAdvanced"
        if advanced and node.inputs["end_at_step"] < node.inputs["steps"]:
            raise self.problems.fail(Param(node, "end_at_step"), "value_not_supported", "Value not supported",
                                     "end_at_step: slotq runs a schedule to its end, so end_at_step must "
                                     f"be at least steps ({node.inputs['steps']})")
        return Sampling(node, (node.inputs["model"],), node.inputs["positive"], node.inputs["negative"],
                        Param(node, "noise_seed" if advanced else "seed"), Param(node, "steps"),
                        Param(node, "cfg"), Param(node, "sampler_name"), Param(node, "scheduler"),
                        None if advanced else Param(node, "denoise"),
                        Param(node, "start_at_step") if advanced else None)

    def custom_sampling(self, node: Node) -> Sampling:
        """A SamplerCustomAdvanced and the nodes it reads (the only ones slotq maps of their types:
        RandomNoise, BasicGuider or CFGGuider, KSamplerSelect, BasicScheduler)."""
        noise, guider = self.source(node, "noise"), self.source(node, "guider")
        chooser, sigmas = self.source(node, "sampler"), self.source(node, "sigmas")
        basic = guider.type == "BasicGuider"
        return Sampling(node, (guider.inputs["model"], sigmas.inputs["model"]),
                        guider.inputs["conditioning" if basic else "positive"],
                        None if basic else guider.inputs["negative"], Param(noise, "noise_seed"),
                        Param(sigmas, "steps"), None if basic else Param(guider, "cfg"),
                        Param(chooser, "sampler_name"), Param(sigmas, "scheduler"), Param(sigmas, "denoise"),
                        None)

    def schedule(self, sampling: Sampling) -> tuple[int, float]:
        """The job's steps for this sampler and the share of them it runs (1.0: all), as ComfyUI runs it."""
        steps = sampling.steps.value
        if sampling.start is not None:
            start = sampling.start.value
            if start >= steps:
                raise self.problems.fail(sampling.start, "value_not_supported", "Value not supported",
                                         f"start_at_step: {start} runs no step of {steps}")
            return self.bounded_steps(sampling.steps, steps), share(steps - start, steps)
        assert sampling.denoise is not None
        denoise = sampling.denoise.value
        if denoise <= 0:
            raise self.problems.fail(sampling.denoise, "value_not_supported", "Value not supported",
                                     "denoise: 0 runs no step; slotq's strength is above 0")
        if sampling.node.type == "KSampler" and denoise > FULL_DENOISE:
            return self.bounded_steps(sampling.steps, steps), 1.0
        total = steps / denoise
        if total >= self.settings.max_steps + 1:
            raise self.problems.fail(sampling.steps, "value_bigger_than_max", "Value not supported",
                                     f"steps: {steps} at denoise {denoise} make a schedule of {int(total)} "
                                     f"steps; this service runs at most {self.settings.max_steps}")
        return int(total), share(steps, int(total))

    def bounded_steps(self, param: Param, steps: int) -> int:
        """Steps within the service's SLOTQ_MAX_STEPS."""
        if steps > self.settings.max_steps:
            raise self.problems.fail(param, "value_bigger_than_max",
                                     f"Value {steps} bigger than max of {self.settings.max_steps}",
                                     f"{param.name}: this service runs at most {self.settings.max_steps} "
                                     "steps")
        return steps

    def scheduler(self, sampling: Sampling, model: ModelInfo) -> Scheduler:
        """The slotq sampler for the sampler's sampler_name and scheduler (``SAMPLERS``), on this model."""
        pair = (sampling.sampler.value, sampling.schedule.value)
        runs = SAMPLERS.get(pair)
        pairs = ", ".join(f"{name}/{schedule}" for (name, schedule), each in SAMPLERS.items()
                          if set(each) & set(model.schedulers))
        if runs is None:
            raise self.problems.fail(sampling.sampler, "value_not_supported", "Sampler not supported",
                                     f"sampler_name '{pair[0]}' with scheduler '{pair[1]}' has no "
                                     f"equivalent in slotq; it runs {pairs}")
        usable = [each for each in runs if each in model.schedulers]
        if not usable:
            raise self.problems.fail(sampling.sampler, "value_not_supported", "Sampler not supported",
                                     f"a {model.family} model does not run sampler_name '{pair[0]}' with "
                                     f"scheduler '{pair[1]}'; it runs {pairs}")
        return usable[0]

    def sampled(self, sampling: Sampling, model: ModelInfo, lora_nodes: list[Node]) -> dict[str, Any]:
        """What the job takes of a sampler: prompts, guidance, seed, sampler and LoRAs."""
        positive = self.conditioning(sampling.positive)
        negative = None if sampling.negative is None or flow(model) else self.conditioning(sampling.negative)
        self.check_clips(lora_nodes, [each.encoder for each in (positive, negative) if each is not None])
        body = self.prompts(positive.encoder, negative.encoder if negative is not None else None)
        body |= {"model": model.name, "guidance_scale": self.guidance(sampling, model, positive),
                 "seed": sampling.seed.value % SEED_MODULUS, "scheduler": self.scheduler(sampling, model)}
        loras = self.loras(model, lora_nodes)
        if loras:
            body["loras"] = loras
        return body

    def guidance(self, sampling: Sampling, model: ModelInfo, positive: Conditioning) -> float:
        """The job's guidance_scale: a Flux model's FluxGuidance (it runs without CFG), any other's cfg."""
        if not flow(model):
            return float(sampling.cfg.value) if sampling.cfg is not None else 1.0
        if sampling.cfg is not None and sampling.cfg.value != 1:
            raise self.problems.fail(sampling.cfg, "value_not_supported", "Value not supported",
                                     f"cfg: a {model.family} model runs without CFG here: set cfg to 1, "
                                     "and its guidance with FluxGuidance")
        return float(positive.guidance.value) if positive.guidance is not None else FLUX_GUIDANCE

    # --- the model, its LoRAs and encoders -----------------------------------------------------------

    def model(self, sampling: Sampling) -> tuple[ModelInfo, list[Node]]:
        """The model the sampler runs and the LoRA loaders on its way, every MODEL it reads alike."""
        chains = [self.model_chain(link) for link in sampling.models]
        loader, lora_nodes = chains[0]
        for link, (_, other_loras) in zip(sampling.models[1:], chains[1:], strict=True):
            if [node.id for node in other_loras] != [node.id for node in lora_nodes]:
                raise self.problems.fail(self.nodes[link.node], "graph_not_supported", "Models differ",
                                         f"{sampling.node.type} {sampling.node.id}'s guider and scheduler "
                                         "read different LoRAs: slotq runs one model")
        return self.served(loader), lora_nodes

    def model_chain(self, link: Link) -> tuple[Node, list[Node]]:
        """The loader a MODEL link comes from and the LoRA loaders on the way, the loader's first."""
        node, loras = self.nodes[link.node], []
        while node.type not in LOADERS:
            if node.type in LORA_LOADERS:
                loras.append(node)
            node = self.source(node, "model")
        return node, loras[::-1]

    def clip_chain(self, link: Link) -> list[Node]:
        """The LoraLoaders a CLIP link passes through (to its loader, checked apart)."""
        node, loras = self.nodes[link.node], []
        while node.type in ("LoraLoader", "CLIPSetLastLayer"):  # stop_at_clip_layer is -1: the model's own
            if node.type == "LoraLoader":
                loras.append(node)
            node = self.source(node, "clip")
        return loras

    def served(self, loader: Node) -> ModelInfo:
        """The model a loader names: by its name, with or without a file's extension."""
        name = "ckpt_name" if loader.type == "CheckpointLoaderSimple" else "unet_name"
        value = loader.inputs[name]
        offered = [model for model in self.models
                   if loader.type == "CheckpointLoaderSimple" or model.spec.single_file == "transformer"]
        for model in offered:
            if value == model.name or without_extension(value) == model.name:
                return model
        files = [f"{model.name}.safetensors" for model in offered]
        raise self.problems.fail(Param(loader, name), "value_not_in_list", "Value not in list",
                                 f"{name}: '{value}' not in {files}")

    def check_loaders(self, order: list[str], model: ModelInfo) -> None:
        """Refuse a graph whose loaders name other models than its sampler's, or that load encoders or a
        VAE that are not that model's own."""
        for node in (self.nodes[each] for each in order):
            loaded = self.served(node).name if node.type in LOADERS else model.name
            if loaded != model.name:
                raise self.problems.fail(node, "graph_not_supported", "Two different checkpoints",
                                         f"it loads {loaded}, the sampler runs {model.name}: a slotq job "
                                         "runs one model")
            if node.type == "DualCLIPLoader":
                self.check_stock(node, model, model.spec.text_encoders == "t5_clip",
                                 ("clip_name1", "clip_name2"), FLUX_ENCODERS)
            elif node.type == "VAELoader":
                self.check_stock(node, model, model.spec.latent_format == "flux", ("vae_name",), (FLUX_VAE,))

    def check_stock(self, node: Node, model: ModelInfo, fits: bool, names: tuple[str, ...],
                    stock: tuple[str, ...]) -> None:
        """A DualCLIPLoader or VAELoader stands for a Flux model's own encoders or VAE, named as stock."""
        if not fits:
            raise self.problems.fail(node, "graph_not_supported", "Loader not supported",
                                     f"a {model.family} model's encoders and VAE come with it: load them "
                                     "with CheckpointLoaderSimple")
        found = [stem(node.inputs[name]) for name in names]  # T5's in any precision: "t5xxl_fp8_e4m3fn"
        if not all(any(each == file or each.startswith(f"{file}_fp") for each in found) for file in stock):
            raise self.problems.fail(Param(node, names[0]), "value_not_in_list", "Value not in list",
                                     f"{', '.join(names)}: {model.name}'s own are {', '.join(stock)} "
                                     "(.safetensors): slotq loads no other")

    def check_shifts(self, order: list[str], model: ModelInfo, size: tuple[int, int]) -> None:
        """ModelSamplingFlux: only as diffusers shifts a Flux model's schedule, at the job's size."""
        for node in (self.nodes[each] for each in order if self.nodes[each].type == "ModelSamplingFlux"):
            wanted = FLUX_SHIFTS | {"width": size[0], "height": size[1]}
            odd = [name for name, value in wanted.items() if node.inputs[name] != value]
            if odd or not flow(model):
                raise self.problems.fail(node, "value_not_supported", "Value not supported",
                                         f"{', '.join(odd) or 'model'}: slotq shifts a flow model's schedule "
                                         "as diffusers does, as max_shift 1.15 and base_shift 0.5 at the "
                                         f"image's size ({size[0]}x{size[1]}) do")

    def loras(self, model: ModelInfo, nodes: list[Node]) -> list[dict[str, Any]]:
        """The job's ``loras`` from the model's chain: an adapter twice has its scales summed; one of
        strength 0 is left out, as ComfyUI leaves it (its name is checked all the same)."""
        scales: dict[str, float] = {}
        for node in nodes:
            name, scale = self.lora_name(node, model), float(node.inputs["strength_model"])
            if node.type == "LoraLoader" and node.inputs["strength_clip"] != node.inputs["strength_model"]:
                self.problems.add(node.id, "value_not_supported", "Value not supported",
                                  f"strength_clip: {node.inputs['strength_clip']} differs from "
                                  f"strength_model {node.inputs['strength_model']}; slotq gives a LoRA one "
                                  "scale for the model and the text encoder", input_name="strength_clip")
            elif scale:
                scales[name] = scales.get(name, 0.0) + scale
        if len(scales) > MAX_LORAS:
            raise self.problems.fail(nodes[-1], "graph_not_supported", "Too many LoRAs",
                                     f"the model's chain has {len(scales)} LoRAs; a slotq job takes at most "
                                     f"{MAX_LORAS}")
        return [{"name": name, "scale": scale} for name, scale in scales.items()]

    def lora_name(self, node: Node, model: ModelInfo) -> str:
        """A LoRA loader's adapter, by its name with or without ``.safetensors``: one of the model's."""
        value = node.inputs["lora_name"]
        name = value.removesuffix(".safetensors")
        if name not in model.loras:
            files = [f"{each}.safetensors" for each in model.loras]
            raise self.problems.fail(Param(node, "lora_name"), "value_not_in_list", "Value not in list",
                                     f"lora_name: '{value}' not in {files}")
        return name

    def check_clips(self, lora_nodes: list[Node], encoders: list[Node]) -> None:
        """Each LoraLoader acts on the model and on every prompt's encoder alike (slotq's one scale);
        one of strengths 0 acts nowhere, wherever it is."""
        applied = {node.id for node in lora_nodes if acts_on_both(node)}
        for encoder in encoders:
            chain = {node.id for node in self.clip_chain(encoder.inputs["clip"]) if acts_on_both(node)}
            for node_id in sorted(applied ^ chain, key=id_order):
                node = self.nodes[node_id]
                missing = (f"its CLIP output does not reach CLIPTextEncode {encoder.id}" if node_id in applied
                           else "its MODEL output does not reach the sampler")
                raise self.problems.fail(node, "graph_not_supported", "LoRA not supported",
                                         f"{missing}: slotq applies a LoRA to the model and its text encoder "
                                         "alike")

    # --- prompts -------------------------------------------------------------------------------------

    def conditioning(self, link: Link) -> Conditioning:
        """A CONDITIONING link back to its text encoder."""
        node, index = self.nodes[link.node], link.index
        guidance: Param | None = None
        controls: list[Node] = []
        while node.type != "CLIPTextEncode":
            name = "conditioning"
            if node.type == "FluxGuidance":
                guidance = guidance or Param(node, "guidance")
            else:  # a ControlNetApply, or a ControlNetApplyAdvanced's positive or negative output
                controls.append(node)
                if node.type == "ControlNetApplyAdvanced":
                    name = ("positive", "negative")[index]
            link = node.inputs[name]
            node, index = self.nodes[link.node], link.index
        return Conditioning(node, guidance, tuple(controls))

    def prompts(self, positive: Node, negative: Node | None) -> dict[str, Any]:
        """The job's prompt and negative_prompt, weighted where ComfyUI would weigh any of their words."""
        runs = {node.id: self.weighted_runs(node) for node in (positive, negative) if node is not None}
        weighted = any(weight != 1.0 for each in runs.values() for _, weight in each)
        texts = {node: written(each) if weighted else "".join(text for text, _ in each)
                 for node, each in runs.items()}
        for node_id, text in texts.items():
            if len(text) > MAX_PROMPT:
                self.problems.add(node_id, "value_not_supported", "Value not supported",
                                  f"text: {len(text)} characters; slotq takes at most {MAX_PROMPT}",
                                  input_name="text")
        if not texts[positive.id].strip():
            raise self.problems.fail(Param(positive, "text"), "value_not_supported", "Value not supported",
                                     "text: the positive prompt is empty; a slotq job needs one")
        body = {"prompt": texts[positive.id]}
        if negative is not None and texts[negative.id].strip():
            body["negative_prompt"] = texts[negative.id]
        if weighted:
            body["prompt_syntax"] = "weighted"
        return body

    def weighted_runs(self, encoder: Node) -> list[tuple[str, float]]:
        """A CLIPTextEncode's text as ComfyUI weighs it; a weight that is not a finite number is refused,
        and a text too long or nested too deep to read."""
        text = encoder.inputs["text"]
        if len(text) > MAX_TEXT or nesting(text) > MAX_NESTING:
            raise self.problems.fail(Param(encoder, "text"), "value_not_supported", "Value not supported",
                                     f"text: slotq reads texts of up to {MAX_TEXT} characters whose brackets "
                                     f"nest up to {MAX_NESTING} deep")
        runs = comfy_weights(text)
        if not all(math.isfinite(weight) for _, weight in runs):
            self.problems.add(encoder.id, "value_not_supported", "Value not supported",
                              "text: a weight is not a finite number", input_name="text")
        return runs

    # --- latents and images --------------------------------------------------------------------------

    def latent_fields(self, sampling: Sampling, model: ModelInfo) -> dict[str, Any]:
        """The job's size and images, and its steps: from an empty latent or an encoded image."""
        latent = self.source(sampling.node, "latent_image")
        if latent.type in EMPTY_LATENTS:
            return self.text_fields(sampling, model)
        if latent.type not in ENCODES:
            raise self.problems.fail(latent, "graph_not_supported", "Latent not supported",
                                     f"{sampling.node.type} {sampling.node.id} samples it: slotq samples an "
                                     "empty latent, an encoded image, or (hires) an upscaled one")
        steps, strength = self.schedule(sampling)
        encoded = self.source(latent, "samples") if latent.type == "SetLatentNoiseMask" else latent
        if encoded.type != "VAEEncode" and latent.type == "SetLatentNoiseMask":
            raise self.problems.fail(encoded, "graph_not_supported", "Latent not supported",
                                     "SetLatentNoiseMask masks an encoded image (VAEEncode) here")
        image, size = self.start_image(self.source(encoded, "pixels"), model)
        fields = {"width": size[0], "height": size[1], "steps": steps, "num_images": 1, "image": image}
        if latent.type != "VAEEncode":
            fields["mask"] = self.mask(latent, size)
        return fields | {"strength": strength}

    def text_fields(self, sampling: Sampling, model: ModelInfo) -> dict[str, Any]:
        """A text-to-image sampler's size, images and steps: its denoise must be whole."""
        latent = self.source(sampling.node, "latent_image")
        steps, strength = self.schedule(sampling)
        if strength < 1:
            param = sampling.denoise or sampling.start
            assert param is not None
            raise self.problems.fail(param, "value_not_supported", "Value not supported",
                                     f"{param.name}: a sampler of an empty latent runs its whole schedule "
                                     "in slotq")
        for name in ("width", "height"):
            side = latent.inputs[name]
            if side % model.side_multiple or side > self.settings.max_side:
                self.problems.add(latent.id, "value_not_supported", "Value not supported",
                                  f"{name}: {side}; a {model.family} model here makes sides that are "
                                  f"multiples of {model.side_multiple} up to {self.settings.max_side}",
                                  input_name=name)
        return {"width": latent.inputs["width"], "height": latent.inputs["height"], "steps": steps,
                "num_images": latent.inputs["batch_size"]}

    def upload(self, load: Node) -> str:
        """A LoadImage's or LoadImageMask's upload, base64, turned as its EXIF says (as ComfyUI loads it)."""
        value = load.inputs["image"]
        match = ANNOTATION.search(value)
        param, failed = Param(load, "image"), "Custom validation failed for node"
        if match is not None and match[1] != "input":
            raise self.problems.fail(param, "custom_validation_failed", failed,
                                     f"image - slotq reads uploaded images only: {value}")
        data = self.uploads(value[:match.start()] if match else value)
        if data is None:
            raise self.problems.fail(param, "custom_validation_failed", failed,
                                     f"image - Invalid image file: {value}")
        if len(data) > self.settings.max_image_bytes:
            raise self.problems.fail(param, "custom_validation_failed", failed,
                                     f"image - {value} is over {self.settings.max_image_bytes} bytes")
        image = self.opened(load, data)
        if image.getexif().get(0x0112, 1) != 1:  # Orientation: ComfyUI turns the image upright
            buffer = io.BytesIO()
            ImageOps.exif_transpose(image).save(buffer, "PNG")
            data = buffer.getvalue()
        return base64.b64encode(data).decode()

    def opened(self, load: Node, data: bytes) -> Image.Image:
        """An upload's image, decoded within the bounds on a foreign client's upload."""
        try:
            return images.opened(f"{load.type} {load.id}", data, self.settings)
        except InvalidImageError as exc:
            raise self.problems.fail(Param(load, "image"), "invalid_image", "Image not readable",
                                     str(exc)) from None

    def start_image(self, load: Node, model: ModelInfo) -> tuple[str, tuple[int, int]]:
        """An image-to-image job's image as a ``data:`` URL, fitted to the sides the model makes (as
        A1111's img2img fits one), and its size: the job's."""
        if load.type != "LoadImage":
            raise self.problems.fail(load, "graph_not_supported", "Image not supported",
                                     "slotq encodes an uploaded image (LoadImage), not one made in the graph")
        value = self.upload(load)
        try:
            return images.start_image(value, None, self.settings, model.side_multiple)
        except InvalidImageError as exc:
            raise self.problems.fail(Param(load, "image"), "invalid_image", "Image not usable",
                                     str(exc)) from None

    def mask(self, latent: Node, size: tuple[int, int]) -> str:
        """An inpainting job's mask at the image's size, white where ComfyUI's mask is 1 (repaint); for
        VAEEncodeForInpaint rounded and grown by grow_mask_by, as ComfyUI grows it."""
        source = self.source(latent, "mask")
        grey = self.grey_mask(source).resize(size, Image.Resampling.BILINEAR)
        if latent.type == "VAEEncodeForInpaint":
            grey = grown(grey.point(lambda level: 255 if level >= 128 else 0), latent.inputs["grow_mask_by"])
        return images.png_url(grey)

    def grey_mask(self, load: Node) -> Image.Image:
        """A MASK as ComfyUI loads it, as grey levels: LoadImage's is 1 - alpha (none without alpha);
        LoadImageMask's is its channel (1 - alpha for alpha)."""
        image = self.opened(load, base64.b64decode(self.upload(load)))  # upright, as uploaded
        if load.type == "LoadImage":
            if "A" not in image.getbands():
                return Image.new("L", image.size, 0)
            return ImageOps.invert(image.getchannel("A"))
        rgba = image if image.getbands() == ("R", "G", "B", "A") else image.convert("RGBA")
        channel = load.inputs["channel"][0].upper()
        grey = rgba.getchannel(channel)
        return ImageOps.invert(grey) if channel == "A" else grey

    # --- the hires pass and ControlNets --------------------------------------------------------------

    def hires(self, first: Sampling, final: Sampling, upscale: Node, model: ModelInfo,
              sampled: dict[str, Any], size: tuple[int, int]) -> dict[str, Any]:
        """A second sampler over an upscaled latent as slotq's hires pass: it must run as the first."""
        if not model.spec.takes_latent_upscale:
            raise self.problems.fail(upscale, "graph_not_supported", "Upscale not supported",
                                     f"a {model.family} model's latents are not upscaled here")
        scale = self.upscale_factor(upscale, size, model.side_multiple)
        steps, denoise = self.schedule(final)
        again = self.sampled(final, model, self.model(final)[1]) | {"controlnets": self.control_ids(final)}
        sampled = sampled | {"controlnets": self.control_ids(first)}
        for name in again.keys() | sampled.keys():
            if name != "seed" and again.get(name) != sampled.get(name):
                raise self.problems.fail(final.node, "graph_not_supported", "Hires pass not supported",
                                         f"its {name} differs from {first.node.type} {first.node.id}'s: "
                                         "slotq's hires pass runs as its first pass (but for its seed)")
        return {"scale": scale, "steps": steps, "denoise": denoise, "upscaler": "latent"}

    def upscale_factor(self, node: Node, size: tuple[int, int], multiple: int) -> float:
        """The hires pass's scale: LatentUpscaleBy's, or the one that makes LatentUpscale's size."""
        if node.type == "LatentUpscaleBy":
            scale = float(node.inputs["scale_by"])
        else:
            wanted = (node.inputs["width"], node.inputs["height"])
            scale = wanted[0] / size[0] if wanted[0] else wanted[1] / size[1]
            made = output_size(*size, scale, multiple)
            if any(side and side != each for side, each in zip(wanted, made, strict=True)):
                raise self.problems.fail(node, "value_not_supported", "Value not supported",
                                         f"width, height: {wanted[0]}x{wanted[1]} is not {size[0]}x{size[1]} "
                                         "scaled alike on both sides, as slotq's hires pass scales")
        if not 1 < scale <= 4:
            raise self.problems.fail(node, "value_not_supported", "Value not supported",
                                     f"it scales by {scale:g}: slotq's hires pass scales by more than 1, "
                                     "up to 4")
        return scale

    def control_ids(self, sampling: Sampling) -> list[str]:
        """The ControlNet nodes on a sampler's prompts' way."""
        links = [link for link in (sampling.positive, sampling.negative) if link is not None]
        return [node.id for link in links for node in self.conditioning(link).controls]

    def controlnets(self, sampling: Sampling, model: ModelInfo, size: tuple[int, int]) -> dict[str, Any]:
        """The job's ``controlnets``: those on the prompts' way to the final sampler, acting on both."""
        positive = self.conditioning(sampling.positive)
        negative = self.conditioning(sampling.negative) if sampling.negative is not None else None
        both = {node.id for node in negative.controls} if negative is not None else None
        for node in (negative.controls if negative is not None else ()):
            if node.id not in {each.id for each in positive.controls}:
                raise self.problems.fail(node, "graph_not_supported", "ControlNet not supported",
                                         "it acts on the negative prompt alone: slotq's ControlNets act on "
                                         "both")
        controls = []
        for node in reversed(positive.controls):  # ControlNetApply acts on both in ComfyUI too
            if both is not None and node.type == "ControlNetApplyAdvanced" and node.id not in both:
                raise self.problems.fail(node, "graph_not_supported", "ControlNet not supported",
                                         "its negative output does not reach the sampler: slotq's "
                                         "ControlNets act on both prompts")
            name = self.control_name(self.source(node, "control_net"), model)
            if node.inputs["strength"]:  # strength 0: ComfyUI leaves it out (its name is checked first)
                controls.append(self.control(node, name, size))
        if len(controls) > MAX_CONTROLNETS:
            raise self.problems.fail(sampling.node, "graph_not_supported", "Too many ControlNets",
                                     f"{len(controls)} ControlNets; a slotq job takes at most "
                                     f"{MAX_CONTROLNETS}")
        return {"controlnets": controls} if controls else {}

    def control_name(self, loader: Node, model: ModelInfo) -> str:
        """A ControlNetLoader's ControlNet, named with or without ``.safetensors``: one of the model's."""
        value = loader.inputs["control_net_name"]
        name = value.removesuffix(".safetensors")
        if not model.spec.takes_controlnet or name not in model.controlnets:
            offered = [f"{each}.safetensors" for each in model.controlnets if model.spec.takes_controlnet]
            raise self.problems.fail(Param(loader, "control_net_name"), "value_not_in_list",
                                     "Value not in list",
                                     f"control_net_name: '{value}' not in {offered} ({model.name}'s)")
        return name

    def control(self, node: Node, name: str, size: tuple[int, int]) -> dict[str, Any]:
        """One ControlNet: its name, its image cropped to the job's shape (ComfyUI centres it), its span."""
        start, end = ((node.inputs["start_percent"], node.inputs["end_percent"])
                      if node.type == "ControlNetApplyAdvanced" else (0.0, 1.0))
        if start >= end:
            raise self.problems.fail(Param(node, "end_percent"), "value_not_supported", "Value not supported",
                                     f"end_percent: {end} is not above start_percent {start}")
        load = self.source(node, "image")
        if load.type != "LoadImage":
            raise self.problems.fail(load, "graph_not_supported", "Image not supported",
                                     "a control image is an uploaded one (LoadImage) in slotq")
        try:
            image, _ = images.control_image(f"LoadImage {load.id}", self.upload(load), size, True,
                                            self.settings)
        except InvalidImageError as exc:
            raise self.problems.fail(Param(load, "image"), "invalid_image", "Image not usable",
                                     str(exc)) from None
        return {"name": name, "image": image, "scale": float(node.inputs["strength"]), "start": float(start),
                "end": float(end)}


# --- helpers -----------------------------------------------------------------------------------------

def flow(model: ModelInfo) -> bool:
    """Whether a model is a flow-matching one (Flux): guided by FluxGuidance, without CFG."""
    return set(model.schedulers) <= set(FLOW_SCHEDULERS)


def acts_on_both(node: Node) -> bool:
    """Whether a node is a LoraLoader that changes the model or its text encoder."""
    return node.type == "LoraLoader" and bool(node.inputs["strength_model"] or node.inputs["strength_clip"])


def share(run: int, total: int) -> float:
    """The strength with which diffusers runs exactly ``run`` of ``total`` steps (int(total * strength))."""
    if run >= total:
        return 1.0
    strength = run / total
    while int(total * strength) < run:
        strength = math.nextafter(strength, 1.0)
    return strength


def without_extension(name: str) -> str:
    """A model file's name without its extension, where it has one of a model's."""
    for extension in MODEL_EXTENSIONS:
        if name.lower().endswith(extension):
            return name[:-len(extension)]
    return name


def stem(name: str) -> str:
    """A file's name without folders or extension, in lower case."""
    return without_extension(name.replace("\\", "/").rpartition("/")[2]).lower()


def grown(mask: Image.Image, by: int) -> Image.Image:
    """A binary mask grown as ComfyUI's VAEEncodeForInpaint grows it: each pixel the largest in a box
    of ``by`` x ``by`` (for an even ``by``, reaching one further up and left)."""
    for _ in range((by - 1) // 2):
        mask = mask.filter(ImageFilter.MaxFilter(3))
    if by and by % 2 == 0:
        for offset in ((1, 0), (0, 1)):
            shifted = Image.new("L", mask.size, 0)
            shifted.paste(mask, offset)
            mask = ImageChops.lighter(mask, shifted)
    return mask


def comfy_weights(text: str) -> list[tuple[str, float]]:
    """A prompt as ComfyUI's CLIPTextEncode weighs it (comfy/sd1_clip.py ``token_weights``): runs of text
    and their weights. Written without recursion: brackets may nest as deep as a text is long."""
    escaped = text.replace("\\)", "\0\1").replace("\\(", "\0\2")
    runs: list[tuple[str, float]] = []
    pending: list[tuple[str, float, bool]] = [(escaped, 1.0, True)]
    while pending:
        segment, weight, nested = pending.pop()
        if not nested:
            runs.append((segment.replace("\0\1", ")").replace("\0\2", "("), weight))
            continue
        for item in reversed(parenthesized(segment)):
            pending.append(bracketed(item, weight) if len(item) >= 2 and item[0] == "(" and item[-1] == ")"
                           else (item, weight, False))
    return runs


def nesting(text: str) -> int:
    """How deep a text's brackets nest at most (at least as deep as ComfyUI reads them)."""
    depth = deepest = 0
    for char in text.replace("\\(", "").replace("\\)", ""):
        if char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(0, depth - 1)
    return deepest


def bracketed(item: str, weight: float) -> tuple[str, float, bool]:
    """A bracketed run: x1.1, or the weight after its last colon where that is a number."""
    inner, weight = item[1:-1], weight * 1.1
    colon = inner.rfind(":")
    if colon > 0:
        try:
            weight, inner = float(inner[colon + 1:]), inner[:colon]
        except ValueError:
            pass
    return inner, weight, True


def parenthesized(text: str) -> list[str]:
    """ComfyUI's ``parse_parentheses``: the text split into runs and top-level bracketed groups."""
    items: list[str] = []
    current, depth = "", 0
    for char in text:
        if char == "(":
            if depth == 0 and current:
                items.append(current)
                current = ""
            current += char
            depth += 1
        elif char == ")":
            depth -= 1
            if depth == 0:
                items.append(current + char)
                current = ""
            else:
                current += char
        else:
            current += char
    if current:
        items.append(current)
    return items


def written(runs: Iterable[tuple[str, float]]) -> str:
    """Runs of text and weights in slotq's weighted syntax: brackets escaped, each weighted run as
    ``(text:weight)`` with the weight written out in full."""
    parts = []
    for text, weight in runs:
        escaped = re.sub(r"([\\()\[\]])", r"\\\1", text)
        parts.append(escaped if weight == 1.0 or not escaped else f"({escaped}:{Decimal(repr(weight)):f})")
    return "".join(parts)
