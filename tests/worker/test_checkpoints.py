"""Single-file checkpoints: written from the tiny models, loaded offline, the same weights and images;
a sidecar's VAE file in place of a model's own."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, DiffusionPipeline, FluxTransformer2DModel, UNet2DConditionModel
from diffusers.loaders.single_file_utils import (
    convert_flux_transformer_checkpoint_to_diffusers,
    convert_ldm_unet_checkpoint,
    convert_ldm_vae_checkpoint,
)
from huggingface_hub import constants as hub_constants
from safetensors.torch import load_file, save_file

from shared.contract.checkpoints import COMFY_PREFIX
from shared.contract.jobs import JobRequest
from shared.contract.models import Family
from shared.contract.settings import CHECKPOINT_CONFIGS, Settings
from worker.checkpoints import (
    CheckpointError,
    family_of_checkpoint,
    flux_to_diffusers,
    load_checkpoint,
    load_folder_model,
)
from worker.pipeline import ImagePipeline, load_pipeline
from worker.tiny.checkpoints import (
    flux_transformer_to_bfl,
    unet_to_ldm,
    vae_to_ldm,
    write_base,
    write_checkpoint,
    write_configs,
    write_gguf,
    write_vae,
)
from worker.tiny.model import ensure_tiny_model

FAMILIES: dict[str, Family] = {"tiny": "sd", "tiny-sdxl": "sdxl", "tiny-flux": "flux"}
Files = tuple[Path, Path, Path]  # a tiny model's diffusers folder, its single file, its configs
Pair = tuple[ImagePipeline, ImagePipeline]  # a tiny model loaded from its folder and from its file
COMPONENTS = ("unet", "transformer", "vae", "text_encoder", "text_encoder_2")
VAE_SCALE = 1.1  # the sidecar's VAE file: the tiny model's VAE, its weights scaled
Tensors = dict[str, torch.Tensor]
Module = TypeVar("Module", bound=torch.nn.Module)
SEED = 7
REQUEST = JobRequest(prompt="a lighthouse at dusk", negative_prompt="fog", width=64, height=64, steps=2,
                     seed=SEED)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Files]:
    """Each tiny model's diffusers folder, its single file, and its configs without weights."""
    root = tmp_path_factory.mktemp("checkpoints")
    made = {}
    for name in FAMILIES:
        folder = ensure_tiny_model(root / "cache", name)
        # Configs only, as a real configuration source is: weights missing from the file cannot be
        # quietly taken from the folder (diffusers falls back to a component's folder weights). A Flux
        # file holds its transformer alone: its base is the folder less the transformer's weights.
        if FAMILIES[name] == "flux":
            configs = write_base(folder, root / f"{name}-base")
        else:
            configs = write_configs(folder, root / f"{name}-configs")
        made[name] = (folder, write_checkpoint(folder, root / f"{name}.safetensors"), configs)
    return made


def _realigned(pipe: DiffusionPipeline) -> DiffusionPipeline:
    """The pipeline with its weights copied to fresh memory. The CPU's matrix kernels round by a
    weight's alignment in memory, and a file's weights lie at other offsets than a folder's: equal
    weights at unequal offsets can make images a bit apart in their last bits."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            _realigned_module(component)
    return pipe


def _realigned_module(module: Module) -> Module:
    """The module with its weights copied to fresh memory (see _realigned)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        tensor.data = tensor.data.clone()
    return module


def _settings(model: str | Path, cache_dir: Path, configs: dict[Family, str] | None = None) -> Settings:
    """A worker's settings on the CPU in float32, one thread (no calibration at warm-up)."""
    return Settings(model=str(model), cache_dir=cache_dir, device="cpu", dtype="float32", torch_threads=1,
                    checkpoint_configs=configs or dict(CHECKPOINT_CONFIGS))


@pytest.fixture(scope="module")
def loaded(files: dict[str, Files], offline: None) -> dict[str, Pair]:
    """Each tiny model loaded by the worker twice: from its diffusers folder and from its single file."""
    pairs = {}
    for name, family in FAMILIES.items():
        folder, checkpoint, configs = files[name]
        cache_dir = folder.parent
        from_folder = load_pipeline(_settings(name, cache_dir))
        from_file = load_pipeline(_settings(checkpoint, cache_dir, {family: str(configs)}))
        _realigned(from_folder.pipe)
        _realigned(from_file.pipe)
        pairs[name] = (from_folder, from_file)
    return pairs


