"""Server-side aggregation mixes tensors from two devices on a GPU: the server's model state (on the GPU) and
client uploads or statistics kept on the CPU (LoRM's Grams, C2Prompt's CPA histogram weights). The helpers must
bring their operands together themselves. The `meta` device stands in for the GPU here: mixed-device arithmetic
raises just as cuda/cpu does (benchmarks/cuda_check.sh on an H200 found these; it also runs the LoRM merge and
owner-row means, whose CPU round trips meta tensors cannot make)."""

from __future__ import annotations

import torch

from promptfcl.methods.c2prompt.cpa import mix_rows
from promptfcl.methods.capt.aggregation import classwise_mean
from promptfcl.methods.lorm.regmean import project_gram
from promptfcl.methods.pilora.prototypes import prototype_reweight

META = torch.device("meta")


def test_mix_rows_follows_the_rows_device() -> None:
    out = mix_rows(torch.full((2, 2), 0.5), torch.ones(2, 3, device=META))
    assert out.device == META and out.shape == (2, 3)


def test_project_gram_runs_on_the_grams_device() -> None:
    projected = project_gram(torch.ones(2, 4), torch.eye(4, device=META))
    assert projected.device == META and projected.shape == (2, 2)
    assert project_gram(torch.ones(2, 4), torch.ones(4, device=META)).device == META


def test_prototype_reweight_without_features_weighs_on_the_prototypes_device() -> None:
    g, w = prototype_reweight(torch.randn(3, 5, device=META), torch.empty(0, 5), 0.1)
    assert g.device == META and w.device == META and w.shape == (3,)


def test_classwise_mean_takes_label_counts_and_kept_rows_from_the_cpu() -> None:
    rows = [torch.ones(3, 2, device=META), torch.ones(3, 2, device=META)]
    counts = [torch.tensor([1, 0, 2]), torch.tensor([0, 0, 1])]
    out = classwise_mean(rows, counts, keep=torch.zeros(3, 2))
    assert out.device == META and out.shape == (3, 2)
