"""The shared local-training loop: per-group learning rates under CODA-P's per-epoch cosine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from promptfcl.training.local import LocalTrainingParams, coda_cosine_factor, make_optimizer, train_local


def test_coda_cosine_scales_each_param_group_from_its_own_lr() -> None:
    """A group with its own lr keeps its ratio to the others through the per-epoch cosine (it used to be reset to
    the method's lr at every epoch)."""

    p = LocalTrainingParams(lr=0.01, local_epochs=3, lr_schedule="coda_cosine", batch_size=4, grad_clip=None)
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt = make_optimizer(p, [{"params": [a]}, {"params": [b], "lr": 0.1}])
    seen: list[tuple[float, float]] = []

    class Data:
        def __len__(self) -> int:
            return 4

        def batches(self, *args, **kwargs):
            seen.append(tuple(g["lr"] for g in opt.param_groups))
            yield torch.zeros(4, 2), torch.zeros(4, dtype=torch.long)

    model = nn.Linear(2, 2)
    model.a, model.b = a, b
    train_local(model, Data(), p, torch.ones(2, dtype=torch.bool), lambda x: x, torch.Generator(), "cpu",
                      lambda m, x, y, mk: m(x).sum() + m.a.sum() + m.b.sum(), opt)  # fmt: skip
    expected = [(0.01 * coda_cosine_factor(e, 3), 0.1 * coda_cosine_factor(e, 3)) for e in range(3)]
    assert torch.allclose(torch.tensor(seen, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64))


def test_scale_free_loss_ignores_the_logit_scale_but_not_the_label_prior() -> None:
    """Correctly ranked logits at a tiny scale: CE near ln K as given, near 0 at the best scale; logits that ignore
    the input cannot go below the labels' entropy at any scale; scale 1 is on the grid."""
    import math

    import torch.nn.functional as F

    from promptfcl.training.local import prior_loss, scale_free_loss

    y = torch.tensor([0, 1, 2, 3] * 10)
    ranked = 0.05 * F.one_hot(y, 4).double()  # the true class ahead by 0.05 only
    assert float(F.cross_entropy(ranked, y)) > math.log(4) - 0.05
    fitted, scale = scale_free_loss(ranked, y)
    assert fitted < 0.01 and scale > 100
    skewed = torch.tensor([0] * 30 + [1] * 6 + [2] * 4)
    constant = torch.tensor([[2.0, 0.3, -0.1, -5.0]]).expand(len(skewed), 4)  # the same prediction for every image
    assert scale_free_loss(constant, skewed)[0] >= prior_loss(skewed) - 1e-9
    noisy = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
    assert scale_free_loss(noisy, y)[0] <= float(F.cross_entropy(noisy.double(), y)) + 1e-12


def test_own_class_loss_drops_other_clients_classes_but_keeps_the_prior_bar() -> None:
    """Over the client's own classes only: a classifier that tells them apart but spreads mass over many foreign
    classes fits well here (not over every column); one that ignores the image still cannot beat the labels'
    entropy; the targets are remapped to the kept columns (a wrong remap would score the wrong class)."""
    import torch.nn.functional as F

    from promptfcl.training.local import own_class_loss, prior_loss, scale_free_loss

    y = torch.tensor([3] * 30 + [7] * 10)
    logits = -1.0 + 0.2 * torch.randn(len(y), 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logits[torch.arange(len(y)), y] = -0.9  # the true class often behind one of the 48 foreign ones
    other = torch.where(y == 3, 7, 3)
    logits[torch.arange(len(y)), other] = -1.5  # but always ahead of the client's other class
    own, _ = own_class_loss(logits, y)
    assert own < 0.5 * prior_loss(y)
    assert scale_free_loss(logits, y)[0] > prior_loss(y)  # over every column the foreign mass swamps it
    constant = torch.tensor([0.0] * 50).index_fill(0, torch.tensor([3]), 2.0).expand(len(y), 50)
    assert own_class_loss(constant, y)[0] >= prior_loss(y) - 1e-9
    assert own_class_loss(logits[:0], y[:0]) == (0.0, 1.0)
    wrong = F.one_hot(other, 50).double()  # confident in the client's *other* class
    assert own_class_loss(wrong, y)[0] > prior_loss(y)


def test_last_loss_is_the_classification_ce_without_the_pools_auxiliary_loss() -> None:
    """The validity gate compares `last_loss` with the label-prior loss, so it must be the CE alone: a pool's
    auxiliary loss (an L2P key pull of up to λ·2 nats) is no cross-entropy and used to push a client that learned
    above the prior. `last_total` keeps the whole loss; the gap is exactly the auxiliary term."""
    from promptfcl.training.local import cross_entropy_terms, prior_loss

    class Pool(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.key = nn.Parameter(torch.zeros(1))
            self.aux_loss = torch.zeros(())

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head, self.prompt = nn.Linear(2, 2), Pool()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.prompt.aux_loss = 3.0 + 0.0 * self.prompt.key.sum()  # a constant pull: 3 nats, never a CE
            return self.head(x)

    x = torch.tensor([[4.0, 0.0], [0.0, 4.0]] * 8)
    y = torch.tensor([0, 1] * 8)

    class Data:
        targets = y

        def __len__(self) -> int:
            return len(y)

        def batches(self, *args, **kwargs):
            yield x, y

    torch.manual_seed(0)
    model = Model()
    p = LocalTrainingParams(lr=0.1, local_epochs=30, batch_size=16, grad_clip=None)
    stats = train_local(model, Data(), p, torch.ones(2, dtype=torch.bool), lambda t: t, torch.Generator(), "cpu",
                        cross_entropy_terms)  # fmt: skip
    assert stats["last_total"] == pytest.approx(stats["last_loss"] + 3.0, abs=1e-6)
    assert stats["last_loss"] < 0.5 * prior_loss(y) < stats["last_total"]  # learned; the whole loss would fail
    # a loss function that returns one tensor is its own CE (its last_loss is the whole loss, as before)
    stats = train_local(Model(), Data(), p, torch.ones(2, dtype=torch.bool), lambda t: t, torch.Generator(), "cpu",
                        lambda m, a, b, mk: cross_entropy_terms(m, a, b, mk).total)  # fmt: skip
    assert stats["last_loss"] == stats["last_total"] > 3.0
