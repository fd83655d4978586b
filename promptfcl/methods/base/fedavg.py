"""Shared building blocks for FedAvg-style methods: a supervised client and a weighted-averaging server.

Most methods are small deltas over these two: override `loss_fn` (extra regularisers, possibly using what the
server sent), `reply` (statistics beside the parameters) or `aggregate` / `run_round` (server-side steps).
"""

from __future__ import annotations

import copy
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from promptfcl.evaluation.client_local import Predict, evaluate_reply, remember_local
from promptfcl.federation.aggregation import (
    RunningMean,
    aggregate_states,
    owner_row_mean,
    screen_updates,
    update_norms,
)
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext, ClientProgram, Grid, MethodEnv, RoundInfo, ServerProgram
from promptfcl.federation.validation import ReplySchema, TensorSpec
from promptfcl.prompts.pools import PromptPool
from promptfcl.seeding import seed_everything, torch_generator
from promptfcl.training.local import (
    LocalTrainingParams,
    LossFn,
    make_optimizer,
    masked_cross_entropy,
    optimizer_tensors,
    restore_optimizer,
    train_local,
)


def personal_tasks(env: MethodEnv) -> list[list[list[int]]] | None:
    """[client][task] → real classes, in a personalized scenario (every client its own task sequence); else None."""
    return env.extras.get("client_tasks")


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


class SupervisedClient(ClientProgram):
    """Loads the server's parameters, trains on the current task with masked CE, returns its parameters.

    Tensors in the server's message that are not model parameters (e.g. prototypes) are left for `loss_fn`.
    An `evaluate` message (the `client_local` regime) tests the sent global model on the client's local test
    splits; in personalized scenarios the client also records its trained (pre-aggregation) model's accuracy.
    """

    message_kinds: ClassVar[tuple[str, ...]] = ("train", "evaluate")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._model: torch.nn.Module | None = None

    @property
    def model(self) -> torch.nn.Module:
        """A working model reused across clients; every call loads its full state first, so nothing leaks."""
        if self._model is None:
            self._model = self.new_model()
        return self._model

    def handle(self, message: Message, ctx: ClientContext) -> Message:
        if message.kind not in ("train", "evaluate"):
            raise ValueError(f"{type(self).__name__} cannot handle message kind {message.kind!r}")
        model = self.model
        model.set_state({k: message.tensors[k] for k in model.state_dict()})
        set_task(model, self.pool_task(ctx))
        if message.kind == "evaluate":
            return evaluate_reply(self.predict(model), ctx, self.env, message)
        stats = self.train(model, ctx, message)
        remember_local(self.predict(model), ctx, self.env, message)
        return self.reply(model, ctx, stats)

    def pool_task(self, ctx: ClientContext) -> int:
        """The task a prompt pool serves while this client trains (the run's task / stage)."""
        return ctx.task

    def predict(self, model: torch.nn.Module) -> Predict:
        """How this client's model classifies images of a given task (the `client_local` regime)."""
        return lambda x, task: model(x)

    def loss_fn(self, message: Message, ctx: ClientContext) -> LossFn:
        """The training loss for this message (default: CE over the allowed logits)."""
        return masked_cross_entropy

    def train(self, model: torch.nn.Module, ctx: ClientContext, message: Message) -> dict[str, float]:
        p = self.params
        if len(ctx.train_data) == 0:
            return {"loss": 0.0}
        opt = None
        if p.optimizer_reset == "never":
            opt = make_optimizer(p, [q for q in model.parameters() if q.requires_grad])
            restore_optimizer(opt, ctx.state.tensors)
        stats = train_local(
            model,
            ctx.train_data,
            p,
            ctx.space(self.env).train_mask(ctx.label_task, p.train_logits),
            self.env.train_transform(p.augment),
            torch_generator(ctx.seed, "local"),
            ctx.device,
            self.loss_fn(message, ctx),
            opt,
        )
        if opt is not None:
            ctx.state.tensors.update(optimizer_tensors(opt))
        return stats

    def reply(self, model: torch.nn.Module, ctx: ClientContext, stats: dict[str, float]) -> Message:
        """The upload: trained parameters, sample count and loss (methods add statistics here)."""
        return Message(
            model.get_state(), {"num_samples": len(ctx.train_data), **loss_scalars(stats)}, kind="train_reply"
        )


