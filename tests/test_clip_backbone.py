"""The CLIP backbone: equal to open_clip without prompts, prompt hooks, weight loading, offline errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from promptfcl.backbones.vit import BackboneError
from promptfcl.config import BackboneConfig

from .clip_fixtures import TINY_CLIP


@pytest.fixture(scope="module")
def clip():
    from promptfcl.backbones.clip import build_clip

    return build_clip(BackboneConfig(**TINY_CLIP))


def test_unprompted_encoders_equal_open_clip(clip) -> None:
    x = torch.rand(3, 3, 32, 32)
    ref = F.normalize(clip.clip.encode_image(x), dim=-1)
    assert torch.allclose(clip.encode_image(x), ref, atol=1e-6)
    tokens = clip.tokenize(["a photo of a cat.", "dog", "a much longer sentence about a truck"])
    ref = F.normalize(clip.clip.encode_text(tokens), dim=-1)  # full context length; ours is cut after the EOT
    assert torch.allclose(clip.encode_text(clip.token_embeddings(tokens), tokens), ref, atol=1e-5)


def test_deep_prompts_reach_both_encoders_and_get_gradients(clip) -> None:
    x = torch.rand(2, 3, 32, 32)
    p0 = torch.zeros(2, clip.vision_width, requires_grad=True)
    p1 = torch.zeros(2, clip.vision_width, requires_grad=True)
    z = clip.encode_image(x, {0: p0, 1: p1})
    assert not torch.allclose(z, clip.encode_image(x))
    z.sum().backward()
    assert p0.grad.abs().sum() > 0 and p1.grad.abs().sum() > 0
    tokens = clip.tokenize(["X X cat."])
    deep = torch.randn(2, clip.text_width, requires_grad=True)
    t = clip.encode_text(clip.token_embeddings(tokens), tokens, {1: (1, deep)})
    assert not torch.allclose(t, clip.encode_text(clip.token_embeddings(tokens), tokens))
    t.sum().backward()
    assert deep.grad.abs().sum() > 0


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_local_checkpoint_loads(clip, tmp_path, fmt) -> None:
    from safetensors.torch import save_file

    from promptfcl.backbones.clip import build_clip

    state = {k: v * 1.01 for k, v in clip.clip.state_dict().items()}  # differs from the seeded random init
    path = tmp_path / f"clip.{'safetensors' if fmt == 'safetensors' else 'pt'}"
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save({"state_dict": state}, path)
    loaded = build_clip(BackboneConfig(**{**TINY_CLIP, "weights": str(path)}))
    assert torch.equal(loaded.clip.visual.conv1.weight, state["visual.conv1.weight"])
    x = torch.rand(2, 3, 32, 32)
    assert not torch.allclose(loaded.encode_image(x), clip.encode_image(x))
    wrong = {**TINY_CLIP, "kwargs": {**TINY_CLIP["kwargs"], "embed_dim": 48}, "weights": str(path)}
    with pytest.raises(BackboneError, match="does not fit"):
        build_clip(BackboneConfig(**wrong))


def test_offline_pretrained_fails_with_what_to_put_where(monkeypatch) -> None:
    import open_clip

    from promptfcl.backbones.clip import build_clip

    def offline(*args, **kwargs):
        raise OSError("no internet")

    monkeypatch.setattr(open_clip, "create_model", offline)
    with pytest.raises(BackboneError, match=r"backbone\.weights.*open_clip_model\.safetensors"):
        build_clip(BackboneConfig(kind="clip", name="ViT-B-16", pretrained=True))


def test_core_never_imports_open_clip_or_sklearn() -> None:
    code = (
        "import sys, promptfcl.runtime, promptfcl.methods, promptfcl.experiment, promptfcl.cli; "
        "bad = [m for m in ('open_clip', 'sklearn', 'transformers') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_context_vectors_sit_before_the_class_name_and_zero_shot_uses_the_template(clip) -> None:
    from promptfcl.clip_model import ClipClassifier, ClipPromptParams

    names = ["cat", "dog", "fire truck"]
    m = ClipClassifier(clip, names, ClipPromptParams(n_ctx=2, class_ctx=3))
    tokens = clip.tokenize(["X X X X X cat."])[0]
    assert torch.equal(m.tokens_integrated[0], tokens)  # [SOS] 2 + 3 placeholders, then the class name
    # the general feature is CLIP's text encoder on [SOS, ctx, name tokens] (ctx = embeddings of "a photo")
    emb = clip.token_embeddings(clip.tokenize(["a photo cat."]))
    ref = clip.encode_text(emb, clip.tokenize(["a photo cat."]))
    assert torch.allclose(m.text_features("general")[0], ref[0], atol=1e-5)
    zs = ClipClassifier(clip, names, ClipPromptParams(n_ctx=0))
    assert zs.state_dict() == {} and zs.inference == "fixed"
    x = torch.rand(2, 3, 32, 32)
    texts = clip.tokenize([f"a photo of a {n}." for n in names])
    expected = clip.logit_scale * clip.encode_image(x) @ clip.encode_text(clip.token_embeddings(texts), texts).t()
    assert torch.allclose(zs(x), expected, atol=1e-4)


def test_cocoop_context_is_conditioned_on_the_image(clip) -> None:
    from promptfcl.clip_model import ClipClassifier, ClipPromptParams

    torch.manual_seed(0)  # the tiny test CLIP's meta-net has 2 hidden ReLUs: a fixed draw keeps them alive
    m = ClipClassifier(clip, ["cat", "dog", "bird"], ClipPromptParams(n_ctx=2, conditional=True))
    x = torch.rand(2, 3, 32, 32)
    z = m.image_features(x)
    t = m.conditional_text_features(z)
    assert t.shape == (2, 3, clip.embed_dim) and (t[0] - t[1]).abs().max() > 1e-4
    with torch.no_grad():
        m.meta_net[2].weight.zero_()
        m.meta_net[2].bias.zero_()
    t = m.conditional_text_features(z)  # zero shift: CoOp's texts for every image
    assert torch.allclose(t[0], m.text_features("general"), atol=1e-5) and torch.allclose(t[1], t[0], atol=1e-5)
    m(x).sum().backward()
    assert m.meta_net[2].weight.grad.abs().sum() > 0


def test_no_grad_passes_encode_the_class_texts_once_and_see_every_prompt_change(clip, monkeypatch) -> None:
    from promptfcl.clip_model import ClipClassifier, ClipPromptParams

    m = ClipClassifier(clip, ["cat", "dog", "bird"], ClipPromptParams(n_ctx=2, class_ctx=2))
    calls = []
    encode = clip.encode_text
    monkeypatch.setattr(clip, "encode_text", lambda *a, **k: calls.append(1) or encode(*a, **k))
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        first = m(x)
        n = len(calls)
        assert torch.equal(m(x), first) and len(calls) == n  # a second batch reuses the class texts

        def changed(write) -> bool:
            write()
            before = len(calls)
            out = m(x)
            with torch.enable_grad():
                reference = m(x).detach()  # encodes from scratch
            return len(calls) > before and torch.allclose(out, reference, atol=1e-5)

        assert changed(lambda: m.ctx.add_(0.5))  # an optimizer-style in-place step
        assert changed(lambda: m.class_ctx.data.copy_(torch.randn_like(m.class_ctx)))  # a write through .data
        assert changed(lambda: m.load_state_dict({k: v + 1 for k, v in m.state_dict().items()}))
    with torch.enable_grad():
        n = len(calls)
        m(x)
        assert len(calls) > n  # training passes always encode (they need the graph)
