"""Wan 2.1 and LTX-Video single files: a tiny Wan transformer written in Wan's own layout (Wan-AI's
release files, ComfyUI's, under ComfyUI's prefix or not), or a tiny LTX-Video transformer in LTX-Video's
(with its VAE beside it or not, as Lightricks' files hold them), is offered as a model of its family and
loads, the rest from its base, to the frames its diffusers folder makes; a truncated or wrong one is
refused, and the listing goes on."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKLLTXVideo,
    DiffusionPipeline,
    LTXImageToVideoPipeline,
    LTXVideoTransformer3DModel,
    WanTransformer3DModel,
)
from diffusers.loaders.single_file_utils import (
    convert_ltx_transformer_checkpoint_to_diffusers,
    convert_ltx_vae_checkpoint_to_diffusers,
    convert_wan_transformer_to_diffusers,
)
from safetensors.torch import load_file, save_file

from shared.contract import checkpoints, folders
from shared.contract.checkpoints import (
    COMFY_PREFIX,
    LTX_BLOCK,
    LTX_TOP,
    LTX_VAE_PREFIX,
    FolderModel,
    UnusableModelError,
    check_ltx_file,
    check_wan_transformer,
    family_of_names,
    folder_models,
)
from shared.contract.models import Family
from tests.conftest import start_image
from worker.checkpoints import CheckpointError, family_of_checkpoint, load_checkpoint, load_folder_model
from worker.tiny.checkpoints import (
    ltx_vae_to_original,
    wan_transformer_to_original,
    write_base,
    write_checkpoint,
    write_configs,
    write_gguf,
    write_ltx_file,
    write_wan_transformer,
)
from worker.tiny.video import ensure_tiny_video_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODELS: dict[str, Family] = {"tiny-wan": "wan", "tiny-wan-i2v": "wan_i2v"}
SIDE, FRAMES, STEPS, SEED = 64, 9, 2, 7
PROMPT = "a lighthouse at dusk, waves breaking"
Tensors = dict[str, torch.Tensor]
Files = tuple[Path, Path, Path]  # a tiny model's diffusers folder, its transformer's file, its base


@pytest.fixture(scope="module")
def files(model_cache: Path, cache: Path) -> dict[str, Files]:
    """Each tiny Wan model's diffusers folder, its transformer as a file in Wan's layout, and its base:
    the folder less the transformer's weights, which cannot quietly lend them."""
    made = {}
    for name in MODELS:
        folder = ensure_tiny_video_model(model_cache, name)
        made[name] = (folder, write_wan_transformer(folder, cache / f"{name}.safetensors"),
                      write_base(folder, cache / f"{name}-base"))
    return made


def _equal(left: Tensors, right: Tensors) -> bool:
    return sorted(left) == sorted(right) and all(
        left[key].dtype == right[key].dtype and torch.equal(left[key], right[key]) for key in left)


def _realigned(pipe: DiffusionPipeline) -> DiffusionPipeline:
    """The pipeline with its weights copied to fresh memory: the CPU's kernels round by a weight's
    alignment, and a file's weights lie at other offsets than a folder's (as in test_checkpoints.py)."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            for tensor in [*component.parameters(), *component.buffers()]:
                tensor.data = tensor.data.clone()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _frames(pipe: DiffusionPipeline, family: Family) -> np.ndarray:
    """The pipeline's clip: 9 frames of 64x64 in 2 steps, from a start image for image-to-video."""
    image = {"image": start_image(SIDE, SIDE)} if family == "wan_i2v" else {}
    return pipe(prompt=PROMPT, height=SIDE, width=SIDE, num_frames=FRAMES, num_inference_steps=STEPS,
                generator=torch.Generator().manual_seed(SEED), output_type="np", **image).frames[0]


def _prefixed(path: Path, destination: Path, prefix: str = COMFY_PREFIX) -> Path:
    """The file with its names under ComfyUI's prefix, as ComfyUI saves a model."""
    save_file({prefix + name: tensor for name, tensor in load_file(path).items()}, str(destination))
    return destination


# --- the layout -----------------------------------------------------------------------------------

