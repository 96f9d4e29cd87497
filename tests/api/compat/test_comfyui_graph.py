"""ComfyUI's API-format graphs as slotq jobs (``api/compat/comfyui/graph.py``) and the node catalog
(``nodes.py``): ComfyUI's and Open WebUI's stock graphs as the exact native bodies they make, each kind
of refusal in ComfyUI's ``node_errors`` shape, and any JSON at all refused with ``GraphError`` alone.
Pure: no Redis, no worker."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as fuzzing
from hypothesis import strategies as st
from PIL import Image

from api.compat.a1111 import images
from api.compat.comfyui import graph, nodes
from api.compat.comfyui.graph import GraphError, Mapped, Output
from shared.contract.models import model_info
from shared.contract.settings import Settings

FIXTURES = Path(__file__).parent / "comfyui"
SD15 = model_info("sd15", "sd", loras=["detail", "style"]).model_copy(update={"controlnets": ["canny"]})
SDXL = model_info("sdxl", "sdxl")
FLUX = model_info("flux", "flux", loras=["flux-style"])
MODELS = [SD15, SDXL, FLUX]
SETTINGS = Settings(max_side=1024, max_steps=100)


def stock(name: str) -> dict[str, Any]:
    """A fixture graph (tests/api/compat/comfyui/<name>.json)."""
    loaded: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return loaded


def png(size: tuple[int, int] = (300, 200), mode: str = "RGB") -> bytes:
    """A PNG of a gradient, so that a resize shows."""
    image = Image.linear_gradient("L").resize(size).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def run(prompt: Any, uploads: dict[str, bytes] | None = None) -> Mapped:
    return graph.translate(prompt, MODELS, (uploads or {}).get, SETTINGS)


def refused(prompt: Any, uploads: dict[str, bytes] | None = None) -> GraphError:
    with pytest.raises(GraphError) as caught:
        run(prompt, uploads)
    return caught.value


def only_error(refusal: GraphError, node: str) -> dict[str, Any]:
    """The one error the refusal names, which must be this node's."""
    assert list(refusal.node_errors) == [node], refusal.node_errors
    (error,) = refusal.node_errors[node]["errors"]
    return error


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --- the stock graphs --------------------------------------------------------------------------------

def test_comfyuis_default_graph_is_the_native_job() -> None:
    mapped = run(stock("sd15_txt2img"))
    assert mapped.body == {"prompt": "masterpiece best quality girl", "negative_prompt": "bad hands",
                           "model": "sd15", "width": 512, "height": 512, "steps": 20, "guidance_scale": 8.0,
                           "seed": 8566257, "num_images": 1, "scheduler": "euler"}
    assert mapped.order == ["4", "6", "7", "5", "3", "8", "9"]  # what each reads first, in ComfyUI's order
    assert mapped.sampler == "3"
    assert mapped.outputs == [Output("9", "SaveImage", "ComfyUI", "output")]


def test_open_webuis_default_workflow_as_it_sends_it() -> None:
    prompt = stock("openwebui_default")
    assert run(prompt).body == {"prompt": "Prompt", "model": "sd15", "width": 512, "height": 512, "steps": 20,
                                "guidance_scale": 8.0, "seed": 0, "num_images": 1, "scheduler": "euler"}
    # Open WebUI fills in the prompt, size, steps and a random seed of up to 2**50.
    prompt["6"]["inputs"]["text"] = "a fox in the snow"
    prompt["5"]["inputs"] |= {"width": 768, "height": 512}
    prompt["3"]["inputs"] |= {"steps": 30, "seed": 2**50 + 12345}
    assert run(prompt).body == {"prompt": "a fox in the snow", "model": "sd15", "width": 768, "height": 512,
                                "steps": 30, "guidance_scale": 8.0, "seed": 12345, "num_images": 1,
                                "scheduler": "euler"}
    # A node map with a negative prompt row writes null there when the chat gives none: no negative.
    prompt["7"]["inputs"]["text"] = None
    assert "negative_prompt" not in run(prompt).body


def test_an_sdxl_graph_with_ksampler_advanced() -> None:
    mapped = run(stock("sdxl_txt2img"))
    assert mapped.body == {
        "prompt": "evening sunset scenery blue sky nature, glass bottle with a galaxy in it",
        "negative_prompt": "text, watermark", "model": "sdxl", "width": 1024, "height": 1024, "steps": 25,
        "guidance_scale": 8.0, "seed": 721897303308196 % 2**32, "num_images": 1, "scheduler": "euler"}
    assert (mapped.sampler, mapped.outputs) == ("10", [Output("19", "SaveImage", "ComfyUI", "output")])


def test_comfyuis_flux_graph() -> None:
    mapped = run(stock("flux_txt2img"))
    prompt = stock("flux_txt2img")["6"]["inputs"]["text"]
    assert mapped.body == {"prompt": prompt, "model": "flux", "width": 1024, "height": 1024, "steps": 20,
                           "guidance_scale": 3.5, "seed": 219670278747233 % 2**32, "num_images": 1,
                           "scheduler": "flow_euler"}
    assert mapped.sampler == "13"
    order = mapped.order
    assert order.index("12") < order.index("30") < order.index("13") < order.index("8") < order.index("9")
    assert sorted(order, key=int) == ["6", "8", "9", "10", "11", "12", "13", "16", "17", "22", "25", "26",
                                      "27", "30"]


