"""The hybrid CPU backbone (ViT-Tiny on a frozen EfficientNet-Lite0 stem): built from a config name, prompt hooks
unchanged, its stem output cached per image exactly, the prompt-free switch, and the frozen-feature probe."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from promptfcl.backbones import PromptSpec, build_vit
from promptfcl.config import BackboneConfig
from promptfcl.frozen_probe import first_per_class, linear_probe, nearest_class_mean, probe

HYBRID = BackboneConfig(name="vit_tiny_hybrid_lite0", img_size=64, kwargs={"depth": 2})


@pytest.fixture(scope="module")
def hybrid():
    return build_vit(HYBRID)


def test_hybrid_is_a_registered_vit_with_a_cached_stem(hybrid) -> None:
    assert hybrid.embed_dim == 192 and hybrid.num_layers == 2
    assert hybrid.stem_cache is not None  # a CNN stem: cached by default
    assert build_vit(HYBRID.model_copy(update={"stem_cache": False})).stem_cache is None
    assert build_vit(BackboneConfig(img_size=32, kwargs={"patch_size": 8, "depth": 1})).stem_cache is None


def test_stem_cache_is_exact_and_independent_of_the_batch(hybrid) -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 3, 64, 64)
    uncached = build_vit(HYBRID.model_copy(update={"stem_cache": False}))
    uncached.load_state_dict(hybrid.state_dict())
    spec = PromptSpec.split_half({0: torch.randn(1, 4, 192)})
    hybrid.stem_cache.store.clear()
    first = hybrid(x[2:5], spec)  # fills 3 entries, each computed from its image alone
    assert len(hybrid.stem_cache) == 3 and hybrid.stem_cache.misses >= 3
    hits = hybrid.stem_cache.hits
    again = hybrid(x, spec)  # the same 3 images inside another batch: served from the cache
    assert hybrid.stem_cache.hits == hits + 3
    assert torch.equal(again[2:5], hybrid(x[2:5], spec))
    assert torch.allclose(first, again[2:5], atol=1e-5)
    per_image = torch.cat([uncached(x[i : i + 1], spec) for i in range(6)])
    assert torch.equal(hybrid(x, spec), per_image)  # a cached entry is its image's own stem output
    assert torch.allclose(uncached(x, spec), per_image, atol=1e-4)  # the batched stem differs only by rounding


def test_prompts_disabled_gives_the_prompt_free_timm_output(hybrid) -> None:
    torch.manual_seed(1)
    x = torch.randn(3, 3, 64, 64)
    timm_out = hybrid.vit.forward_head(hybrid.vit.forward_features(x), pre_logits=True)
    spec = PromptSpec.split_half({0: torch.randn(3, 6, 192), 1: torch.randn(1, 4, 192)})
    spec.tokens = torch.randn(1, 2, 192)
    assert not torch.allclose(hybrid(x, spec), timm_out, atol=1e-3)
    with hybrid.prompts_disabled():
        assert torch.allclose(hybrid(x, spec), timm_out, atol=1e-5)
        with hybrid.prompts_disabled():  # nested: still off, and back on only after the outer block
            pass
        assert torch.allclose(hybrid(x, spec), timm_out, atol=1e-5)
    assert not torch.allclose(hybrid(x, spec), timm_out, atol=1e-3)


def test_hybrid_loads_a_full_checkpoint_strictly(tmp_path, hybrid) -> None:
    state = {k: v.contiguous() + 0.01 for k, v in hybrid.vit.state_dict().items() if v.is_floating_point()}
    save_file(state, str(tmp_path / "hybrid.safetensors"))
    loaded = build_vit(HYBRID.model_copy(update={"weights": str(tmp_path / "hybrid.safetensors")}))
    for k, v in state.items():
        assert torch.equal(loaded.vit.state_dict()[k], v), k


def test_nearest_class_mean_and_linear_probe_on_hand_made_features() -> None:
    ftr = torch.tensor([[0.0, 0.0], [0.0, 2.0], [10.0, 0.0], [10.0, 2.0]])
    ytr = torch.tensor([3, 3, 7, 7])  # class means (0, 1) and (10, 1)
    fte = torch.tensor([[4.9, 0.0], [5.1, 9.0], [-3.0, 1.0]])
    yte = torch.tensor([3, 7, 7])
    assert nearest_class_mean(ftr, ytr, fte, yte) == pytest.approx(200 / 3)  # the third is nearer class 3
    g = torch.Generator().manual_seed(0)
    means = torch.randn(4, 8, generator=g) * 4
    y = torch.arange(4).repeat_interleave(30)
    f = means[y] + torch.randn(len(y), 8, generator=g)
    acc, c, aware = linear_probe(f[::2], y[::2] + 10, f[1::2], y[1::2] + 10, task_groups=[[10, 11], [12, 13]])
    assert acc > 95 and aware >= acc and c in (0.001, 0.01, 0.1, 1.0, 10.0)
    noise = probe(torch.randn(120, 8, generator=g), y, torch.randn(120, 8, generator=g), y)
    assert noise.linear < 45 and noise.ncm < 45  # 4 classes, no signal: near 25 %


def test_first_per_class_takes_the_first_images_in_split_order() -> None:
    t = torch.tensor([1, 0, 1, 1, 0, 2])
    assert first_per_class(t, 2).tolist() == [0, 1, 2, 4, 5]
    assert first_per_class(t, None, [1]).tolist() == [0, 2, 3]


def test_full_fine_tuning_on_the_hybrid_keeps_the_stem_frozen_cached_and_unexchanged(hybrid) -> None:
    from promptfcl.methods.base.finetune import FineTunedClassifier

    model = FineTunedClassifier(hybrid, 5)
    state = model.state_dict()
    assert not any("patch_embed.backbone" in k for k in state) and "vit.blocks.0.attn.qkv.weight" in state
    x = torch.randn(4, 3, 64, 64)
    assert torch.allclose(model.features(x), hybrid(x), atol=1e-5)  # same weights: the frozen backbone's feature
    stem_before = {k: v.clone() for k, v in hybrid.vit.patch_embed.state_dict().items()}
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 3])).backward()
    opt.step()
    assert not torch.allclose(model.features(x), hybrid(x), atol=1e-4)  # the transformer copy trained
    for k, v in hybrid.vit.patch_embed.state_dict().items():  # the shared stem (BatchNorm buffers too) did not
        assert torch.equal(v, stem_before[k]), k


@pytest.mark.parametrize(("augment", "cached"), [("flip", True), ("rrc_flip", False), ("crop_flip", False)])
def test_local_training_caches_the_stem_only_for_inputs_that_repeat(hybrid, augment, cached) -> None:
    """Random crops never repeat: training on them runs the stem batched and leaves the cache alone (filling it
    would cost a per-image stem pass and memory nothing reads); flipped images repeat and are cached."""
    from promptfcl.data.base import ImageSplit
    from promptfcl.data.loader import LabeledSubset
    from promptfcl.data.transforms import ImageTransform
    from promptfcl.model import PromptedClassifier
    from promptfcl.training.local import LocalTrainingParams, train_local

    gen = torch.Generator().manual_seed(0)
    split = ImageSplit(torch.randint(0, 256, (6, 3, 64, 64), dtype=torch.uint8, generator=gen), torch.arange(6) % 3)
    data = LabeledSubset.of(split, range(6), torch.arange(3))
    model = PromptedClassifier(hybrid, 3)
    p = LocalTrainingParams(local_epochs=2, batch_size=3, lr=1e-3)
    hybrid.stem_cache.store.clear()
    misses = hybrid.stem_cache.misses
    transform = ImageTransform(64, augment=augment)
    stats = train_local(model, data, p, torch.ones(3, dtype=torch.bool), transform, gen, "cpu")
    assert stats["steps"] == 4
    assert (len(hybrid.stem_cache) > 0) is cached
    assert (hybrid.stem_cache.misses > misses) is cached
    assert hybrid.stem_cache is not None  # the pause ends with the loop


def test_channels_last_stem_gives_the_default_layouts_features(hybrid) -> None:
    """The stem runs in channels-last memory format by default (faster on a CPU); its features equal the default
    layout's up to float rounding, and `stem_channels_last: false` keeps the default layout."""
    plain = build_vit(HYBRID.model_copy(update={"stem_channels_last": False, "stem_cache": False}))
    conv = hybrid.vit.patch_embed.backbone.conv_stem.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert plain.vit.patch_embed.backbone.conv_stem.weight.is_contiguous()
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), hybrid.stem_cache_paused():
        torch.testing.assert_close(hybrid(x), plain(x), rtol=1e-4, atol=1e-4)