def test_the_file_holds_the_transformer_alone_in_wans_layout(files: dict[str, Files]) -> None:
    for name in MODELS:
        names = set(load_file(files[name][1]))
        assert {"patch_embedding.weight", "blocks.1.self_attn.q.weight", "blocks.0.cross_attn.norm_k.weight",
                "blocks.0.norm3.weight", "blocks.0.ffn.2.bias", "blocks.0.modulation",
                "time_projection.1.weight", "head.head.weight", "head.modulation"} <= names
        assert not any(name.startswith(("condition_embedder.", "vae.", "text_encoder")) or ".attn1." in name
                       for name in names)
        assert any(name.startswith("img_emb.proj.") for name in names) == (MODELS[name] == "wan_i2v")
        assert any(".k_img." in name for name in names) == (MODELS[name] == "wan_i2v")
        assert family_of_checkpoint(files[name][1]) == MODELS[name]


def test_the_mapping_is_the_inverse_of_diffusers_with_wan_21s_image_keys() -> None:
    """Wan 2.1's image-to-video blocks have the image's keys and values (k_img, v_img), here on a model
    of other sizes than the tiny one's."""
    torch.manual_seed(0)
    state = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=4, in_channels=36, out_channels=16,
        text_dim=8, freq_dim=16, ffn_dim=16, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", image_dim=8, added_kv_proj_dim=8).state_dict()
    original = wan_transformer_to_original(state)
    assert {"blocks.1.cross_attn.k_img.weight", "blocks.1.cross_attn.v_img.bias",
            "blocks.1.cross_attn.norm_k_img.weight", "img_emb.proj.4.bias"} <= set(original)
    for prefix in ("", COMFY_PREFIX):
        prefixed = {prefix + name: tensor for name, tensor in original.items()}
        assert family_of_names(prefixed) == "wan_i2v"
        check_wan_transformer(Path("i2v.safetensors"), prefixed)  # whole: not refused
        assert _equal(convert_wan_transformer_to_diffusers(prefixed), state)


# --- the folder of models, read without torch ------------------------------------------------------

def _read_afresh(models_dir: Path) -> dict[str, FolderModel]:
    checkpoints.listing.forget()
    folders.forget_parsed()
    return folder_models(models_dir)


def test_the_folder_offers_wan_files_and_refuses_broken_ones(files: dict[str, Files], tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    wan, i2v = files["tiny-wan"][1], files["tiny-wan-i2v"][1]
    shutil.copy(wan, tmp_path / "wan.safetensors")
    _prefixed(wan, tmp_path / "wan-comfy.safetensors")
    shutil.copy(i2v, tmp_path / "wan-i2v.safetensors")
    _prefixed(i2v, tmp_path / "wan-i2v-comfy.safetensors")
    whole = load_file(wan)
    (tmp_path / "cut.safetensors").write_bytes(wan.read_bytes()[:-100])  # an interrupted download
    save_file({name: tensor for name, tensor in whole.items() if name != "blocks.1.ffn.2.bias"},
              str(tmp_path / "lacking.safetensors"))
    save_file({name: tensor for name, tensor in whole.items() if not name.startswith("blocks.0.")},
              str(tmp_path / "gap.safetensors"))
    save_file({**whole, "vae.decoder.conv_in.weight": torch.zeros(1)}, str(tmp_path / "full.safetensors"))
    # Wan 2.1's first-last-frame model: its image embedder has a position embedding diffusers' converter
    # does not map.
    save_file({**load_file(i2v), "img_emb.emb_pos": torch.zeros(1)}, str(tmp_path / "flf2v.safetensors"))
    save_file({**whole, **{COMFY_PREFIX + name: tensor.clone() for name, tensor in whole.items()}},
              str(tmp_path / "twice.safetensors"))
    with caplog.at_level(logging.WARNING):
        models = _read_afresh(tmp_path)
    assert {name: model.family for name, model in models.items()} == {
        "wan": "wan", "wan-comfy": "wan", "wan-i2v": "wan_i2v", "wan-i2v-comfy": "wan_i2v"}
    assert models["wan-comfy"].size == (tmp_path / "wan-comfy.safetensors").stat().st_size
    logged = caplog.text
    for reason in ("cut.safetensors: not a readable safetensors file: truncated: its header gives",
                   "lacking.safetensors: not a whole Wan 2.1 transformer in Wan's layout: it lacks 1 of its "
                   "weights, such as blocks.1.ffn.2.bias",
                   "gap.safetensors: not a whole Wan transformer: it has blocks up to 1 but none numbered 0",
                   "full.safetensors: a Wan file with 1 weights outside a Wan 2.1 transformer, such as "
                   "vae.decoder.conv_in.weight",
                   "flf2v.safetensors: not a whole Wan 2.1 transformer in Wan's layout: it has 1 that no Wan "
                   "2.1 transformer has, such as img_emb.emb_pos",
                   "twice.safetensors: a Wan file holding weights twice"):
        assert reason in logged, reason


def test_a_sidecar_may_force_wan_i2v_but_not_a_flux_layout_nor_name_a_vae(
        files: dict[str, Files], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shutil.copy(files["tiny-wan"][1], tmp_path / "forced.safetensors")
    (tmp_path / "forced.json").write_text(json.dumps({"family": "wan_i2v"}))
    shutil.copy(files["tiny-wan"][1], tmp_path / "with-vae.safetensors")
    (tmp_path / "vaes").mkdir()
    save_file({"decoder.conv_in.weight": torch.zeros(1)}, str(tmp_path / "vaes" / "ae.safetensors"))
    (tmp_path / "with-vae.json").write_text(json.dumps({"vae": "vaes/ae.safetensors"}))
    flux = {f"double_blocks.0.img_attn.qkv.{kind}": torch.zeros(1) for kind in ("weight", "bias")}
    save_file(flux, str(tmp_path / "flux-as-wan.safetensors"))
    (tmp_path / "flux-as-wan.json").write_text(json.dumps({"family": "wan"}))
    with caplog.at_level(logging.WARNING):
        models = _read_afresh(tmp_path)
    assert {name: model.family for name, model in models.items()} == {"forced": "wan_i2v"}
    assert "flux-as-wan.safetensors: a Wan file with 2 weights outside a Wan 2.1 transformer" in caplog.text
    assert 'with-vae.json: "vae" replaces an image model\'s VAE only: a wan model\'s VAE' in caplog.text


# --- the worker -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "prefix"), [("tiny-wan", ""), ("tiny-wan", COMFY_PREFIX),
                                              ("tiny-wan-i2v", ""), ("tiny-wan-i2v", COMFY_PREFIX)])