def test_flux_guidance_is_the_jobs_guidance_and_3_5_without_it() -> None:
    prompt = stock("flux_txt2img")
    prompt["26"]["inputs"]["guidance"] = 2.5
    assert run(prompt).body["guidance_scale"] == 2.5
    prompt["22"]["inputs"]["conditioning"] = ["6", 0]  # FluxGuidance left out: ComfyUI's 3.5
    assert run(prompt).body["guidance_scale"] == 3.5


def test_an_image_to_image_graph() -> None:
    upload = png((300, 200))
    mapped = run(stock("img2img"), {"example.png": upload})
    image, size = images.start_image(b64(upload), None, SETTINGS, 8)
    assert size == (296, 200)
    assert mapped.body == {
        "prompt": "photograph of victorian woman with wings, sky clouds, meadow grass",
        "negative_prompt": "watermark, text", "model": "sd15", "width": 296, "height": 200, "steps": 22,
        "guidance_scale": 8.0, "seed": 280823642470253 % 2**32, "num_images": 1, "scheduler": "dpmpp_2m",
        "image": image, "strength": 20 / 22}
    sent = Image.open(io.BytesIO(base64.b64decode(mapped.body["image"].partition(",")[2])))
    assert (sent.format, sent.size) == ("PNG", (296, 200))


@pytest.mark.parametrize(("steps", "denoise", "total"), [(20, 0.87, 22), (20, 0.5, 40), (30, 0.75, 40),
                                                         (7, 0.7, 10), (20, 1.0, 20)])
def test_denoise_runs_comfyuis_steps_of_comfyuis_schedule(steps: int, denoise: float, total: int) -> None:
    prompt = stock("img2img")
    prompt["3"]["inputs"] |= {"steps": steps, "denoise": denoise}
    body = run(prompt, {"example.png": png()}).body
    assert body["steps"] == total == int(steps / denoise)
    assert int(total * body["strength"]) == steps  # diffusers runs int(steps * strength) steps
    assert abs(body["strength"] - denoise) < 1 / total


def test_a_lora_chain() -> None:
    assert run(stock("lora_chain")).body == {
        "prompt": "masterpiece best quality girl standing in victorian clothing",
        "negative_prompt": "bad hands", "model": "sd15", "width": 512, "height": 768, "steps": 20,
        "guidance_scale": 8.0, "seed": 851616030078638 % 2**32, "num_images": 2,
        "scheduler": "dpmpp_2m_karras",
        "loras": [{"name": "detail", "scale": 0.8}, {"name": "style", "scale": -0.5}]}


def test_a_hires_graph() -> None:
    mapped = run(stock("hires"))
    assert mapped.body == {
        "prompt": "a lighthouse on a cliff, storm", "negative_prompt": "blurry", "model": "sd15",
        "width": 512, "height": 512, "steps": 20, "guidance_scale": 7.5, "seed": 1, "num_images": 1,
        "scheduler": "euler_a",
        "hires": {"scale": 1.5, "steps": 20, "denoise": 0.5, "upscaler": "latent"}}
    assert mapped.sampler == "3"  # the first pass counts the job's progress
    sized = stock("hires")
    sized["10"] = {"class_type": "LatentUpscale", "inputs": {
        "samples": ["3", 0], "upscale_method": "bilinear", "width": 1024, "height": 1024, "crop": "disabled"}}
    assert run(sized).body["hires"]["scale"] == 2.0


def test_an_inpainting_graph_grows_its_mask_as_comfyui() -> None:
    picture = Image.new("RGBA", (128, 96), (90, 120, 200, 255))
    picture.paste((0, 0, 0, 0), (40, 30, 60, 50))  # transparent: LoadImage's mask is 1 there (repaint)
    buffer = io.BytesIO()
    picture.save(buffer, "PNG")
    asked: list[str] = []

    def uploads(name: str) -> bytes:
        asked.append(name)
        return buffer.getvalue()

    mapped = graph.translate(stock("inpaint"), MODELS, uploads, SETTINGS)
    body = mapped.body
    assert asked and set(asked) == {"yosemite_inpaint_example.png"}  # " [input]" is ComfyUI's annotation
    image, _ = images.start_image(b64(buffer.getvalue()), None, SETTINGS, 8)
    mask = Image.open(io.BytesIO(base64.b64decode(body.pop("mask").partition(",")[2])))
    assert body == {
        "prompt": "closeup photograph of maine coon (cat:1.2) in the yosemite national park mountains nature",
        "negative_prompt": "watermark, text", "prompt_syntax": "weighted", "model": "sd15", "width": 128,
        "height": 96, "steps": 20, "guidance_scale": 8.0, "seed": 7, "num_images": 1, "scheduler": "unipc",
        "image": image, "strength": 1.0}
    assert mask.size == (128, 96)
    row = [mask.getpixel((x, 40)) for x in range(128)]
    # ComfyUI grows by 6 with a 6x6 box reaching 3 pixels before and 2 after: 40..59 becomes 38..62.
    assert [x for x, level in enumerate(row) if level] == list(range(38, 63))
    assert mapped.outputs == [Output("9", "PreviewImage", "ComfyUI_temp", "temp")]


