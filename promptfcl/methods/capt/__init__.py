"""CAPT: Class-Aware Prompt Tuning for federated long-tailed learning (Hou et al., arXiv 2503.06993).

No official code exists; this is a reading of the paper with every unspecified choice marked [I] (see
docs/methods/capt.md for the full list and the reasons).

Model (§3.1–3.2): frozen CLIP; general prompt P_g (M context vectors, MaPLe-deep in layers 0..J−1),
class-aware prompts P_c (C × T context vectors), coupling F (one Linear(w_text → w_vision) per depth) giving
the vision prompts F(P_g) (Eq. 3, z' = f([x, F(P_g)])). Defaults M = T = 4 [I: the paper's baseline prompt
length], J = 9 [I: MaPLe], λ = 1, SGD lr 1e-3, batch 32, 1 local epoch (App. B).

Client (Algorithm 1, local training): L = L_ge + λ·L_ca (Eq. 4) on z':
- L_ge (Eq. 1): CE over logit_scale·cos(t_g^j, z'), t_g^j = g([P_g, CLASS_j]) (the printed denominator's index
  typo is read as the standard softmax);
- L_ca (Eq. 2): −log(π_y e^{s_y} / Σ_j π_j e^{s_j}), s_j = logit_scale·cos(t^j, z'), π the global class prior from
  the clients' uploaded label counts (balanced-softmax form); "only the prompt of the true class is updated":
  each sample's L_ca reaches P_c only through its own class's row (the other rows' text features are detached
  for that sample).
- Inference: plain (not prior-adjusted) cosine logits of t_i.

Deviation from Eq. 2 as printed (switch `ca_text`, default `auto` = `integrated` when both prompts exist): L_ca
and inference use the integrated text feature t_i = g([P_g, P_c^i, CLASS_i]) instead of Eq. 2's
t_c^j = g([P_c^j, CLASS_j]). Why: §3.2 defines t_i right after Eq. 3 and introduces it "to optimize this multi-modal
framework" with the joint objective (Eq. 4), and the paper never says which text feature classifies at test time;
training L_ca on t_c leaves t_i, the only feature holding both prompts, untrained, and on the CPU-scale data a
centralised check gave overall / tail 73.4 / 43.1 with t_i vs 71.1 / 29.1 (t_c, class logits) and 56.0 / 2.5 (t_c,
mean of general and class logits). `ca_text: class` is Eq. 2 exactly as printed (inference: the mean of the
general and class-aware logits unless `inference` says otherwise).
The client keeps its P_g, P_c and F in its state between participations and uploads P_g, P_c, its label counts
(and F in rounds that end with a global synchronisation [I: F is only averaged there]). Switch `coupling_sync`:
`global` (default, that reading) | `cluster` (F uploaded every round and averaged with P_g inside the
heterogeneity clusters; the evaluated F is the participants' mean every round). Why the switch: on mini-CLIP the
last average of F, trained apart by the clients for four rounds, alone took one seed's global model from 17.95
to 12.4 % (docs/methods/capt.md, `benchmarks/capt_last_sync.py`); the paper does not say where F is averaged.

Server (Algorithm 1, §3.3, App. A):
1. similarity clustering: pairwise JS divergence of the participants' label distributions (Eq. 5) → K-means
   on the matrix rows, K_s = 3; P_c averaged within each cluster, class row c weighted by the members' counts
   of class c [I; `pc_weighting: samples` = by sample counts] and sent to the members;
2. heterogeneity clustering: complementarity over head ∪ tail classes (Eq. 6; groups by the 75 % / 95 %
   cumulative thresholds of the global counts) → K-means on the rows of the complementarity matrix C, as printed
   ("we construct a complementarity matrix C and apply K-means clustering"), K_h = 3 (§4.1: "the number of
   clusters K to 3"; App. D's grid peaks at 3 similarity × 4 heterogeneity clusters: `het_clusters: 4`); P_g
   averaged (by samples [I]) within each cluster and sent to its members. Switch `het_grouping`: `paper`
   (default, the algorithm as printed) | `deal` (promptfcl's earlier reading of the stated aim, "each cluster
   contains a balanced mix of clients with head classes and those with tail classes": K-means on C's rows finds
   K_h profile groups — clients with the *same* profile — and the clusters are dealt from them so that each
   mixes profiles; `promptfcl.methods.capt.clustering.complementary_clusters`). The default is the paper's
   algorithm because it is what the paper specifies; `deal` is kept because K-means on C groups alike clients,
   the opposite of the aim the text states.
3. a bandit (Eqs. 7–8; arms = global-sync periods {1, 2, 4, 8} [I]) decides when P_g, P_c and F are averaged
   over the participants and sent to every client; reward [I] = relative decrease of the participants' mean
   training loss since the previous synchronisation per unit of communication (bytes of the period / bytes of
   the run's first round).
The evaluated global model [I]: P_g and F the participants' sample-weighted means, P_c rows the class-count-
weighted means (rows no participant holds keep their previous value) — exactly the synchronised prompts in
rounds that synchronise. The prior π [I]: label counts of all clients, asked once before the first round
(`prior_source: participants` = counts of the clients seen so far). Distance metric and clusterer are
pluggable (JS/KL/Wasserstein/TV/cosine; K-means/agglomerative/GMM/spectral), as in the paper's App. D; K-means
is scikit-learn's `KMeans` (k-means++, best of 10, seeded by `derive_seed(seed, "capt", task, round)`).

Extension beyond the paper (`continual: true`, off by default): CAPT in the class-incremental scenarios of the
other methods. P_c has a row for every class of the run from the start (shapes never depend on the task, so
averaging works); a task trains only its classes' logits (`train_logits`), π and the clusterings use the
current task's label counts (re-asked at each task start), rows of classes not yet seen stay at their
initialisation, and evaluation is the framework's task-agnostic one over the seen classes.

Ablations (config): `clustering: false` (FedAvg of every part every round, no bandit), `class_ctx: 0`
(general prompt only), `n_ctx: 0` + `coupling: false` (class-aware only), `coupling: false` (no V-L
alignment), `scheduler: fixed` (no bandit; global sync every `sync_period` rounds).
"""