def test_the_file_makes_the_folders_frames(name: str, prefix: str, files: dict[str, Files], tmp_path: Path,
                                           offline: None) -> None:
    folder, path, base = files[name]
    family = MODELS[name]
    if prefix:
        path = _prefixed(path, tmp_path / "comfy.safetensors", prefix)
    from_file = _realigned(load_folder_model(path, {family: str(base)}, torch.float32))
    from_folder = _realigned(DiffusionPipeline.from_pretrained(folder, dtype=torch.float32))
    assert type(from_file) is type(from_folder)
    for component, module in from_folder.components.items():
        if isinstance(module, torch.nn.Module):
            assert _equal(getattr(from_file, component).state_dict(), module.state_dict()), component
    expected = _frames(from_folder, family)
    assert expected.shape == (FRAMES, SIDE, SIDE, 3) and expected.std() > 0  # a clip, not a blank
    assert np.array_equal(_frames(from_file, family), expected)


def test_a_half_precision_transformer_keeps_wans_float32_modules(files: dict[str, Files],
                                                                  offline: None) -> None:
    """As from_pretrained does: the norms, modulation, time embedder and rotary tables in float32, the
    rest in the dtype."""
    folder, path, base = files["tiny-wan-i2v"]
    loaded = load_checkpoint(path, {"wan_i2v": str(base)}, torch.bfloat16).transformer
    reference = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer", dtype=torch.bfloat16)
    assert loaded.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert loaded.scale_shift_table.dtype == loaded.rope.freqs_cos.dtype == torch.float32
    assert _equal(loaded.state_dict(), reference.state_dict())
    assert _equal(dict(loaded.named_buffers()), dict(reference.named_buffers()))