def test_a_mask_from_load_image_mask_keeps_its_grey_levels() -> None:
    prompt = stock("img2img")
    prompt["20"] = {"class_type": "LoadImageMask", "inputs": {"image": "mask.png", "channel": "red"}}
    prompt["21"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["12", 0], "mask": ["20", 0]}}
    prompt["3"]["inputs"]["latent_image"] = ["21", 0]
    grey = Image.new("RGB", (296, 200), (128, 0, 0))
    grey.paste((255, 0, 0), (0, 0, 100, 200))
    buffer = io.BytesIO()
    grey.save(buffer, "PNG")
    body = run(prompt, {"example.png": png(), "mask.png": buffer.getvalue()}).body
    mask = Image.open(io.BytesIO(base64.b64decode(body["mask"].partition(",")[2])))
    assert (mask.mode, mask.size) == ("L", (296, 200))
    assert (mask.getpixel((10, 10)), mask.getpixel((200, 10))) == (255, 128)
    assert body["strength"] == 20 / 22


def test_a_controlnet_graph() -> None:
    edges = png((512, 512))
    body = run(stock("controlnet"), {"edges.png": edges}).body
    control, _ = images.control_image("LoadImage 10", b64(edges), (512, 384), True, SETTINGS)
    assert body == {
        "prompt": "a house by a lake", "model": "sd15", "width": 512, "height": 384, "steps": 25,
        "guidance_scale": 6.0, "seed": 5, "num_images": 1, "scheduler": "ddim",
        "controlnets": [{"name": "canny", "image": control, "scale": 0.9, "start": 0.0, "end": 0.8}]}
    sent = Image.open(io.BytesIO(base64.b64decode(control.partition(",")[2])))
    assert sent.size[0] * 384 == sent.size[1] * 512  # cropped to the job's shape, centred as ComfyUI does


def test_the_old_controlnet_apply_acts_on_both_prompts_as_in_comfyui() -> None:
    prompt = stock("controlnet")
    prompt["11"] = {"class_type": "ControlNetApply", "inputs": {"conditioning": ["6", 0], "strength": 1.5,
                                                                "control_net": ["12", 0], "image": ["10", 0]}}
    prompt["3"]["inputs"] |= {"positive": ["11", 0], "negative": ["7", 0]}
    (control,) = run(prompt, {"edges.png": png((512, 512))}).body["controlnets"]
    assert (control["name"], control["scale"], control["start"], control["end"]) == ("canny", 1.5, 0.0, 1.0)
    prompt["11"]["inputs"]["strength"] = 0  # ComfyUI leaves it out; its name is still checked
    assert "controlnets" not in run(prompt, {"edges.png": png()}).body
    prompt["12"]["inputs"]["control_net_name"] = "depth.safetensors"
    assert only_error(refused(prompt, {"edges.png": png()}), "12")["type"] == "value_not_in_list"


def test_flux_encoders_and_vae_by_their_stock_names_in_any_folder_or_precision() -> None:
    prompt = stock("flux_txt2img")
    prompt["11"]["inputs"] |= {"clip_name1": "flux/clip_l.safetensors",
                               "clip_name2": "flux\\t5xxl_fp8_e4m3fn_scaled.safetensors"}
    prompt["10"]["inputs"]["vae_name"] = "flux/ae.sft"
    assert run(prompt).body == run(stock("flux_txt2img")).body
    prompt["10"]["inputs"]["vae_name"] = "aesthetic_vae.safetensors"  # another VAE: not the model's own
    assert only_error(refused(prompt), "10")["type"] == "value_not_in_list"


def test_a_flux_lora() -> None:
    prompt = stock("flux_txt2img")
    prompt["40"] = {"class_type": "LoraLoader", "inputs": {"model": ["12", 0], "clip": ["11", 0],
                                                           "lora_name": "flux-style.safetensors",
                                                           "strength_model": 0.7, "strength_clip": 0.7}}
    prompt["30"]["inputs"]["model"] = ["40", 0]
    prompt["6"]["inputs"]["clip"] = ["40", 1]
    assert run(prompt).body["loras"] == [{"name": "flux-style", "scale": 0.7}]


def test_an_upload_is_turned_upright_as_its_exif_says() -> None:
    picture = Image.new("RGB", (300, 200), (10, 20, 30))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: upright it is 200 wide
    buffer = io.BytesIO()
    picture.save(buffer, "JPEG", exif=exif)
    body = run(stock("img2img"), {"example.png": buffer.getvalue()}).body
    assert (body["width"], body["height"]) == (200, 296)


def test_every_pair_of_the_sampler_table_maps() -> None:
    for (name, schedule), runs in graph.SAMPLERS.items():
        prompt = stock("sd15_txt2img")
        prompt["3"]["inputs"] |= {"sampler_name": name, "scheduler": schedule}
        assert run(prompt).body["scheduler"] == runs[0]
    assert graph.SAMPLERS[("euler", "simple")] == ("euler", "flow_euler")  # Flux's Euler on a flow model


# --- seeds and prompts -------------------------------------------------------------------------------

@pytest.mark.parametrize(("seed", "runs"), [(0, 0), (2**32 - 1, 2**32 - 1), (2**32, 0), (2**32 + 7, 7),
                                            (2**50, 0), (2**50 + 12345, 12345), (2**64 - 1, 2**32 - 1),
                                            (5.0, 5)])
def test_seeds_below_2_32_are_the_jobs_and_larger_ones_their_low_32_bits(seed: Any, runs: int) -> None:
    prompt = stock("sd15_txt2img")
    prompt["3"]["inputs"]["seed"] = seed
    assert run(prompt).body["seed"] == runs


