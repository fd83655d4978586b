"""Shared building blocks for FedAvg-style methods: a supervised client and a weighted-averaging server.

Most methods are small deltas over these two: override `loss_fn` (extra regularisers, possibly using what the
server sent), `reply` (statistics beside the parameters) or `aggregate` / `run_round` (server-side steps).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from promptfcl.evaluation.client_local import Predict, evaluate_reply, remember_local
from promptfcl.evaluation.validity import mean_reply_moves
from promptfcl.federation.aggregation import (
    RunningMean,
    aggregate_states,
    owner_row_mean,
    screen_updates,
    update_norms,
)
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import (
    ClientContext,
    ClientProgram,
    Grid,
    ReplyFold,
    RoundInfo,
    ServerProgram,
    handles,
)
from promptfcl.federation.validation import ReplySchema, TensorSpec
from promptfcl.methods.base.local_only import LocalModels
from promptfcl.prompts.pools import PromptPool
from promptfcl.seeding import seed_everything, torch_generator
from promptfcl.training.local import (
    LocalTrainingParams,
    LossFn,
    cross_entropy_terms,
    make_optimizer,
    optimizer_tensors,
    restore_optimizer,
    train_local,
)


def set_task(model: torch.nn.Module, task: int) -> None:
    """Tell a model's prompt pool (if any) which task it serves; a no-op for other prompts."""
    prompt = getattr(model, "prompt", None)
    if isinstance(prompt, PromptPool):
        prompt.set_task(task)


class AggregationParams(BaseModel):
    """Server-side defences where FedAvg-style methods aggregate (all off by default = plain FedAvg)."""

    model_config = ConfigDict(extra="forbid")
    rule: Literal["mean", "median", "trimmed_mean"] = Field(
        "mean", description="mean (FedAvg, weighted) | coordinate-wise median | trimmed mean (both unweighted)"
    )
    trim_fraction: float = Field(0.1, ge=0, lt=0.5, description="trimmed_mean: fraction cut at each end")
    max_update_norm: float | None = Field(None, gt=0, description="refuse updates ‖w_k − w‖₂ above this")
    norm_outlier_factor: float | None = Field(
        None, gt=1, description="refuse updates whose norm exceeds this × the round's median norm (≥ 3 clients)"
    )


class FedAvgParams(LocalTrainingParams):
    """Local training plus how the server weights (and screens) client updates."""

    weighting: Literal["samples", "uniform"] = Field("samples", description="FedAvg weights ∝ samples or equal")
    aggregation: AggregationParams = Field(default_factory=AggregationParams)
    personal_head: Literal["owners", "uniform"] = Field(
        "owners",
        description="personalized scenarios: each head row averaged over the clients whose current task holds its "
        "class (owners) or over every client (uniform: FedMGP's official fed_avg_head)",
    )
    local_only: bool = Field(
        False,
        description="control, not a paper row: each client trains only its own model from round to round, nothing "
        "is averaged, and the run is scored as the mean over clients of each client's model (methods that run the "
        "plain FedAvg round only)",
    )


