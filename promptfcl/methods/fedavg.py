"""Shared building blocks for FedAvg-style methods: a supervised client and a weighted-averaging server.

Most methods are small deltas over these two: override `loss` (extra regularisers), `upload`
(statistics beside the parameters) or `aggregate` / `after_aggregate` (server-side steps).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from promptfcl.federation.aggregation import weighted_mean
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext, ClientProgram, Grid, RoundInfo, ServerProgram
from promptfcl.seeding import seed_everything, torch_generator
from promptfcl.training.local import LocalTrainingParams, masked_cross_entropy, train_local


class FedAvgParams(LocalTrainingParams):
    """Local training plus how the server weights client updates."""

    weighting: Literal["samples", "uniform"] = Field("samples", description="FedAvg weights ∝ samples or equal")


class SupervisedClient(ClientProgram):
    """Loads the server's parameters, trains on the current task with masked CE, returns its parameters."""

    loss = staticmethod(masked_cross_entropy)

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
        if message.kind != "train":
            raise ValueError(f"{type(self).__name__} cannot handle message kind {message.kind!r}")
        model = self.model
        model.set_state(message.tensors)
        stats = self.train(model, ctx)
        return Message(
            model.get_state(),
            {"num_samples": len(ctx.train_data), "loss": stats["loss"], **self.upload_scalars(model, ctx)},
            kind="train_reply",
        )

    def train(self, model: torch.nn.Module, ctx: ClientContext) -> dict[str, float]:
        p = self.params
        if len(ctx.train_data) == 0:
            return {"loss": 0.0}
        mask = self.env.label_space.train_mask(ctx.task, p.train_logits)
        return train_local(
            model,
            ctx.train_data,
            p,
            mask,
            self.env.train_transform(p.augment),
            torch_generator(ctx.seed, "local"),
            ctx.device,
            self.loss,
        )

    def upload_scalars(self, model: torch.nn.Module, ctx: ClientContext) -> dict:
        return {}


class FedAvgServer(ServerProgram):
    """Broadcasts the global trainable state, averages what comes back (by samples or uniformly)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        seed_everything(self.env.seed, "model_init")
        self.model = self.new_model()

    def run_round(self, grid: Grid, info: RoundInfo) -> dict[str, float]:
        replies = grid.broadcast(info.participants, Message(self.model.get_state(), kind="train"))
        usable = {c: r for c, r in replies.items() if r.scalars.get("num_samples", 0) > 0}
        if usable:
            self.aggregate(usable)
        losses = [r.scalars["loss"] for r in usable.values()]
        return {"loss": sum(losses) / len(losses) if losses else float("nan"), "clients": len(usable)}

    def aggregate(self, replies: dict[int, Message]) -> None:
        weights = None
        if self.params.weighting == "samples":
            weights = [r.scalars["num_samples"] for r in replies.values()]
        self.model.set_state(weighted_mean([r.tensors for r in replies.values()], weights))

    def global_model(self) -> torch.nn.Module:
        return self.model

    def state(self) -> Record:
        return Record(self.model.get_state())

    def load_state(self, state: Record) -> None:
        self.model.set_state(state.tensors)