def _refused(path: Path, configs: dict[Family, str], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        load_folder_model(path, configs, torch.float32)


def test_a_broken_or_foreign_file_is_refused_by_the_worker(files: dict[str, Files], tmp_path: Path,
                                                           offline: None) -> None:
    _, wan, base = files["tiny-wan"]
    configs: dict[Family, str] = {"wan": str(base)}
    whole = load_file(wan)
    (tmp_path / "cut.safetensors").write_bytes(wan.read_bytes()[:-100])
    _refused(tmp_path / "cut.safetensors", configs, "not a readable safetensors file: truncated")
    save_file({name: tensor for name, tensor in whole.items() if name != "head.head.bias"},
              str(tmp_path / "lacking.safetensors"))
    _refused(tmp_path / "lacking.safetensors", configs, "it lacks 1 of its weights, such as head.head.bias")
    # Whole, but another model than the base's: the text-to-video file with the image-to-video base.
    _refused(wan, {"wan": str(files["tiny-wan-i2v"][2])},
             r"not of the wan base's kind .*missing "
             r"\['blocks.0.attn2.add_k_proj.bias'.*"
             r"of other shapes \['patch_embedding.weight \(24, 16, 1, 2, 2\), not \(24, 36, 1, 2, 2\)'")
    # A base of configs alone: a Wan file holds its transformer, the rest is the base's.
    configs_only = write_configs(base, tmp_path / "configs-only")
    _refused(wan, {"wan": str(configs_only)}, "lacks weights of its other components")
    (tmp_path / "with-vae.safetensors").write_bytes(wan.read_bytes())
    save_file({"decoder.conv_in.weight": torch.zeros(1)}, str(tmp_path / "vae.safetensors"))
    (tmp_path / "with-vae.json").write_text(json.dumps({"vae": "vae.safetensors"}))
    _refused(tmp_path / "with-vae.safetensors", configs, "replaces an image model's VAE only")


def test_the_tiny_folder_writes_its_wan_file_through_write_checkpoint(files: dict[str, Files],
                                                                       tmp_path: Path) -> None:
    folder, path, _ = files["tiny-wan"]
    assert _equal(load_file(write_checkpoint(folder, tmp_path / "same.safetensors")), load_file(path))
    with pytest.raises(UnusableModelError, match="it lacks 2 of its weights"):
        check_wan_transformer(path, [name for name in load_file(path) if not name.startswith("head.head.")])


# --- LTX-Video ------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
LTX_KINDS = [("", False), (COMFY_PREFIX, False), ("", True), (COMFY_PREFIX, True)]  # (prefix, with its VAE)


class LtxFiles(NamedTuple):
    """The tiny LTX-Video model's diffusers folder, its files in LTX-Video's layout, and its bases."""

    folder: Path
    files: dict[tuple[str, bool], Path]  # by (prefix, with its VAE)
    base: Path  # the folder less its transformer's weights
    bare_base: Path  # less its VAE's too: a file's VAE alone can serve there


def _ltx_name(prefix: str, with_vae: bool) -> str:
    return "ltx" + ("-comfy" if prefix else "") + ("-vae" if with_vae else "")


@pytest.fixture(scope="module")
def ltx(model_cache: Path, cache: Path) -> LtxFiles:
    folder = ensure_tiny_video_model(model_cache, "tiny-ltx")
    files = {kind: write_ltx_file(folder, cache / f"{_ltx_name(*kind)}.safetensors", *kind)
             for kind in LTX_KINDS}
    return LtxFiles(folder, files, write_base(folder, cache / "tiny-ltx-base"),
                    write_base(folder, cache / "tiny-ltx-bare-base", without=("transformer", "vae")))


def _folder_weights(folder: Path, component: str) -> Tensors:
    (weights,) = (folder / component).glob("*.safetensors")
    return load_file(weights)


def _wide_vae() -> Tensors:
    """An LTX-Video VAE of 0.9.0's shape with other sizes than the tiny one's: its levels widen the
    channels (resnets with a shortcut and a norm) and some hold two resnets."""
    torch.manual_seed(0)
    levels, layers, scaling = (8, 16, 32, 32), (1, 2, 1, 1, 2), (True, True, True, False)
    return AutoencoderKLLTXVideo(
        latent_channels=8, block_out_channels=levels, decoder_block_out_channels=levels,
        layers_per_block=layers, decoder_layers_per_block=layers, spatio_temporal_scaling=scaling,
        decoder_spatio_temporal_scaling=scaling, decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, timestep_conditioning=False).state_dict()


def _without(state: Tensors, name: str) -> Tensors:
    return {other: tensor for other, tensor in state.items() if other != name}


def test_an_ltx_file_round_trips_through_diffusers_converters(ltx: LtxFiles) -> None:
    transformer, vae = _folder_weights(ltx.folder, "transformer"), _folder_weights(ltx.folder, "vae")
    for (prefix, with_vae), path in ltx.files.items():
        state = load_file(path)
        assert {prefix + name for name in ("patchify_proj.weight", "adaln_single.linear.weight",
                                           "transformer_blocks.0.attn1.q_norm.weight",
                                           "transformer_blocks.0.scale_shift_table")} <= set(state)
        assert any(name.startswith(LTX_VAE_PREFIX) for name in state) == with_vae
        assert family_of_checkpoint(path) == "ltx"
        assert _equal(convert_ltx_transformer_checkpoint_to_diffusers(dict(state)), transformer)
        if with_vae:  # every tensor of the folder's VAE, its latents' statistics too
            assert {"vae.encoder.down_blocks.9.res_blocks.0.conv1.conv.weight",
                    "vae.decoder.up_blocks.8.conv.conv.bias",
                    "vae.per_channel_statistics.channel"} <= set(state)
            assert _equal(convert_ltx_vae_checkpoint_to_diffusers(dict(state)), vae)


def test_the_ltx_names_are_those_diffusers_converts_to_its_models() -> None:
    """The listing's names of an LTX-Video transformer (read without torch) are those of diffusers' model
    once converted, at LTX-Video's own sizes; the VAE's mapping holds on a VAE whose levels widen."""
    with torch.device("meta"):
        model = LTXVideoTransformer3DModel(num_layers=2)
    names = [*LTX_TOP, *(f"transformer_blocks.{index}.{name}" for index in range(2) for name in LTX_BLOCK)]
    for prefix in ("", COMFY_PREFIX):
        prefixed = {prefix + name: torch.zeros(1) for name in names}
        assert sorted(convert_ltx_transformer_checkpoint_to_diffusers(prefixed)) == sorted(model.state_dict())
    wide = _wide_vae()
    original = {LTX_VAE_PREFIX + name: tensor for name, tensor in ltx_vae_to_original(wide).items()}
    assert {"vae.encoder.down_blocks.2.conv_shortcut.weight", "vae.encoder.down_blocks.5.norm3.norm.bias",
            "vae.decoder.up_blocks.7.conv1.conv.weight",
            "vae.decoder.up_blocks.6.res_blocks.1.conv2.conv.bias"} <= set(original)
    check_ltx_file(Path("wide.safetensors"), [*names, *original])  # whole: not refused
    assert _equal(convert_ltx_vae_checkpoint_to_diffusers(dict(original)), wide)


def test_the_folder_lists_ltx_files_without_torch(ltx: LtxFiles, tmp_path: Path) -> None:
    """The API's listing: headers only, torch never imported."""
    for kind, path in ltx.files.items():
        shutil.copy(path, tmp_path / f"{_ltx_name(*kind)}.safetensors")
    script = ("import json, sys; from pathlib import Path; "
              "from shared.contract.checkpoints import folder_models; "
              "models = folder_models(Path(sys.argv[1])); "
              "families = {name: model.family for name, model in models.items()}; "
              "print(json.dumps([families, 'torch' in sys.modules]))")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=60)
    families, torch_loaded = json.loads(run.stdout)
    assert families == {"ltx": "ltx", "ltx-comfy": "ltx", "ltx-comfy-vae": "ltx", "ltx-vae": "ltx"}
    assert torch_loaded is False