names = pytest.mark.parametrize("name", list(FAMILIES))


@names
def test_the_family_is_read_from_the_keys(name: str, files: dict[str, Files]) -> None:
    assert family_of_checkpoint(files[name][1]) == FAMILIES[name]


def test_a_flux_file_holds_its_transformer_alone_in_bfls_layout(files: dict[str, Files]) -> None:
    names = set(load_file(files["tiny-flux"][1]))
    assert {"double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight", "img_in.weight",
            "final_layer.adaLN_modulation.1.weight", "guidance_in.in_layer.weight"} <= names
    assert not any(name.startswith(("transformer_blocks.", "vae.", "text_encoder")) for name in names)


@names
def test_the_file_loads_the_folders_weights_exactly(name: str, loaded: dict[str, Pair]) -> None:
    from_folder, from_file = loaded[name]
    assert type(from_file.pipe) is type(from_folder.pipe)
    assert from_file.info.family == FAMILIES[name]
    compared = 0
    for component in COMPONENTS:
        if not hasattr(from_folder.pipe, component):
            continue
        expected = getattr(from_folder.pipe, component).state_dict()
        got = getattr(from_file.pipe, component).state_dict()
        assert sorted(got) == sorted(expected), component
        unequal = [key for key in expected if not torch.equal(got[key], expected[key])]
        assert not unequal, f"{component}: {unequal[:5]}"
        compared += 1
    assert compared == (3 if name == "tiny" else 4)  # SD has one text encoder; Flux: its transformer too


@names
def test_the_file_makes_the_folders_image(name: str, loaded: dict[str, Pair]) -> None:
    from_folder, from_file = loaded[name]
    (expected,), (got,) = from_folder.generate(REQUEST), from_file.generate(REQUEST)
    assert got.size == (64, 64)
    assert np.asarray(expected).std() > 0  # an image, not a blank
    assert np.array_equal(np.asarray(got), np.asarray(expected))


class _Trap:
    """Unpickling this touches a marker file: what a malicious .ckpt could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".bin"])
def test_a_pickle_is_refused_and_never_unpickled(suffix: str, tmp_path: Path) -> None:
    marker, checkpoint = tmp_path / "unpickled", tmp_path / f"model{suffix}"
    checkpoint.write_bytes(pickle.dumps({"state_dict": _Trap(marker)}))
    with pytest.raises(CheckpointError, match="pickles, which can run code"):
        load_pipeline(_settings(checkpoint, tmp_path))
    with pytest.raises(CheckpointError, match="only .safetensors files are loaded"):
        family_of_checkpoint(checkpoint)
    (tmp_path / f"model{suffix}.json").write_text(json.dumps({"family": "sd"}))  # a sidecar forcing a family
    with pytest.raises(CheckpointError, match="pickles, which can run code"):
        load_folder_model(checkpoint, dict(CHECKPOINT_CONFIGS), torch.float32)
    assert not marker.exists()
    pickle.loads(checkpoint.read_bytes())  # the file is a live trap: unpickled, it leaves the marker
    assert marker.exists()


def test_a_diffusers_folder_with_pickled_weights_is_refused_unopened(model_cache: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder's model loads safetensors only: a part whose weights are a .bin never reaches torch.load
    (whose weights_only would be the one defence left). The folder's listing offers no such model."""
    folder = tmp_path / "pickled"
    shutil.copytree(ensure_tiny_model(model_cache, "tiny"), folder)
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    torch.save(load_file(str(weights)), folder / "unet" / "diffusion_pytorch_model.bin")
    weights.unlink()
    unpickled: list[object] = []
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: unpickled.append(args))
    with pytest.raises(OSError, match="no file named diffusion_pytorch_model.safetensors"):
        load_folder_model(folder, dict(CHECKPOINT_CONFIGS), torch.float32)
    assert unpickled == []


def test_a_file_of_no_known_family_is_refused(tmp_path: Path) -> None:
    checkpoint = tmp_path / "lora.safetensors"
    save_file({"lora_unet_down.lora_up.weight": torch.zeros(2, 2)}, str(checkpoint))
    with pytest.raises(CheckpointError, match="not an SD or SDXL checkpoint .* nor a FLUX.1 transformer"):
        family_of_checkpoint(checkpoint)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        family_of_checkpoint(garbage)
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        family_of_checkpoint(tmp_path / "missing.safetensors")


