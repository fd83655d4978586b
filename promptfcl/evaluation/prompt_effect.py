"""How much a model's prompts (and adapters) change what it predicts: the validity gate's `prompt_effect`.

Each test batch goes through the model twice: as it is, and inside `FrozenViT.prompts_disabled()`, where the
frozen backbone ignores every prompt and adapter and gives exactly its prompt-free output while the head (and
everything else) stays. Counted: predictions that change, accuracy with and without prompts, and — when the model
exposes `features` and `head` — the mean 1 − cos between the prompted and prompt-free features. Whether the
prompts *help* is a paired question on the same images: `gained` images are right only with them, `lost` ones only
without; McNemar's exact test (a two-sided binomial test of gained vs lost, `mcnemar`) classifies the component as
helps / neutral / hurts at `BENEFIT_P`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from promptfcl.scenario.label_space import masked_logits

BENEFIT_P = 0.05  # McNemar's two-sided p below which a component helps (more gained) or hurts (more lost)


def mcnemar(gained: int, lost: int) -> tuple[float, str]:
    """McNemar's exact test of a component on paired predictions: p of a two-sided binomial test of `gained`
    (right only with it) against `lost` (right only without) at 1/2, and the verdict helps / neutral / hurts."""
    from scipy.stats import binomtest

    n = gained + lost
    if n == 0:
        return 1.0, "neutral"
    p = float(binomtest(gained, n, 0.5).pvalue)
    if p < BENEFIT_P:
        return p, "helps" if gained > lost else "hurts"
    return p, "neutral"


def prompt_effect_applies(model: nn.Module) -> bool:
    """Whether "the same model without its prompts" is defined: the model injects something (`has_prompts`) and
    its head does not read the prompt tokens' own outputs (`prompt_free_forward`, e.g. FedMGP's prompt-mean
    readout has nothing to read once the prompts are gone; its mechanism evidence is the key-hit check)."""
    return has_prompts(model) and bool(getattr(model, "prompt_free_forward", True))


def has_prompts(model: nn.Module) -> bool:
    """Whether the model injects anything into the backbone: `prompted` if it says so, else whether its `prompt`
    module has parameters or produces a non-empty spec (fixed deltas, e.g. LoRM's merged module, have none)."""
    flag = getattr(model, "prompted", None)
    if flag is not None:
        return bool(flag)
    prompt = getattr(model, "prompt", None)
    if prompt is None:
        return False
    if any(p.numel() for p in prompt.parameters()):
        return True
    if getattr(prompt, "needs_query", False):
        return False
    with torch.no_grad():
        spec = prompt(1, None)
    return not spec.is_empty()


@dataclass
class PromptEffect:
    """Running counts of the with / without prompts comparison."""

    total: int = 0
    changed: int = 0
    correct_on: int = 0
    correct_off: int = 0
    gained: int = 0  # right with the component, wrong without
    lost: int = 0  # wrong with the component, right without
    shift_sum: float = 0.0
    shift_n: int = 0

    def add_predictions(self, on: torch.Tensor, off: torch.Tensor, y: torch.Tensor) -> None:
        self.total += len(y)
        self.changed += int((on != off).sum())
        self.correct_on += int((on == y).sum())
        self.correct_off += int((off == y).sum())
        self.gained += int(((on == y) & (off != y)).sum())
        self.lost += int(((on != y) & (off == y)).sum())

    def add_counts(self, counts: dict[str, int | float]) -> None:
        for k, v in counts.items():
            setattr(self, k, getattr(self, k) + v)

    def as_dict(self, applicable: bool = True) -> dict[str, float | int | bool | None]:
        pct = 100.0 / self.total if self.total else float("nan")
        p, verdict = mcnemar(self.gained, self.lost)
        return {
            "applicable": applicable,
            "images": self.total,
            "changed": self.changed * pct,
            "accuracy": self.correct_on * pct,
            "accuracy_off": self.correct_off * pct,
            "feature_shift": self.shift_sum / self.shift_n if self.shift_n else None,
            "gained": self.gained,
            "lost": self.lost,
            "mcnemar_p": p,
            "verdict": verdict,
        }


class PromptEffectTally:
    """The prompt effect over several models, added one at a time (so each may be dropped once counted); models
    for which "without prompts" is undefined (`prompt_effect_applies`) are left out."""

    def __init__(self, backbone: nn.Module) -> None:
        self.backbone, self.effect, self.applicable = backbone, PromptEffect(), False

    def add(self, model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        if prompt_effect_applies(model):
            self.applicable = True
            compare_model(model, self.backbone, batches, self.effect)

    def result(self) -> dict[str, float | int | bool | None]:
        return self.effect.as_dict() if self.applicable else {"applicable": False}


@torch.no_grad()
def compare_model(
    model: nn.Module,
    backbone: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    into: PromptEffect | None = None,
) -> PromptEffect:
    """Add `model`'s with / without prompts predictions on `batches` of (images, targets, logit mask)."""
    effect = into or PromptEffect()
    model.eval()
    split = hasattr(model, "features") and hasattr(model, "head")
    for x, y, mask in batches:
        if split:
            f_on = model.features(x)
            with backbone.prompts_disabled():
                f_off = model.features(x)
            on, off = model.head(f_on), model.head(f_off)
            effect.shift_sum += float((1 - F.cosine_similarity(f_on.float(), f_off.float(), dim=1)).sum())
            effect.shift_n += len(x)
        else:
            on = model(x)
            with backbone.prompts_disabled():
                off = model(x)
        mask = mask.to(on.device)
        effect.add_predictions(masked_logits(on, mask).argmax(1), masked_logits(off, mask).argmax(1), y)
    return effect


@torch.no_grad()
def compare_predict(
    predict: Callable[[torch.Tensor], torch.Tensor],
    backbone: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    into: PromptEffect | None = None,
) -> PromptEffect:
    """The same for a bare predict function (images → logits), e.g. a client's personalized model."""
    effect = into or PromptEffect()
    for x, y, mask in batches:
        on = predict(x)
        with backbone.prompts_disabled():
            off = predict(x)
        mask = mask.to(on.device)
        effect.add_predictions(masked_logits(on, mask).argmax(1), masked_logits(off, mask).argmax(1), y)
    return effect


@torch.no_grad()
def compare_ablation(
    model: nn.Module, ablated: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
) -> PromptEffect:
    """The same counts for a server-side component: `model` against `ablated`, the same model with that component
    taken out (e.g. HGP's head before rebalancing), on the same batches."""
    effect = PromptEffect()
    model.eval()
    ablated.eval()
    for x, y, mask in batches:
        on, off = model(x), ablated(x)
        mask = mask.to(on.device)
        effect.add_predictions(masked_logits(on, mask).argmax(1), masked_logits(off, mask).argmax(1), y)
    return effect