def _write_broken_ltx_files(ltx: LtxFiles, folder: Path) -> None:
    """Beside two good files, one of each refusal."""
    alone, with_vae = ltx.files[("", False)], ltx.files[("", True)]
    shutil.copy(alone, folder / "ltx.safetensors")
    shutil.copy(ltx.files[(COMFY_PREFIX, True)], folder / "ltx-comfy-vae.safetensors")
    whole, vae_too = load_file(alone), load_file(with_vae)
    text_encoder = {"text_encoders.t5xxl.transformer.shared.weight": torch.zeros(1)}
    save_file({**vae_too, **text_encoder}, str(folder / "all-in-one.safetensors"))
    save_file(_without(whole, "transformer_blocks.0.attn1.k_norm.weight"),
              str(folder / "lacking.safetensors"))
    save_file({name.replace("blocks.0.", "blocks.1."): tensor for name, tensor in whole.items()},
              str(folder / "gap.safetensors"))
    save_file({**whole, "transformer_blocks.0.audio_attn.to_q.weight": torch.zeros(1)},
              str(folder / "other.safetensors"))
    save_file({**whole, **{COMFY_PREFIX + name: tensor.clone() for name, tensor in whole.items()}},
              str(folder / "twice.safetensors"))
    save_file(_without(vae_too, "vae.decoder.up_blocks.9.res_blocks.0.conv2.conv.bias"),
              str(folder / "vae-lacking.safetensors"))
    save_file({name.replace("up_blocks.9.res_blocks.0.", "up_blocks.9.res_blocks.1."): tensor
               for name, tensor in vae_too.items()}, str(folder / "vae-gap.safetensors"))
    write_gguf(ltx.folder, folder / "quantized.gguf")
    flux = {f"double_blocks.0.img_attn.qkv.{kind}": torch.zeros(1) for kind in ("weight", "bias")}
    save_file(flux, str(folder / "flux-as-ltx.safetensors"))
    (folder / "flux-as-ltx.json").write_text(json.dumps({"family": "ltx"}))