from __future__ import annotations

import copy
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from promptfcl.clip_model import ClipClassifier
from promptfcl.evaluation.validity import prompt_mechanism
from promptfcl.federation.aggregation import weighted_mean
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext, Grid, MethodEnv, RoundInfo, handles
from promptfcl.federation.validation import ReplySchema
from promptfcl.methods.base import register_method
from promptfcl.methods.base.fedavg import FedAvgServer, SupervisedClient, loss_scalars
from promptfcl.methods.capt.aggregation import classwise_mean
from promptfcl.methods.capt.bandit import BanditScheduler
from promptfcl.methods.capt.clustering import (
    Clusterer,
    Metric,
    cluster_gain,
    cluster_rows,
    complementarity,
    complementary_clusters,
    normalise,
    pairwise_distance,
)
from promptfcl.methods.capt.signals import check_clustering, class_prompts_mechanism, clustering_on
from promptfcl.methods.clip_baselines import ClipFedAvgParams, build_clip_model
from promptfcl.scenario.label_space import masked_logits
from promptfcl.scenario.long_tail import class_groups
from promptfcl.seeding import derive_seed
from promptfcl.training.local import LossFn

MODEL = "model/"


class CaptParams(ClipFedAvgParams):
    """CAPT hyper-parameters: paper values where given, documented inferences otherwise."""

    n_ctx: int = Field(4, ge=0, description="M, general prompt length [I]")
    class_ctx: int = Field(4, ge=0, description="T, class-aware prompt length per class [I]")
    depth: int = Field(9, ge=1, description="J, MaPLe depth of the general prompt and its vision prompts [I]")
    coupling: bool = Field(True, description="vision-language coupling F (Eq. 3)")
    coupling_sync: Literal["global", "cluster"] = Field(
        "global",
        description="F averaged only at global synchronisations [I], or also with P_g in the heterogeneity clusters "
        "every round (uploaded every round)",
    )
    lam: float = Field(1.0, ge=0, description="λ of Eq. 4")
    ca_text: Literal["auto", "integrated", "class"] = Field(
        "auto",
        description="text feature of L_ca and at inference: auto = integrated t_i when M, T > 0 (a documented "
        "deviation from Eq. 2), class = Eq. 2's t_c as printed",
    )
    clustering: bool = Field(True, description="false: FedAvg of everything every round (ablation w/o Clu.)")
    sim_clusters: int = Field(3, gt=0, description="K of the similarity clustering (P_c); §4.1: 3")
    het_clusters: int = Field(3, gt=0, description="K of the heterogeneity clustering (P_g); §4.1: 3, App. D best: 4")
    het_grouping: Literal["paper", "deal"] = Field(
        "paper",
        description="paper: K-means (clusterer) on the rows of the complementarity matrix, as printed; deal: "
        "profile groups dealt into clusters that mix head- and tail-heavy clients (promptfcl's reading of the aim)",
    )
    distance: Metric = "js"
    clusterer: Clusterer = "kmeans"
    pc_weighting: Literal["class_counts", "samples"] = "class_counts"
    scheduler: Literal["bandit", "fixed"] = "bandit"
    sync_period: int = Field(4, gt=0, description="fixed scheduler: global sync every this many rounds")
    arms: list[int] = Field(default_factory=lambda: [1, 2, 4, 8], min_length=1, description="sync periods")
    bandit_c: float = Field(0.5, ge=0)
    bandit_eps: float = Field(1e-6, gt=0)
    bandit_eta: float | None = Field(None, gt=0, le=1, description="None: 1/N(a) (sample average)")
    bandit_value: Literal["paper", "mean"] = "paper"
    prior_source: Literal["all_clients", "participants"] = "all_clients"
    continual: bool = Field(
        False, description="extension beyond the paper: run in class-incremental scenarios (rows of P_c per class)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> CaptParams:
        if self.n_ctx == 0 and self.class_ctx == 0:
            raise ValueError("CAPT needs a general (n_ctx) or class-aware (class_ctx) prompt")
        if self.ca_text == "integrated" and not (self.n_ctx and self.class_ctx):
            raise ValueError("ca_text: integrated needs both n_ctx > 0 and class_ctx > 0; use ca_text: auto")
        if any(a <= 0 for a in self.arms):
            raise ValueError("bandit arms are sync periods in rounds: all must be positive")
        return self

    @property
    def ca_variant(self) -> str:
        """The text variant L_ca uses: integrated t_i when both prompts exist (auto), else t_c."""
        if self.ca_text == "auto":
            return "integrated" if self.n_ctx and self.class_ctx else "class"
        return self.ca_text


def build_model(env: MethodEnv, p: CaptParams) -> ClipClassifier:
    if env.label_space.num_tasks != 1 and not p.continual:
        raise ValueError(
            "capt is a static (single-task) method: use scenario.kind: long_tailed (num_tasks: 1), or set "
            "method.continual: true for promptfcl's class-incremental extension"
        )
    if p.ca_variant == "integrated" and p.inference == "auto":
        p = p.model_copy(update={"inference": "integrated"})
    return build_clip_model(env, p)


# --------------------------------------------------------------------------------------------- losses


def balanced_softmax_cross_entropy(logits: torch.Tensor, y: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    """−log(π_y e^{s_y} / Σ_j π_j e^{s_j}) averaged over the batch (CAPT Eq. 2, balanced softmax)."""
    return F.cross_entropy(logits + prior.clamp_min(1e-12).log().to(logits.device), y)


def true_row_logits(scale: torch.Tensor, z: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """scale·z·tᵀ where sample i's logits reach the text features (and prompts) only through row y_i."""
    live = scale * z @ t.t()
    frozen = scale * z @ t.detach().t()
    own = F.one_hot(y, t.shape[0]).bool()
    return torch.where(own, live, frozen)


def capt_loss(prior: torch.Tensor, lam: float, ca_text: str, ce_steps: list[float] | None = None) -> LossFn:
    """L = L_ge + λ·L_ca (Eq. 4) on the coupled image feature z'; parts the model lacks are left out. Each step's
    plain cross-entropy term (L_ge, else L_ca's) is appended to `ce_steps` when given: the validity gate compares a
    cross-entropy with the clients' label-prior loss, and the total is a sum of two."""

    def loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        z = model.image_features(x)
        scale = model.backbone.logit_scale
        total = z.new_zeros(())
        ce = None
        if "general" in model.variants:
            ce = F.cross_entropy(masked_logits(scale * z @ model.text_features("general").t(), mask), y)
            total = total + ce
        if "class" in model.variants:
            t = model.text_features(ca_text)
            ca = balanced_softmax_cross_entropy(masked_logits(true_row_logits(scale, z, t, y), mask), y, prior)
            total = total + lam * ca
            ce = ca if ce is None else ce
        if ce_steps is not None and ce is not None:
            ce_steps.append(float(ce.detach()))
        return total

    return loss


# --------------------------------------------------------------------------------------------- client


class CaptClient(SupervisedClient):
    """Keeps its P_g, P_c and F in `ctx.state`; answers label-count queries, training and prompt updates."""

    @handles("label_counts")
    def handle_label_counts(self, message: Message, ctx: ClientContext) -> Message:
        return Message({"label_counts": self.label_counts(ctx)}, kind="label_counts_reply")

    @handles("update")
    def handle_update(self, message: Message, ctx: ClientContext) -> Message:
        """Cluster / global prompts from the server: kept until the next round."""
        ctx.state.tensors.update({k: v.clone() for k, v in message.tensors.items() if k.startswith(MODEL)})
        return Message(kind="ack")

    @handles("train")
    def handle_train(self, message: Message, ctx: ClientContext) -> Message:
        ctx.state.tensors.update({k: v for k, v in message.tensors.items() if k.startswith(MODEL)})
        model = self.model
        model.set_state({k: ctx.state.tensors[MODEL + k] for k in model.state_dict()})
        ce_steps: list[float] = []  # this message's per-step cross-entropy term (the gate's loss)
        loss = capt_loss(message.tensors["prior"], self.params.lam, self.params.ca_variant, ce_steps)
        stats = self.train(model, ctx, message, loss)
        if ce_steps:  # the final epoch's mean cross-entropy term, not the sum of the two terms
            per_epoch = max(len(ce_steps) // self.params.local_epochs, 1)
            stats["last_loss"] = sum(ce_steps[-per_epoch:]) / per_epoch
        state = model.get_state()
        ctx.state.tensors.update({MODEL + k: v for k, v in state.items()})
        parts = model.part_names("general") + model.part_names("class")
        if message.scalars.get("upload_coupling"):
            parts += model.part_names("coupling")
        return Message(
            {**{k: state[k] for k in parts}, "label_counts": self.label_counts(ctx)},
            {"num_samples": len(ctx.train_data), **loss_scalars(stats)},
            kind="train_reply",
        )

    def label_counts(self, ctx: ClientContext) -> torch.Tensor:
        return torch.bincount(ctx.train_data.targets, minlength=self.env.label_space.num_logits).float()

    def loss_fn(self, message: Message, ctx: ClientContext) -> LossFn:
        return capt_loss(message.tensors["prior"], self.params.lam, self.params.ca_variant)


# --------------------------------------------------------------------------------------------- server


class CaptServer(FedAvgServer):
    """Algorithm 1's server: two clusterings, cluster-wise averaging, per-client downlink, bandit-timed sync."""

    @property
    def coupling_every_round(self) -> bool:
        """`coupling_sync: cluster`: F travels every round and is averaged with P_g in the heterogeneity clusters."""
        return self.params.coupling_sync == "cluster"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)  # seeds "model_init" and builds the model
        p: CaptParams = self.params
        self.model: ClipClassifier
        self.num_clients = self.env.num_clients
        self.counts = np.zeros((self.num_clients, self.model.num_classes))
        self.known: set[int] = set()  # clients whose label counts the server has
        self.holding: set[int] = set()  # clients that hold prompts in their state
        self.bandit = BanditScheduler(list(p.arms), p.bandit_c, p.bandit_eps, p.bandit_eta, p.bandit_value)
        self.arm = 0
        self.since = 0  # rounds since the last global sync
        self.loss_ref: float | None = None  # mean participant loss at the last sync
        self.bytes_period = 0
        self.bytes_ref = 0
        self.counts_task = 0  # the task the label counts (and so π) belong to
        self.general = self.model.part_names("general")
        self.cls = self.model.part_names("class")
        self.coupling = self.model.part_names("coupling")
        # this round: bytes exchanged, whether it ends with a global sync, the updates to send (set by the hooks)
        self.sent = 0
        self.sync = False
        self.updates: dict[int, Message] | None = None

    def begin_stage(self, task: int) -> None:
        """Continual extension: π and the clusterings use the new task's label counts (idempotent on resume)."""
        if task != self.counts_task:
            self.counts[:] = 0
            self.known = set()
            self.counts_task = task

    # ---------------------------------------------------------------------------------------- helpers
    def period(self) -> int:
        p: CaptParams = self.params
        return p.arms[self.arm] if p.scheduler == "bandit" else p.sync_period

    def prior(self) -> torch.Tensor:
        """π: global class frequencies from the label counts the server has (uniform before any)."""
        total = self.counts.sum(0)
        if total.sum() == 0:
            return torch.full((self.model.num_classes,), 1.0 / self.model.num_classes)
        return torch.tensor(total / total.sum(), dtype=torch.float32)

    def head_and_tail(self) -> list[int]:
        total = self.counts.sum(0)
        groups = class_groups({c: int(n) for c, n in enumerate(total) if n > 0})
        return sorted(groups["head"] + groups["tail"])

    def _class_mean(self, replies: list[Message], keep: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        if self.params.pc_weighting == "samples":
            return weighted_mean([{k: r.tensors[k] for k in self.cls} for r in replies], self._samples(replies))
        counts = [r.tensors["label_counts"] for r in replies]
        return {k: classwise_mean([r.tensors[k] for r in replies], counts, keep[k] if keep else None) for k in self.cls}

    @staticmethod
    def _samples(replies: list[Message]) -> list[float]:
        return [float(r.scalars["num_samples"]) for r in replies]

    def _mean(self, names: list[str], replies: list[Message]) -> dict[str, torch.Tensor]:
        return weighted_mean([{k: r.tensors[k] for k in names} for r in replies], self._samples(replies))

    # ------------------------------------------------------------------------------------------ round
    def before_round(self, grid: Grid, info: RoundInfo) -> dict[str, float]:
        """Ask every client not yet heard from for its label counts (`prior_source: all_clients`); decide whether
        this round ends with a global sync (the bandit's period, or every round without clustering)."""
        p: CaptParams = self.params
        self.sent, self.updates = 0, None
        if p.prior_source == "all_clients" and len(self.known) < self.num_clients:
            ask = {c: Message(kind="label_counts") for c in range(self.num_clients) if c not in self.known}
            for c, r in grid.send(ask).items():
                self.counts[c] = r.tensors["label_counts"].numpy()
                self.known.add(c)
            self.sent += sum(m.nbytes() for m in ask.values())
        self.sync = not p.clustering or self.since + 1 >= self.period()
        return {}

    def configure(self, info: RoundInfo) -> dict[int, Message]:
        """π and, at a client's first contact, the initial prompts."""
        prior = self.prior()
        msgs = {}
        for c in info.participants:
            tensors = {"prior": prior}
            if c not in self.holding:  # first contact: the initial prompts
                tensors.update({MODEL + k: v for k, v in self.model.get_state().items()})
            msgs[c] = Message(tensors, {"upload_coupling": self.sync or self.coupling_every_round}, kind="train")
        self.sent += sum(m.nbytes() for m in msgs.values())
        return msgs

    def reply_metrics(self, replies: dict[int, Message]) -> dict[str, float]:
        self.holding |= set(replies)
        self.sent += sum(r.nbytes() for r in replies.values())
        return {"sync": float(self.sync)}

    def reply_schema(self, message: Message) -> ReplySchema | None:
        return None  # the generic checks: the prompts travel under MODEL-prefixed names

    def aggregate(self, replies: dict[int, Message]) -> dict[str, float]:
        """The evaluated global model from the participants' means, then each client's update: the global prompts
        at a sync, else its similarity cluster's class-aware prompts and its heterogeneity cluster's general ones."""
        p: CaptParams = self.params
        info = self.round_info
        metrics: dict[str, float] = {}
        for c, r in replies.items():
            self.counts[c] = r.tensors["label_counts"].numpy()
            self.known.add(c)
        ids, rs = list(replies), list(replies.values())
        seed = derive_seed(self.env.seed, "capt", info.stage, info.round)

        # the evaluated global model: participants' means (P_c rows from the clients that hold each class)
        new = self.model.get_state()
        new.update(self._mean(self.general, rs) if self.general else {})
        new.update(self._class_mean(rs, new) if self.cls else {})
        if (self.sync or self.coupling_every_round) and self.coupling:
            new.update(self._mean(self.coupling, rs))
        self.model.set_state(new)

        if self.sync:  # global aggregation, distributed to every client
            full = {MODEL + k: v for k, v in new.items()}
            updates = {c: Message(full, kind="update") for c in range(self.num_clients)}
            self.holding = set(range(self.num_clients))
        else:
            updates = {c: Message(kind="update") for c in ids}
            d = normalise(np.stack([r.tensors["label_counts"].numpy() for r in rs]))
            if self.cls:  # similarity clustering → class-aware prompts
                dist = pairwise_distance(d, p.distance)
                labels = cluster_rows(dist, p.sim_clusters, p.clusterer, seed)
                metrics["sim_clusters"] = int(labels.max()) + 1
                gain = cluster_gain(dist, labels, seed)
                if gain is not None:
                    metrics["sim_cluster_gain"] = gain
                for g in range(int(labels.max()) + 1):
                    members = [i for i in range(len(ids)) if labels[i] == g]
                    avg = self._class_mean([rs[i] for i in members], None)
                    for i in members:
                        updates[ids[i]].tensors.update({MODEL + k: v for k, v in avg.items()})
            if self.general:  # heterogeneity clustering → general prompts
                comp = complementarity(d, self.head_and_tail())
                group = cluster_rows if p.het_grouping == "paper" else complementary_clusters
                labels = group(comp, p.het_clusters, p.clusterer, seed + 1)
                metrics["het_clusters"] = int(labels.max()) + 1
                shared = self.general + (self.coupling if self.coupling_every_round else [])
                for g in range(int(labels.max()) + 1):
                    members = [i for i in range(len(ids)) if labels[i] == g]
                    avg = self._mean(shared, [rs[i] for i in members])
                    for i in members:
                        updates[ids[i]].tensors.update({MODEL + k: v for k, v in avg.items()})
        self.updates = updates
        return metrics

    def after_round(self, grid: Grid, info: RoundInfo, metrics: dict[str, float]) -> dict[str, float]:
        """Send the updates, then the bandit's bookkeeping (a round nobody trained in sends nothing)."""
        if self.updates is None:
            return {}
        grid.send(self.updates)
        self.sent += sum(m.nbytes() for m in self.updates.values())
        out: dict[str, float] = {}
        self._schedule(self.sync, metrics["loss"], self.sent, out)
        return out

    def _schedule(self, sync: bool, loss: float, sent: int, metrics: dict[str, float]) -> None:
        """Bandit bookkeeping: reward the arm whose period ends with this sync, then pick the next arm."""
        self.bytes_ref = self.bytes_ref or sent
        self.bytes_period += sent
        if not sync:
            self.since += 1
            return
        if self.params.scheduler == "bandit" and self.params.clustering:
            if self.loss_ref is not None and self.loss_ref > 0:
                reward = (self.loss_ref - loss) / self.loss_ref / (self.bytes_period / self.bytes_ref)
                self.bandit.update(self.arm, reward)
                metrics["bandit_reward"] = reward
            self.arm = self.bandit.select()
            metrics["bandit_period"] = self.period()
        self.loss_ref = loss
        self.since = 0
        self.bytes_period = 0

    def ablations(self) -> dict[str, torch.nn.Module]:
        """"class_prompts": the final model reading only its general prompts (P_c left out of the text features)."""
        if not self.cls or not self.general:
            return {}
        model = copy.deepcopy(self.model)  # shares the frozen CLIP
        model.p = model.p.model_copy(update={"inference": "general"})
        return {"class_prompts": model}

    # ------------------------------------------------------------------------------------------ state
    def global_model(self) -> torch.nn.Module:
        return self.model

    def state(self) -> Record:
        return Record(
            {**self.model.get_state(), "capt/counts": torch.tensor(self.counts)},
            {
                "known": sorted(self.known),
                "holding": sorted(self.holding),
                "bandit": self.bandit.to_dict(),
                "arm": self.arm,
                "since": self.since,
                "loss_ref": self.loss_ref,
                "bytes_period": self.bytes_period,
                "bytes_ref": self.bytes_ref,
                "counts_task": self.counts_task,
            },
        )

    def load_state(self, state: Record) -> None:
        self.model.set_state({k: v for k, v in state.tensors.items() if not k.startswith("capt/")})
        self.counts = state.tensors["capt/counts"].numpy().copy()
        s = state.scalars
        self.known, self.holding = set(s["known"]), set(s["holding"])
        self.bandit.load_dict(s["bandit"])
        self.arm, self.since, self.loss_ref = int(s["arm"]), int(s["since"]), s["loss_ref"]
        self.bytes_period, self.bytes_ref = int(s["bytes_period"]), int(s["bytes_ref"])
        self.counts_task = int(s["counts_task"])


register_method(
    "capt",
    CaptParams,
    CaptServer,
    CaptClient,
    build_model,
    "CLIP general + class-aware prompts, V-L coupling, JS / complementarity client clustering, bandit sync",
    "CAPT (Hou et al., arXiv 2503.06993)",
    builds_on=("promptfl", "maple_fedavg"),
    signals=(prompt_mechanism, class_prompts_mechanism, clustering_on, check_clustering),
)