def loss_scalars(stats: dict[str, float]) -> dict[str, float]:
    """The training-loss scalars a train reply carries: mean loss, final-epoch loss and ln K (when measured)."""
    return {k: float(stats[k]) for k in ("loss", "last_loss", "chance_loss") if k in stats}


def round_loss(replies: dict[int, Message]) -> dict[str, float]:
    """The round's mean of its replies' loss scalars (`loss`, and `last_loss` / `chance_loss` when all carry them)."""
    out: dict[str, float] = {}
    for key in ("loss", "last_loss", "chance_loss"):
        values = [float(r.scalars[key]) for r in replies.values() if key in r.scalars]
        if values and (key == "loss" or len(values) == len(replies)):
            out[key] = sum(values) / len(values)
    out.setdefault("loss", float("nan"))
    return out


class FedAvgServer(ServerProgram):
    """Broadcasts the global trainable state, averages what comes back (by samples or uniformly)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        seed_everything(self.env.seed, "model_init")
        self.model = self.new_model()
        self.round_info = RoundInfo(0, 0, ())
        self._running: RunningMean | None = None  # this round's running mean of folded replies

    def begin_task(self, task: int) -> None:
        prompt = getattr(self.model, "prompt", None)
        if isinstance(prompt, PromptPool):
            prompt.start_task(task)  # pools that grow per task draw the new block here, once

    def run_round(self, grid: Grid, info: RoundInfo) -> dict[str, float]:
        self.round_info = info
        self._running = RunningMean() if self.folds_replies() else None
        try:
            replies = grid.broadcast(info.participants, self.downlink(info), self._fold if self._running else None)
            # in client-id order, so aggregation and statistics do not depend on the order replies arrived in
            # (folded replies: the in-process engine and the base class hand them over in client-id order)
            usable = {c: replies[c] for c in sorted(replies) if replies[c].scalars.get("num_samples", 0) > 0}
            usable = self.screen(usable, grid)
            metrics = {**round_loss(usable), "clients": len(usable)}
            if usable:
                self.aggregate(usable)
                metrics.update(self.after_aggregate(usable, info))
        finally:
            self._running = None
        return metrics

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
        )

    def owns_head_rows(self) -> bool:
        """Whether each head row is averaged over the clients that train it (asynchronous slots; personalized
        tasks with `personal_head: owners`) rather than over every client."""
        return self.env.schedule is not None or (
            personal_tasks(self.env) is not None and self.params.personal_head == "owners"
        )

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

    def downlink(self, info: RoundInfo) -> Message:
        """What every participant receives this round (default: the global trainable state)."""
        return Message(self.model.get_state(), kind="train")

    def after_aggregate(self, replies: dict[int, Message], info: RoundInfo) -> dict[str, float]:
        """Server-side steps after averaging (statistics, rebalancing, distillation); returns extra metrics."""
        return {}

    def aggregate(self, replies: dict[int, Message]) -> None:
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

    def owned_rows(self, client: int) -> list[int]:
        """The head rows `client` trains this round: the logits of its current label-space task (asynchronous:
        its own (client, task) slots; personalized: its own task's classes; otherwise the round's task)."""
        stage, space = self.round_info.task, self.env.label_space
        tasks = personal_tasks(self.env)
        if tasks is not None:
            return [int(space.class_to_logit[c]) for c in tasks[client][stage]]
        return list(space.tasks[self.env.label_task(stage, client)].logits)

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

    def global_model(self) -> torch.nn.Module:
        return self.model

    def state(self) -> Record:
        return Record(self.model.get_state())

    def load_state(self, state: Record) -> None:
        self.model.set_state(state.tensors)


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

    def end_task(self, task: int) -> None:
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
