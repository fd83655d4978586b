"""The engine-neutral protocol every method is written against.

A method is a `ServerProgram` and a `ClientProgram` exchanging `Message`s through a `Grid`. The server loop
(`promptfcl.experiment`) drives tasks × rounds and calls the server program; the engine (in-process, or
Flower) delivers messages to client programs with the client's persistent `Record` state and its data.
Nothing else crosses the boundary, so the same method file runs on every engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pydantic import BaseModel
from torch import nn

from promptfcl.backbones.vit import FrozenViT
from promptfcl.data.loader import LabeledSubset
from promptfcl.data.transforms import ImageTransform
from promptfcl.federation.message import Message, Record
from promptfcl.scenario.label_space import LabelSpace


@dataclass(frozen=True)
class RoundInfo:
    """Where the run is: task index, round within the task, and the clients chosen for this round."""

    task: int
    round: int
    participants: tuple[int, ...]


@dataclass
class ClientFailure:
    """A client that did not deliver a usable reply this round, and why."""

    client: int
    reason: str


@dataclass
class RoundTraffic:
    """Bytes and timing of one round's exchanges, counted the same way by every engine."""

    bytes_down: int = 0
    bytes_up: int = 0
    messages: int = 0
    client_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes_down": self.bytes_down,
            "bytes_up": self.bytes_up,
            "messages": self.messages,
            "client_seconds": round(self.client_seconds, 4),
        }


class Grid(ABC):
    """What a server program uses to reach clients; engines implement `_deliver`.

    The base class does what every engine must do identically: stamp `task` and `round` on each message,
    count bytes down and up, and keep the round's traffic and failures for the log.
    """

    def __init__(self) -> None:
        self.round = RoundInfo(0, 0, ())
        self.traffic = RoundTraffic()
        self.failures: list[ClientFailure] = []
        # client states the engine holds and checkpoints (in-process: all; Flower: none, nodes keep their own)
        self.states: dict[int, Record] = {}
        # extra scalars stamped on this round's messages (e.g. the evaluation regime's `measure_local`)
        self.stamp: dict[str, Any] = {}

    def start_round(self, info: RoundInfo) -> None:
        self.round = info
        self.traffic = RoundTraffic()
        self.failures = []

    def send(self, messages: Mapping[int, Message]) -> dict[int, Message]:
        """Deliver one message per client id; return the replies of the clients that answered."""
        stamped = {}
        for cid, msg in messages.items():
            m = msg.copy()
            m.scalars.setdefault("task", self.round.task)
            m.scalars.setdefault("round", self.round.round)
            for k, v in self.stamp.items():
                m.scalars.setdefault(k, v)
            stamped[cid] = m
        replies = self._deliver(stamped)
        self.traffic.messages += len(stamped)
        self.traffic.bytes_down += sum(m.nbytes() for m in stamped.values())
        self.traffic.bytes_up += sum(r.nbytes() for r in replies.values())
        return replies

    def broadcast(self, clients: Iterable[int], message: Message) -> dict[int, Message]:
        """Send the same message to several clients."""
        return self.send({c: message for c in clients})

    @abstractmethod
    def _deliver(self, messages: dict[int, Message]) -> dict[int, Message]:
        """Run/transport the (already stamped, privately owned) messages; return replies by client id."""


@dataclass
class ClientContext:
    """Everything a client program may use while handling one message."""

    client_id: int
    task: int
    round: int
    state: Record  # persistent for this client across rounds and tasks; nobody else sees it
    train_data: LabeledSubset  # this client's training data for `task`
    seed: int  # derived from (run seed, task, round, client, message kind)
    device: torch.device
    label_task: int | None = None  # label-space task (logit slots) trained; `task` unless asynchronous
    # the client's label space (its own task sequence in a personalized scenario); None: the method env's
    label_space: LabelSpace | None = None
    # task → this client's local test split of that task (personalized scenarios; None otherwise)
    local_test: Callable[[int], LabeledSubset] | None = None

    def __post_init__(self) -> None:
        if self.label_task is None:
            self.label_task = self.task

    def space(self, env: MethodEnv) -> LabelSpace:
        """The label space this client trains and is tested in."""
        return self.label_space if self.label_space is not None else env.label_space