@pytest.mark.parametrize(("seed", "kind"), [(-1, "value_smaller_than_min"), (2**64, "value_bigger_than_max"),
                                            (2.0**64, "value_bigger_than_max"), ("5", "invalid_input_type"),
                                            (1.5, "invalid_input_type"), (True, "invalid_input_type"),
                                            (None, "invalid_input_type")])
def test_seeds_outside_comfyuis_range_are_refused(seed: Any, kind: str) -> None:
    prompt = stock("sd15_txt2img")
    prompt["3"]["inputs"]["seed"] = seed
    refusal = refused(prompt)
    error = only_error(refusal, "3")
    assert error["type"] == kind and error["extra_info"]["input_name"] == "seed"
    assert refusal.node_errors["3"]["class_type"] == "KSampler"
    assert refusal.node_errors["3"]["dependent_outputs"] == ["9"]
    assert refusal.type == "prompt_outputs_failed_validation"


def test_a_flux_seed_is_reduced_alike() -> None:
    prompt = stock("flux_txt2img")
    prompt["25"]["inputs"]["noise_seed"] = 2**64 - 2
    assert run(prompt).body["seed"] == 2**32 - 2


@pytest.mark.parametrize(("text", "sent"), [
    ("a red barn", "a red barn"),
    ("a \\(red\\) barn", "a (red) barn"),  # escaped brackets are text
    ("a (red:1.0) barn", "a red barn"),  # weight 1: ComfyUI's tokens are the plain words
    ("a [red] barn", "a [red] barn"),  # square brackets are text in ComfyUI
])
def test_prompts_without_weights_are_plain(text: str, sent: str) -> None:
    prompt = stock("sd15_txt2img")
    prompt["6"]["inputs"]["text"] = text
    body = run(prompt).body
    assert (body["prompt"], body["negative_prompt"]) == (sent, "bad hands")
    assert "prompt_syntax" not in body


@pytest.mark.parametrize(("text", "sent"), [
    ("a (red:1.3) barn", "a (red:1.3) barn"),
    ("((old))", "(old:1.2100000000000002)"),  # (x) is x1.1, nested
    ("((old:1.5))", "(old:1.5)"),  # an explicit weight replaces the brackets' own in ComfyUI
    ("(a [b]:0.5), c", "(a \\[b\\]:0.5), c"),  # A1111's [..] would weigh: escaped
    ("(tiny:0.00001)", "(tiny:0.00001)"),  # written out, never as 1e-05
    ("(x:y)", "(x:y:1.1)"),  # a colon that is no weight stays text
])
def test_weighted_prompts_are_sent_in_slotqs_weighted_syntax(text: str, sent: str) -> None:
    prompt = stock("sd15_txt2img")
    prompt["6"]["inputs"]["text"] = text
    prompt["7"]["inputs"]["text"] = "bad (hands)"
    body = run(prompt).body
    assert body["prompt"] == sent
    assert body["negative_prompt"] == "bad (hands:1.1)"
    assert body["prompt_syntax"] == "weighted"


def test_a_plain_negative_beside_a_weighted_prompt_is_escaped() -> None:
    prompt = stock("sd15_txt2img")
    prompt["6"]["inputs"]["text"] = "(red:1.2)"
    prompt["7"]["inputs"]["text"] = "text \\(watermark\\) [logo]"
    assert run(prompt).body["negative_prompt"] == "text \\(watermark\\) \\[logo\\]"


def test_comfyuis_weights_written_out_read_back_alike() -> None:
    for text in ("a (b:1.2) ((c)) \\(d\\) (e:f:0.5) (g:5:) [h] (((i:0.3)))", "((((", "))))a((b", "(:)"):
        runs = graph.comfy_weights(text)
        merged = [(part, weight) for part, weight in runs if part]
        reread = graph.comfy_weights(graph.written(merged).replace("\\[", "[").replace("\\]", "]"))
        assert [(part, weight) for part, weight in reread if part] == [
            (part, 1.0 if weight == 1.0 else weight) for part, weight in merged]


@pytest.mark.parametrize("text", ["(x:1e400)", "(x:nan)", "(" * 33 + "x" + ")" * 33,
                                  "(" * 5000 + "x" + ")" * 5000, "a" * 8001])
def test_texts_slotq_cannot_weigh_are_refused(text: str) -> None:
    prompt = stock("sd15_txt2img")
    prompt["6"]["inputs"]["text"] = "(" * 32 + "x" + ")" * 32  # brackets 32 deep are read
    assert float(run(prompt).body["prompt"].removeprefix("(x:").removesuffix(")")) == pytest.approx(1.1**32)
    prompt["6"]["inputs"]["text"] = text  # weights past a float, nesting deeper than 32, or too long to read
    error = only_error(refused(prompt), "6")
    assert (error["type"], error["extra_info"]["input_name"]) == ("value_not_supported", "text")


def test_a_graph_of_more_than_1000_nodes_is_refused_unread() -> None:
    prompt = stock("sd15_txt2img")
    prompt |= {str(node): {"class_type": "PreviewImage", "inputs": {"images": ["8", 0]}}
               for node in range(100, 1100)}
    refusal = refused(prompt)
    assert (refusal.type, refusal.node_errors) == ("invalid_prompt", {})
    assert "1000" in refusal.message