def test_the_folder_refuses_broken_ltx_files_and_lists_the_rest(ltx: LtxFiles, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    _write_broken_ltx_files(ltx, tmp_path)
    with caplog.at_level(logging.WARNING):
        models = _read_afresh(tmp_path)
    assert {name: model.family for name, model in models.items()} == {"ltx": "ltx", "ltx-comfy-vae": "ltx"}
    logged = caplog.text
    for reason in ("all-in-one.safetensors: an LTX-Video file with 1 weights outside an LTX-Video "
                   "transformer and its VAE, such as text_encoders.t5xxl.transformer.shared.weight",
                   "lacking.safetensors: not a whole LTX-Video transformer in LTX-Video's layout: it lacks 1 "
                   "of its weights, such as transformer_blocks.0.attn1.k_norm.weight",
                   "gap.safetensors: not a whole LTX-Video transformer: it has blocks up to 1 but none "
                   "numbered 0",
                   "other.safetensors: not a whole LTX-Video transformer in LTX-Video's layout: it has 1 "
                   "that no LTX-Video transformer has, such as transformer_blocks.0.audio_attn.to_q.weight",
                   "twice.safetensors: an LTX-Video file holding weights twice",
                   "vae-lacking.safetensors: not a whole LTX-Video VAE beside its transformer: it lacks 1 of "
                   "its weights, such as vae.decoder.up_blocks.9.res_blocks.0.conv2.conv.bias",
                   "vae-gap.safetensors: not a whole LTX-Video VAE beside its transformer: "
                   "vae.decoder.up_blocks.9.res_blocks has resnets up to 1 but none numbered 0",
                   "quantized.gguf: a GGUF file of ltx: GGUF files are loaded as FLUX.1 transformers only",
                   "flux-as-ltx.safetensors: an LTX-Video file with 2 weights outside"):
        assert reason in logged, reason


@pytest.mark.parametrize(("prefix", "with_vae"), LTX_KINDS)
def test_an_ltx_file_makes_the_folders_frames(prefix: str, with_vae: bool, ltx: LtxFiles,
                                              offline: None) -> None:
    """A file with its VAE is loaded into a base without the VAE's weights: its own VAE serves."""
    base = ltx.bare_base if with_vae else ltx.base
    loaded = load_folder_model(ltx.files[(prefix, with_vae)], {"ltx": str(base)}, torch.float32)
    from_file = _realigned(loaded)
    from_folder = _realigned(DiffusionPipeline.from_pretrained(ltx.folder, dtype=torch.float32))
    assert type(from_file) is type(from_folder)
    for component, module in from_folder.components.items():
        if isinstance(module, torch.nn.Module):
            assert _equal(getattr(from_file, component).state_dict(), module.state_dict()), component
    expected = _frames(from_folder, "ltx")
    assert expected.shape == (FRAMES, SIDE, SIDE, 3) and expected.std() > 0  # a clip, not a blank
    assert np.array_equal(_frames(from_file, "ltx"), expected)


def test_an_ltx_file_starts_a_clip_from_an_image(ltx: LtxFiles, offline: None) -> None:
    """The ltx family's image-to-video pipeline, made with from_pipe over the file's modules."""
    loaded = load_folder_model(ltx.files[(COMFY_PREFIX, True)], {"ltx": str(ltx.bare_base)}, torch.float32)
    from_file = _realigned(LTXImageToVideoPipeline.from_pipe(_realigned(loaded)))
    from_folder = _realigned(LTXImageToVideoPipeline.from_pipe(DiffusionPipeline.from_pretrained(ltx.folder)))
    request = {"image": start_image(SIDE, SIDE), "prompt": PROMPT, "height": SIDE, "width": SIDE,
               "num_frames": FRAMES, "num_inference_steps": STEPS, "output_type": "np"}
    expected = from_folder(**request, generator=torch.Generator().manual_seed(SEED)).frames[0]
    assert expected.shape == (FRAMES, SIDE, SIDE, 3) and expected.std() > 0
    clip = from_file(**request, generator=torch.Generator().manual_seed(SEED)).frames[0]
    assert np.array_equal(clip, expected)


def test_a_half_precision_ltx_file_loads_as_from_pretrained_does(ltx: LtxFiles, offline: None) -> None:
    loaded = load_checkpoint(ltx.files[("", True)], {"ltx": str(ltx.bare_base)}, torch.bfloat16)
    for component, kind in (("transformer", LTXVideoTransformer3DModel), ("vae", AutoencoderKLLTXVideo)):
        reference = kind.from_pretrained(ltx.folder, subfolder=component, dtype=torch.bfloat16)
        model = getattr(loaded, component)
        assert _equal(model.state_dict(), reference.state_dict()), component
        assert _equal(dict(model.named_buffers()), dict(reference.named_buffers())), component
    assert loaded.transformer.proj_in.weight.dtype == torch.bfloat16


def test_a_broken_or_foreign_ltx_file_is_refused_by_the_worker(ltx: LtxFiles, tmp_path: Path,
                                                               offline: None) -> None:
    configs: dict[Family, str] = {"ltx": str(ltx.base)}
    alone, with_vae = ltx.files[("", False)], ltx.files[("", True)]
    (tmp_path / "cut.safetensors").write_bytes(alone.read_bytes()[:-100])
    _refused(tmp_path / "cut.safetensors", configs, "not a readable safetensors file: truncated")
    whole = load_file(alone)
    save_file(_without(whole, "proj_out.bias"), str(tmp_path / "lacking.safetensors"))
    _refused(tmp_path / "lacking.safetensors", configs, "it lacks 1 of its weights, such as proj_out.bias")
    # Whole, but another model than the base's: two blocks where the base has one.
    second = {name.replace("blocks.0.", "blocks.1."): tensor.clone() for name, tensor in whole.items()
              if name.startswith("transformer_blocks.0.")}
    save_file({**whole, **second}, str(tmp_path / "deeper.safetensors"))
    _refused(tmp_path / "deeper.safetensors", configs,
             r"its transformer is not of the ltx base's kind .*unexpected "
             r"\['transformer_blocks.1.attn1.norm_k.weight'")
    # Its VAE whole, but of other sizes than the base's.
    wide = {LTX_VAE_PREFIX + name: tensor for name, tensor in ltx_vae_to_original(_wide_vae()).items()}
    save_file({**whole, **wide}, str(tmp_path / "wide-vae.safetensors"))
    _refused(tmp_path / "wide-vae.safetensors", configs,
             r"its VAE is not of the ltx base's kind .*of other shapes "
             r"\['decoder.conv_in.conv.bias \(32,\), not \(8,\)'")
    configs_only = write_configs(ltx.base, tmp_path / "configs-only")
    _refused(alone, {"ltx": str(configs_only)}, "lacks weights of its other components")
    _refused(with_vae, {"ltx": str(configs_only)}, "lacks weights of its other components")
    write_gguf(ltx.folder, tmp_path / "quantized.gguf")
    _refused(tmp_path / "quantized.gguf", configs, "a GGUF file of ltx")


def test_a_vae_given_wins_over_the_ltx_files(ltx: LtxFiles, offline: None) -> None:
    given = AutoencoderKLLTXVideo.from_pretrained(ltx.folder, subfolder="vae")
    loaded = load_checkpoint(ltx.files[("", True)], {"ltx": str(ltx.base)}, torch.float32, vae=given)
    assert loaded.vae is given
