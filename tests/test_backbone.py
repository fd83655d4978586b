"""The one prompt-injection path: exact equivalence without prompts, a naive reference with prompts, weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from promptfcl.backbones import BackboneError, FrozenViT, PromptSpec, build_vit
from promptfcl.config import BackboneConfig

CFG = BackboneConfig(
    name="vit_tiny_patch16_224", img_size=32, kwargs={"patch_size": 8, "depth": 3, "embed_dim": 48, "num_heads": 3}
)


@pytest.fixture(scope="module")
def vit() -> FrozenViT:
    torch.manual_seed(0)
    return build_vit(CFG)


def naive_prefixed_forward(vit: FrozenViT, x: torch.Tensor, spec: PromptSpec) -> torch.Tensor:
    """Reference: explicit softmax(q kᵀ / √d) v with prefixes concatenated, no SDPA, no shared code."""
    m = vit.vit
    h = m._pos_embed(m.patch_embed(x))
    if spec.tokens is not None:
        t = spec.tokens.expand(h.shape[0], -1, -1)
        h = torch.cat([h[:, :1], t, h[:, 1:]], 1) if spec.token_position == "prepend" else torch.cat([h, t], 1)
    for i, blk in enumerate(m.blocks):
        a = blk.attn
        y = blk.norm1(h)
        b, n, c = y.shape
        qkv = a.qkv(y).reshape(b, n, 3, a.num_heads, c // a.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if i in spec.prefix:
            pk, pv = spec.prefix[i]
            pk = pk.expand(b, -1, -1).reshape(b, -1, a.num_heads, c // a.num_heads).permute(0, 2, 1, 3)
            pv = pv.expand(b, -1, -1).reshape(b, -1, a.num_heads, c // a.num_heads).permute(0, 2, 1, 3)
            k, v = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
        att = (q @ k.transpose(-2, -1) / (c // a.num_heads) ** 0.5).softmax(-1)
        h = h + a.proj((att @ v).transpose(1, 2).reshape(b, n, c))
        h = h + blk.mlp(blk.norm2(h))
    return m.norm(h)[:, 0]


def test_no_prompt_equals_timm_forward(vit: FrozenViT) -> None:
    x = torch.randn(5, 3, 32, 32)
    ours = vit(x)
    ref = vit.vit.forward_head(vit.vit.forward_features(x), pre_logits=True)
    assert torch.equal(ours, ref)
    assert torch.allclose(vit(x, PromptSpec()), ref, atol=0, rtol=0)


def test_prefix_attention_matches_naive_reference(vit: FrozenViT) -> None:
    x = torch.randn(4, 3, 32, 32)
    p0 = torch.randn(4, 6, 48)  # per-sample prefix, split half → 3 keys + 3 values
    spec = PromptSpec.split_half({0: p0, 2: torch.randn(1, 10, 48)})
    assert torch.allclose(vit(x, spec), naive_prefixed_forward(vit, x, spec), atol=1e-5)
    # separate full-length K and V (FedMGP convention) of different lengths
    spec2 = PromptSpec(prefix={1: (torch.randn(1, 5, 48), torch.randn(1, 5, 48))})
    assert torch.allclose(vit(x, spec2), naive_prefixed_forward(vit, x, spec2), atol=1e-5)
    # and a prompt actually changes the output
    assert not torch.allclose(vit(x, spec), vit(x), atol=1e-3)


@pytest.mark.parametrize("position", ["prepend", "append"])
def test_input_tokens_match_reference(vit: FrozenViT, position: str) -> None:
    x = torch.randn(3, 3, 32, 32)
    spec = PromptSpec(tokens=torch.randn(1, 4, 48), token_position=position)
    tokens = vit.tokens(x, spec)
    assert tokens.shape == (3, 1 + 16 + 4, 48)
    assert torch.allclose(vit(x, spec), naive_prefixed_forward(vit, x, spec), atol=1e-5)


def test_gradients_reach_prompts_not_backbone(vit: FrozenViT) -> None:
    p = torch.zeros(1, 4, 48, requires_grad=True)
    out = vit(torch.randn(2, 3, 32, 32), PromptSpec.split_half({0: p}))
    (out * torch.randn(48)).sum().backward()  # a plain sum of a LayerNorm output has zero gradient
    assert p.grad is not None and p.grad.abs().sum() > 0
    assert all(q.grad is None and not q.requires_grad for q in vit.parameters())
    vit.train()
    assert not vit.vit.training


def test_query_is_unprompted_feature_without_grad(vit: FrozenViT) -> None:
    x = torch.randn(2, 3, 32, 32)
    q = vit.query(x)
    assert not q.requires_grad and torch.equal(q, vit(x))


def test_weights_from_local_files(tmp_path, vit: FrozenViT) -> None:
    state = {k: v.clone() for k, v in vit.vit.state_dict().items()}
    st = tmp_path / "w.safetensors"
    save_file(state, str(st))
    pt = tmp_path / "w.pt"
    torch.save({"state_dict": state}, pt)
    x = torch.randn(2, 3, 32, 32)
    for path in (st, pt):
        torch.manual_seed(123)  # a different random init, overwritten by the file
        loaded = build_vit(CFG.model_copy(update={"weights": str(path)}))
        assert torch.equal(loaded(x), vit(x))


def test_bad_weights_are_refused_clearly(tmp_path) -> None:
    with pytest.raises(BackboneError, match="not found"):
        build_vit(CFG.model_copy(update={"weights": str(tmp_path / "missing.safetensors")}))
    wrong = tmp_path / "wrong.safetensors"
    save_file({"foo": torch.zeros(2)}, str(wrong))
    with pytest.raises(BackboneError, match="does not fit"):
        build_vit(CFG.model_copy(update={"weights": str(wrong)}))

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    evil = tmp_path / "evil.pt"
    torch.save({"x": Evil()}, evil)
    with pytest.raises(BackboneError, match="weights-only"):
        build_vit(CFG.model_copy(update={"weights": str(evil)}))
