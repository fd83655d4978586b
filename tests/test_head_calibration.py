"""Server-side head calibration (HGP rebalancing, CCVR calibration): which rows it may change, and that it fits."""

from __future__ import annotations

import pytest
import torch

from promptfcl.statistics import ClassStatistics, GaussianComponents, MixtureSampler
from promptfcl.training.head_calibration import CalibrationParams, calibrate_head

DIM, LOGITS = 8, 6
ALLOWED = torch.tensor([1, 3, 4])


def sampler(variance: float = 0.05) -> MixtureSampler:
    """One diagonal Gaussian per allowed class, means on distinct axes (separable by a linear head)."""
    means = torch.zeros(len(ALLOWED), DIM)
    means[torch.arange(len(ALLOWED)), torch.arange(len(ALLOWED))] = 3.0
    stats = ClassStatistics(ALLOWED, torch.full((3,), 10), means, torch.full((3, DIM), variance))
    return MixtureSampler(GaussianComponents.empty(DIM).replace_task(0, [stats]), ALLOWED)


@pytest.mark.parametrize("temperature", [0.1, None])
def test_calibration_changes_only_the_allowed_rows_and_fits_them(temperature: float | None) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(DIM, LOGITS)
    with torch.no_grad():  # a head biased toward a logit outside the allowed ones, as after FedAvg
        head.bias[5] = 5.0
    before_w, before_b = head.weight.detach().clone(), head.bias.detach().clone()
    s = sampler()
    # weight decay and momentum act on every parameter they are given: only the allowed rows may be among them
    p = CalibrationParams(epochs=5, samples_per_class=128, batch_size=32, weight_decay=0.1,
                          logit_norm_temperature=temperature)  # fmt: skip
    calibrate_head(head, s, ALLOWED, p, torch.Generator().manual_seed(0), torch.device("cpu"))
    other = torch.tensor([0, 2, 5])
    assert torch.equal(head.weight[other], before_w[other]), "rows outside the allowed logits changed"
    assert torch.equal(head.bias[other], before_b[other]), "biases outside the allowed logits changed"
    assert not torch.equal(head.weight[ALLOWED], before_w[ALLOWED])
    feats, labels = s.sample(300, torch.Generator().manual_seed(1))
    with torch.no_grad():
        pred = ALLOWED[head(feats)[:, ALLOWED].argmax(1)]
    acc = float((pred == labels).float().mean())
    assert acc > 0.95, f"calibrated head classifies only {acc:.2f} of fresh samples among the allowed logits"
