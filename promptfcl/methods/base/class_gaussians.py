"""Shared programs for methods that retrain the head on features sampled from client class Gaussians.

Client (HGP §3.2, CCVR §4.1): train as FedAvg, then compute per-class (count, mean, spread) of the trained
model's features on the local training data and upload them beside the parameters. Server (HGP §3.3, CCVR
§4.2): FedAvg the parameters, replace the current task's Gaussian components with this round's, keep older
tasks' components as they were at the end of their task, then retrain only the head on features drawn from
the components of the chosen classes. HGP and CCVR differ only in their settings (one component per client
and class vs one pooled Gaussian per class; variance inflation; logit normalisation; covariance kind).

Extensions beyond the papers, off by default: `privacy` releases the statistics through the Gaussian mechanism
(`statistics.privacy`: clipped features, every class of the task, noisy (n, Σf, Σf²), docs/privacy.md);
`aggregation` (robust rules, norm checks) as for every FedAvg-style method. The server declares the statistics'
shape (`reply_groups`), so malformed uploads are dropped before pooling.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Literal

import torch
from pydantic import Field

from promptfcl.data.transforms import ImageTransform
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext, RoundInfo
from promptfcl.federation.validation import TensorSpec
from promptfcl.methods.base.fedavg import FedAvgServer, SupervisedClient
from promptfcl.methods.base.prompt_models import FedAvgPromptParams
from promptfcl.seeding import torch_generator
from promptfcl.statistics import GaussianComponents, MixtureSampler, class_statistics, pooled, uploaded_statistics
from promptfcl.statistics.class_stats import extract_features, statistics_schema
from promptfcl.statistics.mixture import ClassWeights
from promptfcl.statistics.privacy import PrivacyParams, noise_generator, private_class_statistics
from promptfcl.training.head_calibration import CalibrationParams, calibrate_head

RebalanceClasses = Literal["all", "current", "old", "none"]


class ClassGaussianParams(FedAvgPromptParams):
    """Statistics, mixture and head-retraining settings shared by HGP and CCVR."""

    covariance: Literal["diag", "full"] = "diag"
    components: Literal["per_client", "pooled"] = Field(
        "per_client", description="one Gaussian per (client, class) (HGP) or one pooled Gaussian per class (CCVR)"
    )
    stats_images: Literal["normalized", "raw"] = Field(
        "normalized", description="statistics on eval-transformed images, or unnormalised [0,1] images (HGP code)"
    )
    class_weights: ClassWeights = Field(
        "counts", description="how often each class is sampled: ∝ its clients' sample counts, or uniform"
    )
    variance_scale: float = Field(1.0, gt=0, description="spread multiplier before sampling")
    variance_eps: float = Field(1e-8, ge=0)
    rebalance: RebalanceClasses = Field(
        "all", description="classes sampled when retraining the head: all seen, current task, old tasks, none"
    )
    calibration: CalibrationParams = Field(default_factory=CalibrationParams)
    privacy: PrivacyParams = Field(default_factory=PrivacyParams, description="Gaussian noise on uploaded statistics")


class ClassGaussianClient(SupervisedClient):
    """FedAvg client that also uploads per-class feature statistics (≥ 2 samples per class)."""

    def stats_transform(self) -> ImageTransform:
        t = self.env.eval_transform
        if self.params.stats_images == "raw":
            t = replace(t, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
        return t

    def reply(self, model: torch.nn.Module, ctx: ClientContext, stats: dict[str, float]) -> Message:
        msg = super().reply(model, ctx, stats)
        if len(ctx.train_data):
            p = self.params
            if p.privacy.enabled:  # (ε, δ)-DP statistics of every class of the task (statistics.privacy)
                feats, ys = extract_features(model.features, ctx.train_data, self.stats_transform(), ctx.device)
                classes = self.env.label_space.tasks[ctx.stage].logits
                gen = noise_generator(p.privacy, ctx.seed)
                st = private_class_statistics(feats, ys, classes, p.covariance, 2, p.privacy, gen)
            else:
                st = class_statistics(
                    model.features, ctx.train_data, self.stats_transform(), ctx.device, p.covariance, 2
                )
            msg.tensors.update(st.to_tensors())
        return msg


class ClassGaussianServer(FedAvgServer):
    """FedAvg, then per-round head retraining on features sampled from the stored class Gaussians."""

    PRE = "pre_rebalance/"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.components = GaussianComponents.empty(self.env.backbone.embed_dim, self.params.covariance == "full")
        self.fedavg_head: dict[str, torch.Tensor] = {}  # the last round's head as FedAvg left it (for `ablations`)

    def after_aggregate(self, replies: dict[int, Message], info: RoundInfo) -> dict[str, float]:
        stats = uploaded_statistics(replies)
        if self.params.components == "pooled" and stats:
            stats = [pooled(stats)]
        self.components = self.components.replace_task(info.stage, stats)
        self.fedavg_head = {k: v.detach().clone() for k, v in self.model.head.state_dict().items()}
        return self.rebalance(info.stage, torch_generator(self.env.seed, "rebalance", info.stage, info.round))

    def ablations(self) -> dict[str, torch.nn.Module]:
        """"rebalancing": the final model with the head FedAvg gave it in the last round, before the server step."""
        if self.params.rebalance == "none" or not self.fedavg_head:
            return {}
        model = copy.deepcopy(self.model)  # shares the frozen backbone
        model.head.load_state_dict(self.fedavg_head)
        return {"rebalancing": model}

    def reply_groups(self) -> list[dict[str, TensorSpec]]:
        space = self.env.label_space
        return [statistics_schema(space.num_logits, self.env.backbone.embed_dim, self.params.covariance)]

    def rebalance_classes(self, task: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(classes whose Gaussians are sampled, logits that compete in the retraining CE).

        HGP (all): every seen class, over all seen logits. CR_cur: the current task's classes over its own
        logits; CR_old: earlier tasks' classes over their logits — so the other part of the head keeps what
        FedAvg gave it (fed-mammoth `hgp_cur_task.py` / `hgp_old_tasks.py` slice the logits the same way).
        """
        space, comps = self.env.label_space, self.components
        first = space.tasks[task].logits[0]
        if self.params.rebalance == "current":
            logits = torch.tensor(space.tasks[task].logits)
        elif self.params.rebalance == "old":
            logits = torch.arange(first)
        elif self.params.rebalance == "all":
            logits = torch.arange(space.seen_logits(task))
        else:
            logits = torch.zeros(0, dtype=torch.long)
        return torch.unique(comps.cls[torch.isin(comps.cls, logits)]), logits

    def calibration_params(self) -> CalibrationParams:
        return self.params.calibration

    def variance_scale(self) -> float:
        """The multiplier applied to the stored spreads before sampling."""
        return self.params.variance_scale

    def sampler(self, classes: torch.Tensor) -> MixtureSampler:
        """The hierarchical sampler over the stored components of `classes`."""
        p = self.params
        return MixtureSampler(self.components, classes, p.class_weights, self.variance_scale(), p.variance_eps)

    def rebalance(self, task: int, gen: torch.Generator) -> dict[str, float]:
        """Retrain the head on sampled features of the chosen classes (no-op when there are none)."""
        classes, logits = self.rebalance_classes(task)
        if len(classes) == 0:
            return {}
        sampler = self.sampler(classes)
        return calibrate_head(self.model.head, sampler, logits, self.calibration_params(), gen, self.env.device)

    def state(self) -> Record:
        pre = {self.PRE + k: v for k, v in self.fedavg_head.items()}
        return Record({**self.model.get_state(), **self.components.to_tensors("gmm/"), **pre})

    def load_state(self, state: Record) -> None:
        own = ("gmm/", self.PRE)
        self.model.set_state({k: v for k, v in state.tensors.items() if not k.startswith(own)})
        self.components = GaussianComponents.from_tensors(state.tensors, "gmm/")
        self.fedavg_head = {k[len(self.PRE) :]: v for k, v in state.tensors.items() if k.startswith(self.PRE)}