# --- refusals ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [[], "a prompt", None, 3, [{"class_type": "KSampler"}]])
def test_a_prompt_that_is_not_an_object_of_nodes(prompt: Any) -> None:
    refusal = refused(prompt)
    assert (refusal.type, refusal.node_errors) == ("invalid_prompt", {})


def test_an_unknown_node_class_is_named() -> None:
    prompt = stock("sd15_txt2img")
    prompt["10"] = {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["6", 0],
                                                                     "conditioning_2": ["7", 0]}}
    prompt["3"]["inputs"]["positive"] = ["10", 0]
    refusal = refused(prompt)
    assert refusal.type == "invalid_prompt"
    assert refusal.node_errors["10"]["class_type"] == "ConditioningCombine"
    assert refusal.node_errors["10"]["dependent_outputs"] == ["9"]
    assert only_error(refusal, "10")["type"] == "node_not_supported"
    assert "ConditioningCombine" in refusal.message and "10" in refusal.details


def test_an_unknown_node_no_output_reaches_is_refused_too() -> None:
    prompt = stock("sd15_txt2img")
    prompt["30"] = {"class_type": "UpscaleModelLoader", "inputs": {"model_name": "4x.pth"}}
    refusal = refused(prompt)
    assert refusal.node_errors["30"]["class_type"] == "UpscaleModelLoader"
    assert refusal.node_errors["30"]["dependent_outputs"] == []