@dataclass
class MethodEnv:
    """Shared, read-only resources handed to both programs of a method."""

    backbone: FrozenViT
    label_space: LabelSpace
    eval_transform: ImageTransform
    device: torch.device
    seed: int
    extras: dict[str, Any] = field(default_factory=dict)
    schedule: list[list[int]] | None = None  # asynchronous scenarios: [stage][client] → label-space task

    @property
    def num_stages(self) -> int:
        """Tasks of the run loop: stages of an asynchronous scenario, else the label space's tasks."""
        return len(self.schedule) if self.schedule is not None else self.label_space.num_tasks

    def label_task(self, stage: int, client: int) -> int:
        """The label-space task `client` trains in `stage`."""
        return stage if self.schedule is None else self.schedule[stage][client]

    def train_transform(self, augment: str) -> ImageTransform:
        from dataclasses import replace

        return replace(self.eval_transform, augment=augment)  # type: ignore[arg-type]


ModelFactory = Callable[[MethodEnv, Any], nn.Module]


class _Program:
    def __init__(self, env: MethodEnv, params: BaseModel, build_model: ModelFactory | None = None) -> None:
        self.env = env
        self.params = params
        self._build_model = build_model

    def new_model(self) -> nn.Module:
        """A fresh model from the method's factory, on the run's device."""
        if self._build_model is None:
            raise NotImplementedError(f"{type(self).__name__} has no model factory")
        return self._build_model(self.env, self.params).to(self.env.device)


class ServerProgram(_Program, ABC):
    """The server side of a method: aggregation and any server-side training, one round at a time."""

    def begin_task(self, task: int) -> None:
        """Called before the first round of each task, and again when a run resumes inside it (so it must be
        idempotent: a re-call after `load_state` must not change the state)."""

    @abstractmethod
    def run_round(self, grid: Grid, info: RoundInfo) -> dict[str, float]:
        """Exchange messages with `info.participants` and update the global model; returns round metrics."""

    def end_task(self, task: int) -> None:
        """Called after the last round of each task (before evaluation)."""

    @abstractmethod
    def global_model(self) -> nn.Module:
        """The model the evaluator tests: images → logits over the whole label space."""

    def client_model(self, client: int, label_task: int | None = None) -> nn.Module:
        """The model that serves `client`'s label-space task in task-aware per-(client, task) evaluation (default:
        the global one; servers that send each client its own parameters, like C2Prompt's CPA, return that
        client's; the direct single-task reference returns the task's own model). Equal arguments must give the
        same object within one evaluation."""
        return self.global_model()

    def evaluate_message(self) -> Message:
        """What clients receive to test the current global model on their own data (`client_local` regime):
        by default the global model's state; methods whose clients keep a personal part send only the shared one."""
        return Message({k: v.detach().clone() for k, v in self.global_model().state_dict().items()}, kind="evaluate")

    @abstractmethod
    def state(self) -> Record:
        """Everything needed to resume (checkpointed after every round)."""

    @abstractmethod
    def load_state(self, state: Record) -> None:
        """Restore what `state()` returned."""


class ClientProgram(_Program, ABC):
    """The client side of a method. Holds no per-client data: that lives in `ctx.state`.

    `message_kinds` lists every message kind `handle` accepts (engines that route by kind, like Flower,
    register one handler per kind).
    """

    message_kinds: ClassVar[tuple[str, ...]] = ("train",)

    @abstractmethod
    def handle(self, message: Message, ctx: ClientContext) -> Message:
        """Answer one server message."""


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: its hyper-parameter model (paper defaults) and its two programs."""

    name: str
    params: type[BaseModel]
    server: type[ServerProgram]
    client: type[ClientProgram]
    build_model: ModelFactory | None
    summary: str
    paper: str = ""
    kind: ClassVar[str] = "method"

    def programs(self, env: MethodEnv, params: BaseModel) -> tuple[ServerProgram, ClientProgram]:
        return self.server(env, params, self.build_model), self.client(env, params, self.build_model)