class SupervisedClient(ClientProgram):
    """Loads the server's parameters, trains on the current task with masked CE, returns its parameters.

    Tensors in the server's message that are not model parameters (e.g. prototypes) are left for `loss_fn`.
    An `evaluate` message (the `client_local` regime) tests the sent global model on the client's local test
    splits; in personalized scenarios the client also records its trained (pre-aggregation) model's accuracy.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._model: torch.nn.Module | None = None

    @property
    def model(self) -> torch.nn.Module:
        """A working model reused across clients; every call loads its full state first, so nothing leaks."""
        if self._model is None:
            self._model = self.new_model()
        return self._model

    def load(self, message: Message, ctx: ClientContext) -> torch.nn.Module:
        """The working model with the message's parameters, its prompt pool serving this client's task."""
        model = self.model
        model.set_state({k: message.tensors[k] for k in model.state_dict()})
        set_task(model, self.pool_task(ctx))
        return model

    @handles("train")
    def handle_train(self, message: Message, ctx: ClientContext) -> Message:
        model = self.load(message, ctx)
        stats = self.train(model, ctx, message)
        remember_local(self.predict(model), ctx, self.env, message)
        return self.reply(model, ctx, stats)

    @handles("evaluate")
    def handle_evaluate(self, message: Message, ctx: ClientContext) -> Message:
        return evaluate_reply(self.predict(self.load(message, ctx)), ctx, self.env, message)

    def pool_task(self, ctx: ClientContext) -> int:
        """The task a prompt pool serves while this client trains (the run's task / stage)."""
        return ctx.stage

    def predict(self, model: torch.nn.Module) -> Predict:
        """How this client's model classifies images of a given task (the `client_local` regime)."""
        return lambda x, task: model(x)

    def loss_fn(self, message: Message, ctx: ClientContext) -> LossFn:
        """The training loss for this message (default: CE over the allowed logits plus the pool's auxiliary
        loss, with the CE beside it for the validity gate)."""
        return cross_entropy_terms

    def train(
        self, model: torch.nn.Module, ctx: ClientContext, message: Message, loss: LossFn | None = None
    ) -> dict[str, float]:
        """Local training on the task's data with `loss` (default: this message's `loss_fn`)."""
        p = self.params
        if len(ctx.train_data) == 0:
            return {"loss": 0.0}
        opt = make_optimizer(p, self.param_groups(model, ctx, message))
        if p.optimizer_reset == "never":
            restore_optimizer(opt, ctx.state.tensors)
        stats = train_local(
            model,
            ctx.train_data,
            p,
            ctx.space(self.env).train_mask(ctx.label_task, p.train_logits),
            self.env.train_transform(p.augment),
            torch_generator(ctx.seed, "local"),
            ctx.device,
            self.loss_fn(message, ctx) if loss is None else loss,
            opt,
        )
        if p.optimizer_reset == "never":
            ctx.state.tensors.update(optimizer_tensors(opt))
        return stats

    def param_groups(
        self, model: torch.nn.Module, ctx: ClientContext, message: Message
    ) -> list[torch.nn.Parameter] | list[dict]:
        """What the local optimizer updates: every parameter that requires grad, at `lr` (a method returns torch
        param groups to give a group its own `lr`)."""
        return [q for q in model.parameters() if q.requires_grad]

    def reply(self, model: torch.nn.Module, ctx: ClientContext, stats: dict[str, float]) -> Message:
        """The upload: trained parameters, sample count and loss (methods add statistics here)."""
        return Message(
            model.get_state(), {"num_samples": len(ctx.train_data), **loss_scalars(stats)}, kind="train_reply"
        )


# what a train reply reports of its training loss
LOSS_KEYS = ("loss", "last_loss", "last_total", "chance_loss", "prior_loss")


def loss_scalars(stats: dict[str, float]) -> dict[str, float]:
    """The training-loss scalars a train reply carries: mean loss, final-epoch loss, ln K and the label-prior loss
    (when measured)."""
    return {k: float(stats[k]) for k in LOSS_KEYS if k in stats}


def usable_replies(replies: dict[int, Message]) -> dict[int, Message]:
    """The replies of clients that trained on data this round, in client-id order (so aggregation and statistics do
    not depend on the order replies arrived in)."""
    return {c: replies[c] for c in sorted(replies) if replies[c].scalars.get("num_samples", 0) > 0}


def round_loss(replies: dict[int, Message]) -> dict[str, float]:
    """The round's mean of its replies' loss scalars (`loss`, and the others of `LOSS_KEYS` when all carry them)."""
    out: dict[str, float] = {}
    for key in LOSS_KEYS:
        values = [float(r.scalars[key]) for r in replies.values() if key in r.scalars]
        if values and (key == "loss" or len(values) == len(replies)):
            out[key] = sum(values) / len(values)
    out.setdefault("loss", float("nan"))
    return out


class RoundServer(ServerProgram):
    """A server holding one global model (`self.model`) whose round is the shared sequence of hooks (`run_round`):
    a method overrides the hooks its paper changes and never rewrites the broadcast, the usable-reply filter or
    the loss bookkeeping."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        seed_everything(self.env.seed, "model_init")
        self.model = self.new_model()
        self.round_info = RoundInfo(0, 0, ())

    def begin_stage(self, task: int) -> None:
        prompt = getattr(self.model, "prompt", None)
        if isinstance(prompt, PromptPool):
            prompt.start_task(task)  # pools that grow per task draw the new block here, once

    def run_round(self, grid: Grid, info: RoundInfo) -> dict[str, float]:
        """One round as hooks, so that no method rewrites the broadcast and the bookkeeping:
        `before_round` (exchanges before training) → `configure` (each participant's message) → the grid
        delivers, validates and (`reply_fold`) folds → `reply_metrics` (from every reply) → usable replies (data
        held, update screening) with their loss and the moves of what clients keep to themselves → `aggregate` →
        `after_aggregate` → `after_round`."""
        self.round_info = info
        metrics = dict(self.before_round(grid, info))
        replies = grid.send(self.configure(info), self.reply_fold())
        metrics.update(self.reply_metrics(replies))
        usable = self.screen(usable_replies(replies), grid)
        metrics.update({**round_loss(usable), **mean_reply_moves([r.scalars for r in usable.values()])})
        metrics["clients"] = len(usable)
        if usable:
            metrics.update(self.aggregate(usable) or {})
            metrics.update(self.after_aggregate(usable, info))
        metrics.update(self.after_round(grid, info, metrics))
        return metrics

    def before_round(self, grid: Grid, info: RoundInfo) -> dict[str, float]:
        """Exchanges before the training messages (e.g. statistics a round's downlink needs); returns metrics."""
        return {}

    def configure(self, info: RoundInfo) -> dict[int, Message]:
        """Each participant's training message (default: the same `downlink` for all)."""
        message = self.downlink(info)
        return {c: message for c in info.participants}

    def reply_fold(self) -> ReplyFold | None:
        """How each validated reply is folded as it arrives (see `Grid.send`); default: none, replies kept whole."""
        return None

    def reply_metrics(self, replies: dict[int, Message]) -> dict[str, float]:
        """Metrics from every reply of the round (clients without data included)."""
        return {}

    def after_round(self, grid: Grid, info: RoundInfo, metrics: dict[str, float]) -> dict[str, float]:
        """Exchanges after aggregation (e.g. an end-of-task merge); `metrics` is the round's so far."""
        return {}

    def screen(self, replies: dict[int, Message], grid: Grid) -> dict[int, Message]:
        """A server-side defence over the usable replies (refused ones recorded with `grid.reject`); default none."""
        return replies

    def aggregate(self, replies: dict[int, Message]) -> dict[str, float] | None:
        """Update the global model from the round's usable replies; may return metrics."""
        raise NotImplementedError(f"{type(self).__name__} must implement aggregate")

    def after_aggregate(self, replies: dict[int, Message], info: RoundInfo) -> dict[str, float]:
        """Server-side steps after aggregation (statistics, rebalancing, distillation); returns extra metrics."""
        return {}

    def downlink(self, info: RoundInfo) -> Message:
        """What every participant receives this round (default: the global trainable state)."""
        return Message(self.model.get_state(), kind="train")

    def global_model(self) -> torch.nn.Module:
        return self.model

    def state(self) -> Record:
        return Record(self.model.get_state())

    def load_state(self, state: Record) -> None:
        self.model.set_state(state.tensors)


class FedAvgServer(RoundServer):
    """Broadcasts the global trainable state, averages what comes back (by samples or uniformly), with the
    configured robust rule and update screening; folds replies into running sums when it can."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._running: RunningMean | None = None  # this round's running mean of folded replies
        self.local: LocalModels | None = None  # `local_only`: each client's own model, nothing averaged
        if self.params.local_only:
            LocalModels.check_round(type(self), FedAvgServer)
            self.local = LocalModels(self.model.get_state(), self.env.num_clients)

    def run_round(self, grid: Grid, info: RoundInfo) -> dict[str, float]:
        self._running = RunningMean() if self.folds_replies() else None
        try:
            return super().run_round(grid, info)
        finally:
            self._running = None

    def reply_fold(self) -> ReplyFold | None:
        """Into the running mean when this round averages as replies arrive (`folds_replies`)."""
        return self._fold if self._running is not None else None

    # client models after_aggregate reads (HePCo's teachers): their replies are kept whole, not folded
    needs_client_models: ClassVar[bool] = False

    def folds_replies(self) -> bool:
        """Whether this round averages the model tensors as replies arrive, keeping running sums instead of every
        client's tensors (memory flat in the number of clients): plain mean, no update screening, no per-owner
        head rows (`owns_head_rows`), the shared `aggregate`, and no `after_aggregate` that reads them."""
        a = self.params.aggregation
        return (
            a.rule == "mean"
            and a.max_update_norm is None
            and a.norm_outlier_factor is None
            and not self.owns_head_rows()
            and type(self).aggregate is FedAvgServer.aggregate
            and not self.needs_client_models
            and self.local is None
        )

    def owns_head_rows(self) -> bool:
        """Whether each head row is averaged over the clients that train it rather than over every client: on
        scenarios whose clients train different logits in a stage (`MethodEnv.clients_train_own_logits`), unless
        a personalized run asks for the uniform head (`personal_head: uniform`)."""
        if not self.env.clients_train_own_logits:
            return False
        return self.env.client_tasks is None or self.params.personal_head == "owners"

    def _fold(self, client: int, reply: Message) -> Message:
        """Add a usable reply's model tensors to the running mean; keep its scalars and other tensors."""
        n = reply.scalars.get("num_samples", 0)
        if self._running is None or n <= 0:
            return reply
        names = self.model.state_dict().keys()
        self._running.add({k: reply.tensors[k] for k in names}, n if self.params.weighting == "samples" else 1.0)
        return Message({k: v for k, v in reply.tensors.items() if k not in names}, reply.scalars, kind=reply.kind)

    def screen(self, replies: dict[int, Message], grid: Grid) -> dict[int, Message]:
        """The update-norm defence: refuse (and record on the grid) updates that are too large."""
        a = self.params.aggregation
        if not replies or (a.max_update_norm is None and a.norm_outlier_factor is None):
            return replies
        ref = self.model.get_state()
        norms = update_norms([{k: r.tensors[k] for k in ref} for r in replies.values()], ref)
        kept = {}
        for (cid, reply), why in zip(
            replies.items(), screen_updates(norms, a.max_update_norm, a.norm_outlier_factor), strict=True
        ):
            if why is None:
                kept[cid] = reply
            else:
                grid.reject(cid, why)
        return kept

    def reply_schema(self, message: Message) -> ReplySchema | None:
        """A train reply carries the model tensors that were sent (same shapes and dtypes), the declared extras,
        and `num_samples` / `loss`; other message kinds get the generic checks."""
        if message.kind != "train":
            return None
        state = self.model.state_dict()
        required = {k: TensorSpec.like(v) for k, v in state.items() if k in message.tensors}
        return ReplySchema(
            {**required, **self.reply_tensors()}, self.reply_groups(), {"num_samples": (int,), "loss": (int, float)}
        )

    def reply_tensors(self) -> dict[str, TensorSpec]:
        """Tensors a train reply must carry beside the model's (methods that upload more declare them)."""
        return {}

    def reply_groups(self) -> list[dict[str, TensorSpec]]:
        """All-or-none groups of tensors a train reply may carry (e.g. class statistics when it has data)."""
        return []

    def configure(self, info: RoundInfo) -> dict[int, Message]:
        """The global state for every participant or, `local_only`, each participant's own model."""
        if self.local is None:
            return super().configure(info)
        return {c: Message(self.local.state_of(c), kind="train") for c in info.participants}

    def aggregate(self, replies: dict[int, Message]) -> dict[str, float] | None:
        """Update the global model from the round's usable replies; may return metrics."""
        if self.local is not None:
            self.local.keep(replies)
            return None
        weights = None
        if self.params.weighting == "samples":
            weights = [r.scalars["num_samples"] for r in replies.values()]
        names = self.model.state_dict().keys()  # replies may carry statistics beside the parameters
        previous = self.model.get_state()
        a = self.params.aggregation
        if self._running is not None:  # the replies were folded as they arrived (`folds_replies`)
            mean = self._running.result()
        else:
            states = [{k: r.tensors[k] for k in names} for r in replies.values()]
            mean = aggregate_states(states, weights, a.rule, a.trim_fraction)
        if self.owns_head_rows():
            mean.update(self.owned_head(previous, replies, weights))  # each head row from the clients that train it
        self.model.set_state(mean)

    def personal_models(self) -> Iterator[tuple[int, torch.nn.Module]] | None:
        """`local_only`: every client's own model in turn (one reused object); else None (the global model)."""
        return None if self.local is None else self.local.models(self.eval_model())

    def trained_tensors(self) -> dict[str, torch.Tensor]:
        return super().trained_tensors() if self.local is None else self.local.tensors()

    def state(self) -> Record:
        record = super().state()
        if self.local is not None:  # copies: a checkpoint may not hold one tensor under two names
            record.tensors.update({k: v.clone() for k, v in self.local.tensors().items()})
        return record

    def load_state(self, state: Record) -> None:
        if self.local is not None:
            self.local.load(state.tensors)
            state = Record({k: v for k, v in state.tensors.items() if not LocalModels.owns(k)}, state.scalars)
        super().load_state(state)

    def owned_rows(self, client: int) -> list[int]:
        """The head rows `client` trains this round (`MethodEnv.trained_logits`)."""
        return self.env.trained_logits(self.round_info.stage, client)

    def owned_head(
        self, previous: dict[str, torch.Tensor], replies: dict[int, Message], weights: list[float] | None
    ) -> dict[str, torch.Tensor]:
        """Head rows averaged over the clients that train them this round (`owned_rows`); rows nobody trains keep
        their previous value. Uniform FedAvg would average a row one client trains with the others' untouched
        copies, shrinking its update by the number of clients every round."""
        rows = [self.owned_rows(c) for c in replies]
        return {
            k: owner_row_mean(previous[k], [r.tensors[k] for r in replies.values()], rows, weights)
            for k in previous
            if k.startswith("head.")
        }


class PreviousTaskServer(FedAvgServer):
    """FedAvg that also keeps the global model of the end of the previous task (checkpointed with it).

    Methods that distil from or replay against the previous task's model (HePCo, LwF.MC) build on this.
    """

    PREV = "prev/"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prev: torch.nn.Module | None = None

    def keeps_previous(self) -> bool:
        return True

    def end_stage(self, task: int) -> None:
        if self.keeps_previous():
            self.prev = copy.deepcopy(self.model).eval()

    def state(self) -> Record:
        record = super().state()
        if self.prev is not None:
            record.tensors.update({f"{self.PREV}{k}": v for k, v in self.prev.get_state().items()})
        return record

    def load_state(self, state: Record) -> None:
        own = {k: v for k, v in state.tensors.items() if not k.startswith(self.PREV)}
        prev = {k[len(self.PREV) :]: v for k, v in state.tensors.items() if k.startswith(self.PREV)}
        super().load_state(Record(own, state.scalars))
        self.prev = None
        if prev:
            self.prev = self.new_model().eval()
            self.prev.set_state(prev)