@pytest.mark.parametrize(("left_out", "message"), [
    (".decoder.up.0.block.0.", "lacks weights of its UNet or VAE"),
    (".text_model.encoder.layers.1.", r"lacks \d+ weights of the text_encoder, such as encoder.layers.1."),
])
def test_a_file_that_lacks_weights_is_refused(left_out: str, message: str, files: dict[str, Files],
                                              tmp_path: Path, offline: None) -> None:
    _, checkpoint, configs = files["tiny"]
    state = load_file(checkpoint)
    lacking = {name: tensor for name, tensor in state.items() if left_out not in name}
    assert len(lacking) < len(state)
    save_file(lacking, str(tmp_path / "pruned.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / "pruned.safetensors", {"sd": str(configs)}, torch.float32)


def test_a_hub_id_is_read_from_the_local_cache_only(files: dict[str, Files], tmp_path: Path,
                                                    offline: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # A hub cache holding one repository's configs, as `hf download` leaves it.
    commit = "0" * 40
    repository = tmp_path / "hub" / "models--slotq--tiny-sd"
    (repository / "refs").mkdir(parents=True)
    (repository / "refs" / "main").write_text(commit)
    shutil.copytree(files["tiny"][2], repository / "snapshots" / commit)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    pipe = load_checkpoint(files["tiny"][1], {"sd": "slotq/tiny-sd"}, torch.float32)
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    # Not in the cache: refused at once with the command that fetches it, where diffusers would download.
    with pytest.raises(CheckpointError, match="hf download slotq/not-cached"):
        load_checkpoint(files["tiny"][1], {"sd": "slotq/not-cached"}, torch.float32)


def test_the_configs_setting_reads_family_equals_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTQ_CHECKPOINT_CONFIGS", " sdxl=/configs/sdxl , sd=org/sd ")
    assert Settings().checkpoint_configs == {"sd": "org/sd", "sdxl": "/configs/sdxl",
                                             "flux": "black-forest-labs/FLUX.1-dev",
                                             "wan": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
                                             "wan_i2v": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                                             "ltx": "Lightricks/LTX-Video"}
    monkeypatch.setenv("SLOTQ_CHECKPOINT_CONFIGS", '{"sd": "org/sd"}')  # JSON, as slotq/harness.py passes it
    assert Settings().checkpoint_configs["sd"] == "org/sd"
    monkeypatch.delenv("SLOTQ_CHECKPOINT_CONFIGS")
    assert Settings().checkpoint_configs["sdxl"] == "stabilityai/stable-diffusion-xl-base-1.0"
    for bad in ("sd3=org/x", "sd", "sd="):
        monkeypatch.setenv("SLOTQ_CHECKPOINT_CONFIGS", bad)
        with pytest.raises(ValueError, match="is not family=source"):
            Settings()


def _equal(left: Tensors, right: Tensors) -> bool:
    return sorted(left) == sorted(right) and all(torch.equal(left[key], right[key]) for key in left)


def test_the_unet_mapping_is_generic_over_block_counts() -> None:
    # Three levels of two layers, attention at the bottom two and in the middle: not the tiny shape.
    config: dict[str, Any] = dict(
        block_out_channels=(8, 16, 16), layers_per_block=2, norm_num_groups=8, cross_attention_dim=8,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=2)
    torch.manual_seed(0)
    state = UNet2DConditionModel(**config).state_dict()
    ldm = {f"model.diffusion_model.{name}": tensor for name, tensor in unet_to_ldm(state, config).items()}
    assert _equal(convert_ldm_unet_checkpoint(ldm, config), state)


def test_the_vae_mapping_is_generic_over_block_counts() -> None:
    # Three levels of two layers with mid-block attention, whose projections LDM keeps as 1x1 convolutions.
    config: dict[str, Any] = dict(
        block_out_channels=(4, 8, 8), layers_per_block=2, norm_num_groups=4, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3)
    torch.manual_seed(0)
    state = AutoencoderKL(**config).state_dict()
    ldm = {f"first_stage_model.{name}": tensor for name, tensor in vae_to_ldm(state, config).items()}
    assert ldm["first_stage_model.encoder.mid.attn_1.q.weight"].ndim == 4
    assert _equal(convert_ldm_vae_checkpoint(ldm, config), state)


def _fake_flux_width(layers: int, single_layers: int) -> Tensors:
    """A diffusers Flux transformer's names at FLUX.1's width (3072) and random values, each weight one
    column wide: the conversions split and join along the first dimension only."""
    with torch.device("meta"):  # names and shapes, no memory
        model = FluxTransformer2DModel(
            num_layers=layers, num_single_layers=single_layers, num_attention_heads=2, attention_head_dim=16,
            axes_dims_rope=(4, 6, 6), joint_attention_dim=8, pooled_projection_dim=8, guidance_embeds=True)
    widen = 3072 // 32  # FLUX.1's width over this one's (2 heads of 16)
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(tensor.shape[0] * widen, 1, generator=generator)
            for name, tensor in model.state_dict().items()}


def test_the_flux_mapping_is_diffusers_at_flux_width_and_generic_over_block_counts() -> None:
    # diffusers' converter reads FLUX.1's width only; at that width both directions here are its own.
    state = _fake_flux_width(layers=2, single_layers=3)
    bfl = flux_transformer_to_bfl(state)
    assert "double_blocks.1.txt_attn.qkv.bias" in bfl and "single_blocks.2.linear1.weight" in bfl
    assert _equal(convert_flux_transformer_checkpoint_to_diffusers(dict(bfl)), state)
    assert _equal(flux_to_diffusers(bfl), state)
    assert _equal(flux_to_diffusers({COMFY_PREFIX + name: tensor for name, tensor in bfl.items()}), state)


def test_a_flux_file_under_comfyuis_prefix_loads_the_same_transformer(files: dict[str, Files], tmp_path: Path,
                                                                      offline: None) -> None:
    folder, checkpoint, base = files["tiny-flux"]
    prefixed = tmp_path / "comfy.safetensors"
    save_file({COMFY_PREFIX + name: tensor for name, tensor in load_file(checkpoint).items()}, str(prefixed))
    assert family_of_checkpoint(prefixed) == "flux"
    pipe = load_checkpoint(prefixed, {"flux": str(base)}, torch.float32)
    expected = DiffusionPipeline.from_pretrained(folder).transformer.state_dict()
    assert _equal(pipe.transformer.state_dict(), expected)


@pytest.mark.parametrize(("extra", "message"), [
    ({"vae.decoder.conv_in.weight": torch.zeros(1)}, "a full Flux checkpoint"),
    ({"text_encoders.clip_l.transformer.text_model.final_layer_norm.weight": torch.zeros(1)},
     "only transformer-only FLUX.1 files are loaded"),
])
def test_a_flux_file_with_more_than_its_transformer_is_refused(extra: Tensors, message: str, tmp_path: Path,
                                                                files: dict[str, Files]) -> None:
    _, checkpoint, base = files["tiny-flux"]
    full = tmp_path / "full.safetensors"
    save_file({**load_file(checkpoint), **extra}, str(full))
    assert family_of_checkpoint(full) == "flux"
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(full, {"flux": str(base)}, torch.float32)


def test_a_flux_base_without_its_other_weights_is_refused(files: dict[str, Files], tmp_path: Path,
                                                          offline: None) -> None:
    _, checkpoint, base = files["tiny-flux"]
    configs_only = write_configs(base, tmp_path / "configs-only")
    with pytest.raises(CheckpointError, match="lacks weights of its text encoders or VAE"):
        load_checkpoint(checkpoint, {"flux": str(configs_only)}, torch.float32)


def test_a_gguf_flux_file_loads_its_transformer_quantized(files: dict[str, Files], tmp_path: Path,
                                                          offline: None) -> None:
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    folder, _, base = files["tiny-flux"]
    path = write_gguf(folder, tmp_path / "flux.gguf")
    assert family_of_checkpoint(path) == "flux"
    pipe = _realigned(load_checkpoint(path, {"flux": str(base)}, torch.float32))
    transformer = pipe.transformer.state_dict()
    quantized = {name: dequantize_gguf_tensor(weight).float() for name, weight in transformer.items()
                 if isinstance(weight, GGUFParameter)}
    assert {"transformer_blocks.0.attn.to_q.weight", "single_transformer_blocks.0.proj_mlp.weight",
            "norm_out.linear.weight"} <= set(quantized)
    # The folder's transformer: its matrices through Q8_0 and back (diffusers dequantizes to float16
    # first), its other weights as they are.
    reference = DiffusionPipeline.from_pretrained(folder)
    state, q8 = reference.transformer.state_dict(), gguf.GGMLQuantizationType.Q8_0
    for name, weight in quantized.items():
        through_q8 = gguf.quants.dequantize(gguf.quants.quantize(state[name].numpy(), q8), q8)
        assert torch.allclose(weight, torch.from_numpy(through_q8), rtol=1e-3, atol=1e-5), name
    assert _equal({name: weight for name, weight in transformer.items() if name not in quantized},
                  {name: weight for name, weight in state.items() if name not in quantized})
    image = _image(pipe)
    assert not np.array_equal(image, _image(_realigned(reference)))  # quantized: not the folder's image
    reference.transformer.load_state_dict(state | quantized)
    assert np.array_equal(image, _image(_realigned(reference)))  # the folder's, with those weights


# --- a VAE file named by a model's sidecar -----------------------------------------------------------

def _image(pipe: DiffusionPipeline) -> np.ndarray:
    generator = torch.Generator().manual_seed(SEED)
    return pipe(prompt=REQUEST.prompt, width=64, height=64, num_inference_steps=2, generator=generator,
                output_type="np").images[0]


def _scaled_vae(folder: Path) -> AutoencoderKL:
    """The folder's VAE with its weights scaled by hand: what the sidecar's VAE file holds."""
    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae")
    vae.load_state_dict({name: tensor * VAE_SCALE for name, tensor in vae.state_dict().items()})
    return vae


@pytest.mark.parametrize(("name", "kind"), [("tiny", "file"), ("tiny", "folder"), ("tiny-flux", "file")])
def test_a_sidecars_vae_file_replaces_the_models_own(name: str, kind: str, files: dict[str, Files],
                                                     tmp_path: Path, offline: None) -> None:
    folder, checkpoint, configs = files[name]
    model = tmp_path / ("model.safetensors" if kind == "file" else "model")
    if kind == "file":
        shutil.copy(checkpoint, model)
    else:
        shutil.copytree(folder, model)
    config_sources: dict[Family, str] = {FAMILIES[name]: str(configs)}
    own = _realigned(load_folder_model(model, config_sources, torch.float32))
    assert _equal(own.vae.state_dict(), AutoencoderKL.from_pretrained(folder, subfolder="vae").state_dict())

    vae_file = write_vae(folder, tmp_path / "vaes" / "other.safetensors", scale=VAE_SCALE)
    # Named relative to the sidecar's folder, or absolute.
    named = "vaes/other.safetensors" if kind == "file" else str(vae_file)
    (tmp_path / "model.json").write_text(json.dumps({"vae": named}))
    replaced = _realigned(load_folder_model(model, config_sources, torch.float32))
    assert _equal(replaced.vae.state_dict(), _scaled_vae(folder).state_dict())
    assert not np.array_equal(_image(replaced), _image(own))  # the VAE file changed the image
    own.vae = _realigned_module(_scaled_vae(folder))
    assert np.array_equal(_image(replaced), _image(own))  # as the VAE assigned by hand makes it


@pytest.mark.parametrize(("vae", "message"), [
    ("absent.safetensors", "no such file"),
    ("trap.ckpt", "pickles, which can run code when loaded: never opened"),
])
def test_a_missing_or_pickled_vae_file_is_refused_and_never_unpickled(vae: str, message: str,
                                                                       files: dict[str, Files],
                                                                       tmp_path: Path) -> None:
    marker, model = tmp_path / "unpickled", tmp_path / "model.safetensors"
    (tmp_path / "trap.ckpt").write_bytes(pickle.dumps({"state_dict": _Trap(marker)}))
    shutil.copy(files["tiny"][1], model)
    (tmp_path / "model.json").write_text(json.dumps({"vae": vae}))
    with pytest.raises(CheckpointError, match=message):
        load_folder_model(model, {"sd": str(files["tiny"][2])}, torch.float32)
    assert not marker.exists()
