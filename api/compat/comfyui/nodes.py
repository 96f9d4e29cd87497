"""The node classes ``graph.py`` maps, as ComfyUI's ``GET /object_info`` lists them: each class's inputs
in ComfyUI's classic shape (``["INT", {"default", "min", "max"}]``, a combo as ``[[choice, ...]]`` or
``[[choice, ...], {options}]``), its outputs, and how ComfyUI's UI presents it. The choices are what
slotq runs: the served models as checkpoint files, the LoRAs and ControlNets, the sampler and
scheduler names ``graph.SAMPLERS`` maps; bounds are slotq's where they are narrower than ComfyUI's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from api.compat.comfyui.graph import CLASSES, OUTPUTS, Input, NodeClass
from shared.contract.models import ModelInfo

SUFFIX = ".safetensors"  # the files ComfyUI names weights by; slotq's names are the stems
# The stock files standing for a Flux model's own text encoders and VAE (graph.FLUX_ENCODERS, FLUX_VAE).
ENCODER_FILES = ("clip_l.safetensors", "t5xxl_fp16.safetensors")
VAE_FILES = ("ae.safetensors",)
HIDDEN = {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"}  # what ComfyUI's output nodes are handed

CUSTOM_SAMPLING = "comfy_extras.nodes_custom_sampler"
# Each class as ComfyUI presents it: display name, category, Python module, description.
PRESENTATION: dict[str, tuple[str, str, str, str]] = {
    "CheckpointLoaderSimple": ("Load Checkpoint", "loaders", "nodes", "Loads a diffusion model checkpoint, "
                               "diffusion models are used to denoise latents."),
    "UNETLoader": ("Load Diffusion Model", "advanced/loaders", "nodes", "Loads a Flux model's transformer."),
    "DualCLIPLoader": ("DualCLIPLoader", "advanced/loaders", "nodes",
                       "Loads a Flux model's own text encoders (T5-XXL and CLIP-L)."),
    "VAELoader": ("Load VAE", "loaders", "nodes", "Loads a Flux model's own VAE."),
    "LoraLoader": ("Load LoRA", "loaders", "nodes", "LoRAs are used to modify diffusion and CLIP models, "
                   "altering the way in which latents are denoised such as applying styles. Multiple LoRA "
                   "nodes can be linked together. slotq gives both strengths one value."),
    "LoraLoaderModelOnly": ("LoraLoaderModelOnly", "loaders", "nodes", ""),
    "CLIPSetLastLayer": ("CLIP Set Last Layer", "conditioning", "nodes", ""),
    "ModelSamplingFlux": ("ModelSamplingFlux", "advanced/model", "comfy_extras.nodes_model_advanced", ""),
    "CLIPTextEncode": ("CLIP Text Encode (Prompt)", "conditioning", "nodes", "Encodes a text prompt using a "
                       "CLIP model into an embedding that can be used to guide the diffusion model towards "
                       "generating specific images."),
    "FluxGuidance": ("FluxGuidance", "advanced/conditioning/flux", "comfy_extras.nodes_flux", ""),
    "ControlNetLoader": ("Load ControlNet Model", "loaders", "nodes", ""),
    "ControlNetApply": ("Apply ControlNet", "conditioning/controlnet", "nodes", ""),
    "ControlNetApplyAdvanced": ("Apply ControlNet (Advanced)", "conditioning/controlnet", "nodes", ""),
    "EmptyLatentImage": ("Empty Latent Image", "latent", "nodes", "Create a new batch of empty latent images "
                         "to be denoised via sampling."),
    "EmptySD3LatentImage": ("EmptySD3LatentImage", "latent/sd3", "comfy_extras.nodes_sd3", ""),
    "LoadImage": ("Load Image", "image", "nodes", ""),
    "LoadImageMask": ("Load Image (as Mask)", "mask", "nodes", ""),
    "VAEEncode": ("VAE Encode", "latent", "nodes", ""),
    "VAEEncodeForInpaint": ("VAE Encode (for Inpainting)", "latent/inpaint", "nodes", ""),
    "SetLatentNoiseMask": ("Set Latent Noise Mask", "latent/inpaint", "nodes", ""),
    "LatentUpscale": ("Upscale Latent", "latent", "nodes", ""),
    "LatentUpscaleBy": ("Upscale Latent By", "latent", "nodes", ""),
    "KSampler": ("KSampler", "sampling", "nodes", "Uses the provided model, positive and negative "
                 "conditioning to denoise the latent image."),
    "KSamplerAdvanced": ("KSampler (Advanced)", "sampling", "nodes", ""),
    "RandomNoise": ("RandomNoise", "sampling/custom_sampling/noise", CUSTOM_SAMPLING, ""),
    "BasicGuider": ("BasicGuider", "sampling/custom_sampling/guiders", CUSTOM_SAMPLING, ""),
    "CFGGuider": ("CFGGuider", "sampling/custom_sampling/guiders", CUSTOM_SAMPLING, ""),
    "KSamplerSelect": ("KSamplerSelect", "sampling/custom_sampling/samplers", CUSTOM_SAMPLING, ""),
    "BasicScheduler": ("BasicScheduler", "sampling/custom_sampling/schedulers", CUSTOM_SAMPLING, ""),
    "SamplerCustomAdvanced": ("SamplerCustomAdvanced", "sampling/custom_sampling", CUSTOM_SAMPLING, ""),
    "VAEDecode": ("VAE Decode", "latent", "nodes", "Decodes latent images back into pixel space images."),
    "SaveImage": ("Save Image", "image", "nodes", "Saves the input images as the job's results."),
    "PreviewImage": ("Preview Image", "image", "nodes", "Shows the input images (the job's results too)."),
}


def object_info(models: Sequence[ModelInfo], loras: Sequence[str],
                controlnets: Sequence[str]) -> dict[str, Any]:
    """``GET /object_info``: every class slotq maps, its combos listing what this service runs."""
    flux = any(model.spec.text_encoders == "t5_clip" for model in models)
    choices = {
        "checkpoints": [model.name + SUFFIX for model in models if model.spec.single_file == "pipeline"],
        "unets": [model.name + SUFFIX for model in models if model.spec.single_file == "transformer"],
        "encoders": list(ENCODER_FILES) if flux else [],
        "vaes": list(VAE_FILES) if any(model.spec.latent_format == "flux" for model in models) else [],
        "loras": [name + SUFFIX for name in loras],
        "controlnets": [name + SUFFIX for name in controlnets],
        "images": [],  # uploads are a caller's own: ComfyUI's clients upload before they name one
    }
    return {name: entry(name, node, choices) for name, node in CLASSES.items()}


def entry(name: str, node: NodeClass, choices: dict[str, list[str]]) -> dict[str, Any]:
    """One class's ``/object_info`` entry."""
    display, category, module, description = PRESENTATION[name]
    inputs: dict[str, dict[str, Any]] = {"required": {}}
    for input_name, declared in node.inputs.items():
        section = inputs.setdefault("optional" if declared.optional else "required", {})
        section[input_name] = shape(declared, choices)
    if name in OUTPUTS:
        inputs["hidden"] = dict(HIDDEN)
    return {
        "input": inputs, "input_order": {section: list(entries) for section, entries in inputs.items()},
        "output": list(node.outputs), "output_is_list": [False] * len(node.outputs),
        "output_name": list(node.output_names or node.outputs), "name": name, "display_name": display,
        "description": description, "python_module": module, "category": category,
        "output_node": name in OUTPUTS,
    }


def shape(declared: Input, choices: dict[str, list[str]]) -> list[Any]:
    """An input as ComfyUI's classic ``INPUT_TYPES`` declares it."""
    options = dict(declared.options)
    if declared.type == "COMBO":
        listed = choices[declared.source] if declared.source else list(declared.choices)
        return [listed, options] if options else [listed]
    return [declared.type, options] if options else [declared.type]