def put(node: str, name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(prompt: dict[str, Any]) -> None:
        prompt[node]["inputs"][name] = value
    return change


def drop(node: str, name: str | None = None) -> Callable[[dict[str, Any]], None]:
    def change(prompt: dict[str, Any]) -> None:
        if name is None:
            del prompt[node]
        else:
            del prompt[node]["inputs"][name]
    return change


Change = Callable[[dict[str, Any]], None]


def add(node: str, value: Any, *changes: Change) -> Change:
    def change(prompt: dict[str, Any]) -> None:
        prompt[node] = value
        for each in changes:
            each(prompt)
    return change


SECOND_SAMPLER = {"class_type": "KSampler", "inputs": {
    "seed": 1, "steps": 20, "cfg": 8, "sampler_name": "euler", "scheduler": "normal", "denoise": 1,
    "model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["5", 0]}}

# (fixture, change, the node named, its error's type)
REFUSALS: dict[str, tuple[str, Callable[[dict[str, Any]], None], str, str]] = {
    "node not an object": ("sd15_txt2img", add("3", "KSampler"), "3", "invalid_prompt"),
    "node without class_type": ("sd15_txt2img", add("3", {"inputs": {}}), "3", "invalid_prompt"),
    "inputs not an object": ("sd15_txt2img", add("5", {"class_type": "EmptyLatentImage", "inputs": [512]}),
                             "5", "invalid_prompt"),
    "link to a missing node": ("sd15_txt2img", put("3", "model", ["99", 0]), "3", "bad_linked_input"),
    "link to a missing output": ("sd15_txt2img", put("3", "model", ["4", 3]), "3", "bad_linked_input"),
    "link not a pair": ("sd15_txt2img", put("3", "model", ["4"]), "3", "bad_linked_input"),
    "link of a number id": ("sd15_txt2img", put("3", "model", [4, 0]), "3", "bad_linked_input"),
    "link of the wrong type": ("sd15_txt2img", put("3", "positive", ["4", 0]), "3", "return_type_mismatch"),
    "value where a link goes": ("sd15_txt2img", put("3", "model", "sd15"), "3", "invalid_input_type"),
    "link where a value goes": ("sd15_txt2img", put("3", "steps", ["4", 0]), "3", "return_type_mismatch"),
    "missing required input": ("sd15_txt2img", drop("3", "steps"), "3", "required_input_missing"),
    "missing filename_prefix": ("sd15_txt2img", drop("9", "filename_prefix"), "9", "required_input_missing"),
    "steps as text": ("sd15_txt2img", put("3", "steps", "20"), "3", "invalid_input_type"),
    "cfg as text": ("sd15_txt2img", put("3", "cfg", "8"), "3", "invalid_input_type"),
    "width not whole": ("sd15_txt2img", put("5", "width", 512.5), "5", "invalid_input_type"),
    "text not text": ("sd15_txt2img", put("6", "text", ["a"]), "6", "bad_linked_input"),
    "cfg infinite": ("sd15_txt2img", put("3", "cfg", float("inf")), "3", "invalid_input_type"),
    "steps below 1": ("sd15_txt2img", put("3", "steps", 0), "3", "value_smaller_than_min"),
    "too many images": ("sd15_txt2img", put("5", "batch_size", 5), "5", "value_bigger_than_max"),
    "cfg over slotq's": ("sd15_txt2img", put("3", "cfg", 31), "3", "value_bigger_than_max"),
    "scheduler not in list": ("sd15_txt2img", put("3", "scheduler", "exponential"), "3", "value_not_in_list"),
    "sampler not in list": ("sd15_txt2img", put("3", "sampler_name", "heun"), "3", "value_not_in_list"),
    "unknown checkpoint": ("sd15_txt2img", put("4", "ckpt_name", "v1-5-pruned-emaonly.safetensors"), "4",
                           "value_not_in_list"),
    "sampler pair without an equivalent": ("sd15_txt2img", put("3", "scheduler", "karras"), "3",
                                           "value_not_supported"),
    "denoise below 1 on an empty latent": ("sd15_txt2img", put("3", "denoise", 0.6), "3",
                                           "value_not_supported"),
    "denoise 0": ("img2img", put("3", "denoise", 0), "3", "value_not_supported"),
    "steps over the service's": ("sd15_txt2img", put("3", "steps", 101), "3", "value_bigger_than_max"),
    "a schedule over the service's": ("img2img", put("3", "denoise", 0.1), "3", "value_bigger_than_max"),
    "width over max_side": ("sd15_txt2img", put("5", "width", 1536), "5", "value_not_supported"),
    "width off the model's multiple": ("sd15_txt2img", put("5", "width", 516), "5", "value_not_supported"),
    "empty prompt": ("sd15_txt2img", put("6", "text", "  "), "6", "value_not_supported"),
    "prompt over 2000 characters": ("sd15_txt2img", put("6", "text", "a" * 2001), "6", "value_not_supported"),
    "two unrelated samplers": ("sd15_txt2img", add("13", SECOND_SAMPLER, add(
        "18", {"class_type": "VAEDecode", "inputs": {"samples": ["13", 0], "vae": ["4", 2]}}), add(
        "19", {"class_type": "SaveImage", "inputs": {"images": ["18", 0], "filename_prefix": "b"}})),
                               "19", "graph_not_supported"),
    "a sampler feeding nothing": ("sd15_txt2img", add("13", SECOND_SAMPLER), "13", "graph_not_supported"),
    "a preview of a hires graph's first pass": ("hires", add(
        "14", {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        add("15", {"class_type": "PreviewImage", "inputs": {"images": ["14", 0]}})),
                                                "15", "graph_not_supported"),
    "two different checkpoints": ("sd15_txt2img", add("14", {"class_type": "CheckpointLoaderSimple",
                                                             "inputs": {"ckpt_name": "sdxl.safetensors"}},
                                                      put("8", "vae", ["14", 2])),
                                  "14", "graph_not_supported"),
    "an output of an uploaded image": ("img2img", put("9", "images", ["10", 0]), "9", "graph_not_supported"),
    "a decoded latent no sampler made": ("sd15_txt2img", put("8", "samples", ["5", 0]), "8",
                                         "graph_not_supported"),
    "a cycle": ("lora_chain", put("10", "model", ["12", 0]), "10", "dependency_cycle"),
    "clip skip": ("sd15_txt2img", add("11", {"class_type": "CLIPSetLastLayer",
                                             "inputs": {"clip": ["4", 1], "stop_at_clip_layer": -2}},
                                      put("6", "clip", ["11", 0]), put("7", "clip", ["11", 0])),
                  "11", "value_smaller_than_min"),
    "LoRA strengths that differ": ("lora_chain", put("10", "strength_clip", 0.4), "10",
                                   "value_not_supported"),
    "unknown LoRA": ("lora_chain", put("10", "lora_name", "other.safetensors"), "10", "value_not_in_list"),
    "a LoRA's CLIP bypassed": ("lora_chain", put("6", "clip", ["4", 1]), "10", "graph_not_supported"),
    "a LoRA on the text encoder alone": ("lora_chain", put("12", "model", ["4", 0]), "10",
                                         "graph_not_supported"),
    "a missing upload": ("img2img", put("10", "image", "other.png"), "10", "custom_validation_failed"),
    "an output image named": ("img2img", put("10", "image", "example.png [output]"), "10",
                              "custom_validation_failed"),
    "an upload that is no image": ("img2img", put("10", "image", "notes.txt"), "10", "invalid_image"),
    "KSamplerAdvanced stopping early": ("sdxl_txt2img", put("10", "end_at_step", 20), "10",
                                        "value_not_supported"),
    "KSamplerAdvanced leaving noise": ("sdxl_txt2img", put("10", "return_with_leftover_noise", "enable"),
                                       "10", "value_not_in_list"),
    "Flux with CFG": ("flux_txt2img", add("22", {"class_type": "CFGGuider", "inputs": {
        "model": ["30", 0], "positive": ["26", 0], "negative": ["6", 0], "cfg": 3.5}}),
                      "22", "value_not_supported"),
    "Flux with a sampler it does not run": ("flux_txt2img", add(
        "16", {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "dpmpp_2m"}},
        put("17", "scheduler", "karras")), "16", "value_not_supported"),
    "Flux side off its multiple": ("flux_txt2img", add(
        "27", {"class_type": "EmptySD3LatentImage",
               "inputs": {"width": 1000, "height": 1024, "batch_size": 1}},
        put("30", "width", 1000)), "27", "value_not_supported"),
    "Flux shifted otherwise": ("flux_txt2img", put("30", "max_shift", 1.25), "30", "value_not_supported"),
    "Flux at 8-bit weights": ("flux_txt2img", put("12", "weight_dtype", "fp8_e4m3fn"), "12",
                              "value_not_in_list"),
    "Flux with another text encoder": ("flux_txt2img", put("11", "clip_name2", "long_clip.safetensors"), "11",
                                       "value_not_in_list"),
    "an SD model in UNETLoader": ("flux_txt2img", put("12", "unet_name", "sd15.safetensors"), "12",
                                  "value_not_in_list"),
    "hires upscaled otherwise": ("hires", put("10", "upscale_method", "nearest-exact"), "10",
                                 "value_not_in_list"),
    "hires with another prompt": ("hires", put("11", "positive", ["7", 0]), "11", "graph_not_supported"),
    "hires with another sampler": ("hires", put("11", "sampler_name", "euler"), "11", "graph_not_supported"),
    "hires not larger": ("hires", put("10", "scale_by", 1.0), "10", "value_not_supported"),
    "unknown ControlNet": ("controlnet", put("12", "control_net_name", "depth.safetensors"), "12",
                           "value_not_in_list"),
    "a ControlNet on one prompt": ("controlnet", put("3", "negative", ["7", 0]), "11", "graph_not_supported"),
    "a ControlNet acting nowhere": ("controlnet", put("11", "end_percent", 0.0), "11", "value_not_supported"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_node(case: str) -> None:
    fixture, change, node, kind = REFUSALS[case]
    uploads = {"example.png": png(), "edges.png": png(), "notes.txt": b"not an image"}
    assert run(stock(fixture), uploads).body  # the graph as it stands maps
    prompt = stock(fixture)
    change(prompt)
    refusal = refused(prompt, uploads)
    assert node in refusal.node_errors, refusal.node_errors
    entry = refusal.node_errors[node]
    assert kind in [error["type"] for error in entry["errors"]], entry
    sent = prompt[node]
    assert entry["class_type"] == (sent.get("class_type", "") if isinstance(sent, dict) else "")
    assert all(set(error) == {"type", "message", "details", "extra_info"} for error in entry["errors"])
    assert f" {node}: " in str(refusal)  # the message names the node


def test_a_graph_without_outputs() -> None:
    prompt = stock("sd15_txt2img")
    del prompt["9"]
    refusal = refused(prompt)
    assert (refusal.type, refusal.message) == ("prompt_no_outputs", "Prompt has no outputs")
    assert refusal.node_errors == {}
    assert refused({}).type == "prompt_no_outputs"


def test_every_bad_input_of_a_graph_is_named_at_once() -> None:
    prompt = stock("sd15_txt2img")
    prompt["3"]["inputs"] |= {"steps": "20", "cfg": -1}
    prompt["5"]["inputs"]["batch_size"] = 9
    refusal = refused(prompt)
    assert sorted(error["extra_info"]["input_name"] for error in refusal.node_errors["3"]["errors"]) == [
        "cfg", "steps"]
    assert [error["type"] for error in refusal.node_errors["5"]["errors"]] == ["value_bigger_than_max"]
    assert refusal.envelope() == {"error": {"type": "prompt_outputs_failed_validation",
                                            "message": "Prompt outputs failed validation",
                                            "details": refusal.details, "extra_info": {}},
                                  "node_errors": refusal.node_errors}


def test_a_lora_of_strength_0_is_left_out_as_comfyui_leaves_it() -> None:
    prompt = stock("lora_chain")
    prompt["10"]["inputs"] |= {"strength_model": 0, "strength_clip": 0}
    prompt["6"]["inputs"]["clip"] = ["4", 1]  # a loader that acts nowhere may be bypassed
    assert run(prompt).body["loras"] == [{"name": "style", "scale": -0.5}]


def test_clip_set_last_layer_at_minus_1_changes_nothing() -> None:
    prompt = stock("sd15_txt2img")
    prompt["11"] = {"class_type": "CLIPSetLastLayer", "inputs": {"clip": ["4", 1], "stop_at_clip_layer": -1}}
    prompt["6"]["inputs"]["clip"] = prompt["7"]["inputs"]["clip"] = ["11", 0]
    assert run(prompt).body == run(stock("sd15_txt2img")).body


def test_checkpoint_names_with_or_without_their_extension() -> None:
    for name in ("sd15", "sd15.safetensors", "sd15.ckpt", "sd15.SAFETENSORS"):
        prompt = stock("sd15_txt2img")
        prompt["4"]["inputs"]["ckpt_name"] = name
        assert run(prompt).body["model"] == "sd15"
    refusal = refused(stock("sd15_txt2img") | {"4": {"class_type": "CheckpointLoaderSimple",
                                                     "inputs": {"ckpt_name": "sd15.png"}}})
    assert "sd15.safetensors" in only_error(refusal, "4")["details"]  # the refusal lists what is served


def test_two_outputs_of_one_sampler_are_both_outputs_in_id_order() -> None:
    prompt = stock("sd15_txt2img")
    prompt["10"] = {"class_type": "PreviewImage", "inputs": {"images": ["8", 0]}}
    mapped = run(prompt)
    assert mapped.body == run(stock("sd15_txt2img")).body
    assert mapped.outputs == [Output("9", "SaveImage", "ComfyUI", "output"),
                              Output("10", "PreviewImage", "ComfyUI_temp", "temp")]


def test_ksampler_advanced_from_a_start_step_on_an_image() -> None:
    prompt = stock("img2img")
    prompt["3"] = {"class_type": "KSamplerAdvanced", "inputs": {
        "add_noise": "enable", "noise_seed": 3, "steps": 30, "cfg": 8, "sampler_name": "dpmpp_2m",
        "scheduler": "normal", "start_at_step": 9, "end_at_step": 10000,
        "return_with_leftover_noise": "disable",
        "model": ["14", 0], "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["12", 0]}}
    body = run(prompt, {"example.png": png()}).body
    assert (body["steps"], int(30 * body["strength"])) == (30, 21)


# --- the node catalog --------------------------------------------------------------------------------

def test_object_info_lists_the_served_models_for_open_webui() -> None:
    info = nodes.object_info(MODELS, ["detail", "style"], ["canny"])
    checkpoints = info["CheckpointLoaderSimple"]["input"]["required"]["ckpt_name"][0]
    assert isinstance(checkpoints, list)  # Open WebUI reads ckpt_name[0] as the list
    assert checkpoints == ["sd15.safetensors", "sdxl.safetensors"]
    assert info["UNETLoader"]["input"]["required"]["unet_name"] == [["flux.safetensors"]]
    assert info["LoraLoader"]["input"]["required"]["lora_name"] == [["detail.safetensors",
                                                                     "style.safetensors"]]
    assert info["ControlNetLoader"]["input"]["required"]["control_net_name"] == [["canny.safetensors"]]
    assert info["DualCLIPLoader"]["input"]["required"]["clip_name1"][0] == list(nodes.ENCODER_FILES)
    json.dumps(info)


def test_object_info_lists_exactly_the_sampler_names_that_map() -> None:
    info = nodes.object_info(MODELS, [], [])
    names = [name for name, _ in graph.SAMPLERS]
    schedules = [schedule for _, schedule in graph.SAMPLERS]
    for node, field, wanted in (("KSampler", "sampler_name", names), ("KSampler", "scheduler", schedules),
                                ("KSamplerAdvanced", "sampler_name", names),
                                ("KSamplerSelect", "sampler_name", names),
                                ("BasicScheduler", "scheduler", schedules)):
        listed = info[node]["input"]["required"][field][0]
        assert sorted(listed) == sorted(set(wanted)) and len(listed) == len(set(wanted))
    assert "uni_pc" not in names and "karras" in schedules


def test_object_info_has_every_class_graph_maps_in_comfyuis_shape() -> None:
    info = nodes.object_info([SD15], [], [])
    assert list(info) == list(graph.CLASSES)
    for name, entry in info.items():
        assert entry["name"] == name and entry["display_name"]
        assert entry["output_node"] == (name in ("SaveImage", "PreviewImage"))
        assert len(entry["output"]) == len(entry["output_is_list"]) == len(entry["output_name"])
        assert {section: list(inputs) for section, inputs in entry["input"].items()} == entry["input_order"]
    assert info["KSampler"]["input"]["required"]["seed"] == ["INT", {"default": 0, "min": 0,
                                                                     "max": 2**64 - 1}]
    assert info["SaveImage"]["input"]["hidden"] == {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"}
    assert info["SamplerCustomAdvanced"]["output_name"] == ["output", "denoised_output"]
    assert info["ControlNetApplyAdvanced"]["input"]["optional"] == {"vae": ["VAE"]}
    assert info["UNETLoader"]["input"]["required"]["unet_name"] == [[]]  # no Flux model served


# --- any JSON at all ----------------------------------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                max_size=4), max_leaves=12)
FIXTURE_NAMES = sorted(path.stem for path in FIXTURES.glob("*.json"))
UPLOADS = {"example.png": png((96, 64)), "edges.png": png((64, 64)), "yosemite_inpaint_example.png": png(
    (64, 64), "RGBA"), "mask.png": b"\x89PNG garbage"}


def translated_or_refused(prompt: Any) -> None:
    try:
        mapped = graph.translate(prompt, MODELS, UPLOADS.get, SETTINGS)
    except GraphError as exc:
        json.dumps(exc.envelope())  # the envelope is JSON, whatever the graph held
        return
    assert mapped.body["prompt"] and mapped.order and mapped.outputs


@fuzzing(max_examples=300, deadline=None)
@given(JSON)
def test_any_json_is_refused_with_a_graph_error(prompt: Any) -> None:
    translated_or_refused(prompt)


@fuzzing(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(FIXTURE_NAMES), st.data())
def test_any_change_to_a_stock_graph_maps_or_is_refused(name: str, data: st.DataObject) -> None:
    prompt = stock(name)
    for _ in range(data.draw(st.integers(1, 3))):
        node = data.draw(st.sampled_from(sorted(prompt)))
        inputs = prompt[node]["inputs"]
        key = data.draw(st.sampled_from(sorted(inputs) + ["class_type", "extra"]))
        links = st.tuples(st.sampled_from(sorted(prompt) + ["99"]), st.integers(-1, 3)).map(list)
        value = data.draw(JSON | links | st.sampled_from(sorted(graph.CLASSES)))
        if key == "class_type":
            prompt[node]["class_type"] = value
        else:
            inputs[key] = value
    translated_or_refused(prompt)


@fuzzing(max_examples=300, deadline=None)
@given(st.data())
def test_any_graph_of_known_nodes_maps_or_is_refused(data: st.DataObject) -> None:
    ids = [str(each) for each in range(1, data.draw(st.integers(1, 8)) + 1)]
    prompt: dict[str, Any] = {}
    for node in ids:
        kind = data.draw(st.sampled_from(sorted(graph.CLASSES)))
        inputs = {}
        for name, declared in graph.CLASSES[kind].inputs.items():
            default = declared.options.get("default", declared.choices[0] if declared.choices else "sd15")
            inputs[name] = data.draw(st.tuples(st.sampled_from(ids), st.integers(0, 2)).map(list)
                                     | st.just(default) | JSON)
        prompt[node] = {"class_type": kind, "inputs": inputs}
    translated_or_refused(prompt)
