"""The CPU-checkable pieces of benchmarks/perf.py's GPU section: peak table, fraction of peak, FLOP counting."""

from __future__ import annotations

import pytest
import torch

from .conftest import load_benchmark


@pytest.fixture(scope="module")
def perf():
    return load_benchmark("perf")


def test_bf16_peak_is_looked_up_by_device_name_most_specific_first(perf) -> None:
    assert perf.bf16_peak_tflops("NVIDIA H100 80GB HBM3")[0] == 989.0  # the SXM part's name
    assert perf.bf16_peak_tflops("NVIDIA H100 PCIe")[0] == 756.0
    assert perf.bf16_peak_tflops("NVIDIA H200")[0] == 989.0
    assert perf.bf16_peak_tflops("NVIDIA A100-SXM4-80GB")[0] == 312.0
    peak, source = perf.bf16_peak_tflops("NVIDIA GeForce GTX 1080")
    assert peak is None and "--peak-tflops" in source
    assert perf.bf16_peak_tflops("NVIDIA GeForce GTX 1080", 100.0) == (100.0, "--peak-tflops")


def test_fraction_of_peak_is_achieved_flops_over_peak(perf) -> None:
    # 2 GFLOP per image at 5000 images/s = 10 TFLOP/s, of a 400 TFLOP/s peak
    assert perf.fraction_of_peak(2e9, 5000.0, 400.0) == pytest.approx(0.025)
    assert perf.fraction_of_peak(2e9, 5000.0, None) is None


def vit_forward_flops(batch: int, tokens: int, dim: int, depth: int, patches: int, patch: int) -> int:
    """Matmul FLOPs (2 per multiply-add) of a timm ViT's forward_features: patch embedding, then per block qkv,
    QKᵀ, attention × V, projection and the 4× MLP."""
    embed = 2 * batch * patches * (patch * patch * 3) * dim
    block = 2 * batch * tokens * dim * (3 * dim + dim + 8 * dim) + 2 * 2 * batch * tokens * tokens * dim
    return embed + depth * block


def test_flop_count_matches_the_vit_forward_and_includes_the_backward(perf) -> None:
    import timm

    vit = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=48, num_heads=3, num_classes=0
    ).eval()
    x = torch.randn(2, 3, 32, 32)
    forward = perf.count_flops(lambda: vit.forward_features(x))
    assert forward == vit_forward_flops(2, 17, 48, 2, 16, 8)
    vit.requires_grad_(False)
    step = perf.bare_step_fn(vit, {0: (2, 2)}, 0, False, 5, torch.device("cpu"))
    train = perf.count_flops(lambda: step(x, torch.tensor([0, 1])))
    # prefix keys/values add 2 attended tokens; the backward through the frozen blocks roughly doubles the count
    assert 1.8 * forward < train < 3.0 * forward, (forward, train)


def test_timed_measures_the_call(perf) -> None:
    import time

    assert perf.timed(torch.device("cpu"), lambda: time.sleep(0.05)) >= 0.05
