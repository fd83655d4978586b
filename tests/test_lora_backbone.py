"""LoRA through the one injection path: B = 0 is the frozen model, unmerged = merged weights, composes with prompts."""

from __future__ import annotations

import pytest
import torch

from promptfcl.adapters import LoRAAdapter, site_key
from promptfcl.backbones import FrozenViT, LoRADelta, PromptSpec, build_vit
from promptfcl.config import BackboneConfig

CFG = BackboneConfig(
    name="vit_tiny_patch16_224", img_size=32, kwargs={"patch_size": 8, "depth": 3, "embed_dim": 48, "num_heads": 3}
)
ALL = ("qkv", "proj", "fc1", "fc2")


@pytest.fixture(scope="module")
def vit() -> FrozenViT:
    torch.manual_seed(0)
    return build_vit(CFG)


def random_adapter(vit: FrozenViT, layers=(0, 2), targets=ALL, rank=3, scale=0.5) -> LoRAAdapter:
    torch.manual_seed(1)
    adapter = LoRAAdapter(vit, list(layers), list(targets), rank, scale)
    with torch.no_grad():
        for b in adapter.b.values():
            b.normal_(0, 0.2)  # B ≠ 0, so the delta changes the output
    return adapter


def merged_copy(vit: FrozenViT, adapter: LoRAAdapter, scale: float = 0.5) -> FrozenViT:
    """An independent ViT whose frozen weights have ΔW = s·B·A added in place (LoRA's merged inference form), from
    the adapter's raw A and B and the scale the test chose (not from the adapter's own deltas)."""
    merged = build_vit(CFG)  # a deep copy of a FrozenViT is the same shared backbone: build a second one
    merged.load_state_dict(vit.state_dict())
    with torch.no_grad():
        for layer, target in adapter.sites:
            blk = merged.vit.blocks[layer]
            lin = (blk.attn if target in ("qkv", "proj") else blk.mlp).get_submodule(target)
            key = site_key((layer, target))
            lin.weight += scale * adapter.b[key] @ adapter.a[key]
    return merged


def test_zero_b_gives_the_frozen_output(vit: FrozenViT) -> None:
    x = torch.randn(4, 3, 32, 32)
    adapter = LoRAAdapter(vit, None, list(ALL), rank=4)  # LoRA init: A random, B = 0
    assert all(a.abs().sum() > 0 for a in adapter.a.values())
    frozen = vit.vit.forward_head(vit.vit.forward_features(x), pre_logits=True)
    assert torch.allclose(vit(x, adapter(4)), frozen, atol=1e-6, rtol=0)


def test_unmerged_forward_equals_merged_weights(vit: FrozenViT) -> None:
    x = torch.randn(4, 3, 32, 32)
    adapter = random_adapter(vit)
    ours, merged = vit(x, adapter(4)), merged_copy(vit, adapter)(x)
    assert not torch.allclose(ours, vit(x), atol=1e-3)  # the delta does something
    assert torch.allclose(ours, merged, atol=1e-5)
    # one target at a time, so a wrong projection cannot hide behind the others
    for target in ALL:
        one = random_adapter(vit, layers=(1,), targets=(target,))
        assert torch.allclose(vit(x, one(4)), merged_copy(vit, one)(x), atol=1e-5), target


def test_lora_composes_with_prefix_prompts(vit: FrozenViT) -> None:
    x = torch.randn(3, 3, 32, 32)
    adapter = random_adapter(vit, layers=(0, 1))
    prefix = PromptSpec.split_half({0: torch.randn(1, 6, 48), 2: torch.randn(3, 4, 48)})
    both = vit(x, prefix.merge(adapter(3)))
    assert torch.allclose(both, merged_copy(vit, adapter)(x, prefix), atol=1e-5)


def test_deltas_on_one_projection_add(vit: FrozenViT) -> None:
    x = torch.randn(2, 3, 32, 32)
    a1, a2 = random_adapter(vit, layers=(1,), targets=("fc1",)), random_adapter(vit, layers=(1,), targets=("fc1",))
    with torch.no_grad():
        a2.b["1_fc1"].mul_(-0.3)
    d1, d2 = a1.deltas()[(1, "fc1")], a2.deltas()[(1, "fc1")]
    stacked = a1(2).merge(a2(2)).lora[1]["fc1"]
    assert stacked.a is not None and stacked.a.shape[0] == 6  # ranks stack
    assert torch.allclose(stacked.dense(), d1.dense() + d2.dense(), atol=1e-6)
    dense = PromptSpec(lora={1: {"fc1": LoRADelta(None, d1.dense() + d2.dense())}})
    assert torch.allclose(vit(x, a1(2).merge(a2(2))), vit(x, dense), atol=1e-5)


def test_gradients_reach_only_the_trainable_factor(vit: FrozenViT) -> None:
    adapter = random_adapter(vit, layers=(0,), targets=("qkv", "fc2"))
    adapter.set_trainable("A")
    out = vit(torch.randn(2, 3, 32, 32), adapter(2))
    (out * torch.randn(48)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapter.a.values())
    assert all(p.grad is None for p in adapter.b.values())
    assert all(q.grad is None for q in vit.parameters())


def test_bad_deltas_are_refused(vit: FrozenViT) -> None:
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(ValueError, match="outside"):
        vit(x, PromptSpec(lora={7: {"qkv": LoRADelta(torch.zeros(2, 48), torch.zeros(144, 2))}}))
    with pytest.raises(ValueError, match="unknown LoRA target"):
        vit(x, PromptSpec(lora={0: {"query": LoRADelta(torch.zeros(2, 48), torch.zeros(144, 2))}}))
    with pytest.raises(ValueError, match="do not give"):
        vit(x, PromptSpec(lora={0: {"proj": LoRADelta(torch.zeros(2, 48), torch.zeros(144, 2))}}))
    with pytest.raises(ValueError, match="subset"):
        LoRAAdapter(vit, [0], ["mlp"], rank=2)
