"""The engine-neutral protocol every method is written against.

A method is a `ServerProgram` and a `ClientProgram` exchanging `Message`s through a `Grid`. The server loop
(`promptfcl.experiment`) drives tasks × rounds and calls the server program; the engine (in-process, or
Flower) delivers messages to client programs with the client's persistent `Record` state and its data.
Nothing else crosses the boundary, so the same method file runs on every engine.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pydantic import BaseModel
from torch import nn

from promptfcl.backbones.vit import FrozenViT
from promptfcl.data.base import ImageSplit
from promptfcl.data.loader import LabeledSubset
from promptfcl.data.transforms import ImageTransform
from promptfcl.federation.faults import FAULT_KEY
from promptfcl.federation.message import Message, Record
from promptfcl.federation.validation import ReplySchema, check_against_sent, check_scalars, nonfinite_tensors
from promptfcl.scenario.label_space import LabelSpace


@dataclass(frozen=True)
class RoundInfo:
    """Where the run is: the stage (a task of the task sequence; in asynchronous scenarios a period in which every
    client trains its own current task), the round within it, and the clients chosen for this round."""

    stage: int
    round: int
    participants: tuple[int, ...]


@dataclass
class ClientFailure:
    """A client whose reply was not used this round, and why.

    `kind`: "error" (the client raised), "timeout" (over `engine.client_timeout`), "nonfinite" (NaN/inf in
    the reply), "schema" (wrong tensor names, shapes, dtypes or scalars), "no_reply" (never answered),
    "rejected" (refused by the server's own defence, e.g. an update-norm check). `injected` marks faults of the
    configured fault plan; `attempt` counts retries of the round from 0.
    """

    client: int
    reason: str
    kind: str = "error"
    attempt: int = 0
    injected: bool = False


class RoundFailed(RuntimeError):
    """Fewer than `min_clients` clients gave a usable reply: the round cannot complete."""

    def __init__(self, info: RoundInfo, needed: int, usable: int, failures: list[ClientFailure]) -> None:
        self.info, self.needed, self.usable, self.failures = info, needed, usable, failures
        lines = "; ".join(f"client {f.client} [{f.kind}] {f.reason}" for f in failures)
        super().__init__(
            f"task {info.stage} round {info.round}: {usable} usable repl{'y' if usable == 1 else 'ies'}, "
            f"{needed} needed (engine.min_clients). Failures: {lines or 'none'}"
        )


@dataclass
class GridPolicy:
    """What every engine enforces on a round: the quorum, the per-client time limit, the fault plan."""

    min_clients: int = 1
    client_timeout: float | None = None
    faults: Any = None  # a federation.faults.FaultPlan, or None


@dataclass
class RoundTraffic:
    """Bytes and timing of one round's exchanges, counted the same way by every engine.

    `client_seconds`: wall time of the clients' work as the engine saw it. `client_cpu_seconds`: the process CPU
    seconds (`time.process_time()`, every thread of the process) the clients took, measured where they run in the
    server's process (the in-process engine, one client after another); None where they run in other processes
    (Flower), whose CPU the server cannot see."""

    bytes_down: int = 0
    bytes_up: int = 0
    messages: int = 0
    client_seconds: float = 0.0
    client_cpu_seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        cpu = self.client_cpu_seconds
        return {
            "bytes_down": self.bytes_down,
            "bytes_up": self.bytes_up,
            "messages": self.messages,
            "client_seconds": round(self.client_seconds, 4),
            "client_cpu_seconds": None if cpu is None else round(cpu, 4),
        }


ReplyFold = Callable[[int, Message], Message]  # a server's fold of one validated reply (see Grid.send)
ReplyExpectation = Callable[[Message], ReplySchema | None]


class Grid(ABC):
    """What a server program uses to reach clients; engines implement `_deliver`.

    The base class does what every engine must do identically: stamp `task` (the stage index; the wire and the
    round log keep the key `task`) and `round` on each message,
    inject the fault plan, count bytes down and up, drop every reply that is late, non-finite or does not
    match the server's `ReplySchema` (each with a recorded `ClientFailure`), and raise `RoundFailed` when
    fewer than `min_clients` usable replies remain — so a method only ever aggregates validated replies.
    Engines record transport-level failures (a client that raised or timed out) with `fail` and report
    per-client wall time in `elapsed`.
    """

    def __init__(self) -> None:
        self.round = RoundInfo(0, 0, ())
        self.attempt = 0
        self.traffic = RoundTraffic()
        self.failures: list[ClientFailure] = []
        self.policy = GridPolicy()
        self.expect: ReplyExpectation | None = None  # usually the server program's `reply_schema`
        self.elapsed: dict[int, float] = {}
        self._injected: set[int] = set()
        # client states the engine holds and checkpoints (in-process: all; Flower: none, nodes keep their own)
        self.states: dict[int, Record] = {}
        self._fold: ReplyFold | None = None  # set for the duration of one `send`
        self._folded: dict[int, Message] = {}
        # extra scalars stamped on this round's messages (e.g. the evaluation regime's `measure_local`)
        self.stamp: dict[str, Any] = {}

    def configure(self, policy: GridPolicy, expect: ReplyExpectation | None = None) -> None:
        """Set the round policy and the function giving the expected reply schema of a sent message."""
        self.policy, self.expect = policy, expect

    def start_round(self, info: RoundInfo, attempt: int = 0) -> None:
        """A new round (attempt 0) resets traffic and failures; a retry (attempt > 0) accumulates them."""
        self.round, self.attempt = info, attempt
        if attempt == 0:
            self.traffic = RoundTraffic()
            self.failures = []

    def fail(self, client: int, kind: str, reason: str) -> None:
        """Record that `client`'s reply is not used this round (engines and server defences call this)."""
        injected = client in self._injected
        self.failures.append(ClientFailure(client, reason, kind, self.attempt, injected))

    def reject(self, client: int, reason: str) -> None:
        """A server-side defence refused this client's (otherwise valid) reply."""
        self.fail(client, "rejected", reason)

    def send(self, messages: Mapping[int, Message], fold: ReplyFold | None = None) -> dict[int, Message]:
        """Deliver one message per client id; return the validated replies of the clients that answered.

        `fold(client, reply) -> reply` is applied to every validated reply, as soon as the engine hands it over
        (`_received`; the in-process engine does so client by client): a server that averages can add the
        reply's tensors to running sums and keep only what remains (scalars, statistics), so a round never holds
        every client's full reply. A round that then misses its quorum raises as usual (discard the sums).
        """
        self._fold, self._folded = fold, {}
        stamped: dict[int, Message] = {}
        lost: set[int] = set()
        self._injected = set()
        plan = self.policy.faults
        for cid, msg in messages.items():  # own scalars; tensors shared with `msg` until the engine delivers
            m = Message(dict(msg.tensors), copy.deepcopy(msg.scalars), kind=msg.kind)
            m.scalars.setdefault("task", self.round.stage)
            m.scalars.setdefault("round", self.round.round)
            for k, v in self.stamp.items():
                m.scalars.setdefault(k, v)
            self.traffic.bytes_down += m.nbytes()
            fault = None
            if plan:
                fault = plan.fault_for(self.round.stage, self.round.round, self.attempt, cid, self.round.participants)
            if fault is not None:
                self._injected.add(cid)
                if fault.kind == "no_reply":
                    lost.add(cid)
                else:
                    m.scalars[FAULT_KEY] = fault.to_scalar()
            stamped[cid] = m
        self.traffic.messages += len(stamped)
        self.elapsed = {}
        n_failed = len(self.failures)
        try:
            raw = self._deliver({c: m for c, m in stamped.items() if c not in lost})
        finally:
            for m in stamped.values():
                m.scalars.pop(FAULT_KEY, None)
        failed = {f.client for f in self.failures[n_failed:]}
        replies: dict[int, Message] = {}
        for cid in sorted(stamped):
            if cid in failed:
                continue
            if cid in self._folded:  # already checked (and folded) when the engine handed it over
                replies[cid] = self._folded[cid]
                continue
            if cid not in raw:
                self.fail(cid, "no_reply", "no reply")
                continue
            accepted = self._accept(cid, stamped[cid], raw[cid])
            if accepted is not None:
                replies[cid] = accepted
        self._fold, self._folded = None, {}
        needed = min(self.policy.min_clients, len(stamped))
        if len(replies) < needed:
            raise RoundFailed(self.round, needed, len(replies), self.failures[n_failed:])
        return replies

    def _accept(self, cid: int, sent: Message, reply: Message) -> Message | None:
        """Count, check and (when the server folds) fold one reply; None if it is unusable (failure recorded)."""
        problem = self._problem(cid, sent, reply)
        self.traffic.bytes_up += _safe_nbytes(reply)
        if problem is not None:
            self.fail(cid, *problem)
            return None
        return self._fold(cid, reply) if self._fold is not None else reply

    def _received(self, cid: int, sent: Message, reply: Message) -> Message | None:
        """For engines that deliver one client at a time: hand over `cid`'s reply as it arrives. It is checked and
        folded at once (see `send`); returns what the round keeps of it (None: unusable, failure recorded)."""
        accepted = self._accept(cid, sent, reply)
        if accepted is not None:
            self._folded[cid] = accepted
        return accepted

    def _problem(self, cid: int, sent: Message, reply: Message) -> tuple[str, str] | None:
        """(kind, reason) why `reply` must not be used, or None."""
        limit = self.policy.client_timeout
        took = self.elapsed.get(cid)
        if limit is not None and took is not None and took > limit:
            return "timeout", f"took {took:.2f} s, over the {limit:g} s limit (engine.client_timeout)"
        if not isinstance(reply, Message):
            return "schema", f"reply is a {type(reply).__name__}, not a Message"
        bad = check_scalars(reply)
        if bad is not None:
            return bad
        if any(not isinstance(t, torch.Tensor) for t in reply.tensors.values()):
            return "schema", "reply carries values that are not tensors"
        schema = self.expect(sent) if self.expect is not None else None
        problems = schema.check(reply) if schema is not None else check_against_sent(reply, sent.tensors)
        if problems:
            return "schema", "; ".join(problems)
        nonfinite = nonfinite_tensors(reply)
        if nonfinite:
            return "nonfinite", "; ".join(nonfinite)
        return None

    def broadcast(self, clients: Iterable[int], message: Message, fold: ReplyFold | None = None) -> dict[int, Message]:
        """Send the same message to several clients (`fold`: see `send`)."""
        return self.send({c: message for c in clients}, fold)

    @abstractmethod
    def _deliver(self, messages: dict[int, Message]) -> dict[int, Message]:
        """Run/transport the (already stamped) messages; return replies by client id.

        The stamped messages share their tensors with the messages the server passed to `send` (a broadcast's
        with one another), so a round holds no per-client copy of the downlink: an engine gives each client its own
        copy when it delivers (`Message.copy` just before the client runs, as the in-process engine does;
        serialising engines copy by construction), so no client can change the server's or another's tensors.

        A client that raises or times out is left out of the result and recorded with `self.fail`; a client
        that simply does not answer is left out (the base class records it). Engines that time clients
        individually put their wall time in `self.elapsed[client]` (checked against `client_timeout`).
        """


def _safe_nbytes(reply: Message) -> int:
    try:
        return reply.nbytes()
    except Exception:  # noqa: BLE001 - a malformed reply still counts its tensor bytes
        return sum(t.numel() * t.element_size() for t in reply.tensors.values() if isinstance(t, torch.Tensor))


@dataclass
class ClientContext:
    """Everything a client program may use while handling one message."""

    client_id: int
    stage: int  # the run loop's stage (the task sequence's task; see `label_task` for the task trained)
    round: int
    state: Record  # persistent for this client across rounds and tasks; nobody else sees it
    train_data: LabeledSubset  # this client's training data in this stage
    seed: int  # derived from (run seed, stage, round, client, message kind)
    device: torch.device
    label_task: int | None = None  # label-space task (logit slots) trained; `stage` unless asynchronous
    # the client's label space (its own task sequence in a personalized scenario); None: the method env's
    label_space: LabelSpace | None = None
    # task → this client's local test split of that task (personalized scenarios; None otherwise)
    local_test: Callable[[int], LabeledSubset] | None = None

    def __post_init__(self) -> None:
        if self.label_task is None:
            self.label_task = self.stage

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
    schedule: list[list[int]] | None = None  # asynchronous scenarios: [stage][client] → label-space task
    class_names: list[str] = field(default_factory=list)  # per logit (CLIP methods build class texts from them)
    num_clients: int = 0
    rounds_per_task: int = 1  # rounds of each stage (methods with an end-of-task exchange: LoRM, PILoRA)
    # personalized scenarios: the test split, data no client holds (FedMGP's proxy data), and which real classes
    # each client trains in each of its tasks ([client][task] → classes: owner-row head averaging)
    server_split: ImageSplit | None = None
    client_tasks: list[list[list[int]]] | None = None

    @property
    def num_stages(self) -> int:
        """Tasks of the run loop: stages of an asynchronous scenario, else the label space's tasks."""
        return len(self.schedule) if self.schedule is not None else self.label_space.num_tasks

    def label_task(self, stage: int, client: int) -> int:
        """The label-space task `client` trains in `stage`."""
        return stage if self.schedule is None else self.schedule[stage][client]

    @property
    def clients_train_own_logits(self) -> bool:
        """Whether clients train different logits in a stage (asynchronous: each its own (client, task) slots;
        personalized: each its own task's classes), so a head row has owners rather than every client."""
        return self.schedule is not None or self.client_tasks is not None

    def trained_logits(self, stage: int, client: int) -> list[int]:
        """The logits (head rows) `client` trains in `stage`: its own task's classes in a personalized scenario,
        else the logits of the label-space task it trains (its own slots in an asynchronous one)."""
        if self.client_tasks is not None:
            return [int(self.label_space.class_to_logit[c]) for c in self.client_tasks[client][stage]]
        return list(self.label_space.tasks[self.label_task(stage, client)].logits)

    def train_transform(self, augment: str) -> ImageTransform:
        from dataclasses import replace

        return replace(self.eval_transform, augment=augment)  # type: ignore[arg-type]


ModelFactory = Callable[[MethodEnv, Any], nn.Module]
# a method's own validity check: reads a finished run's evidence (`evaluation.validity.RunEvidence`) and returns an
# `evaluation.validity.Check`, or None when the run carries no such evidence
ValiditySignal = Callable[[Any], Any]


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

    def begin_stage(self, stage: int) -> None:
        """Called before the first round of each stage, and again when a run resumes inside it (so it must be
        idempotent: a re-call after `load_state` must not change the state)."""

    @abstractmethod
    def run_round(self, grid: Grid, info: RoundInfo) -> dict[str, float]:
        """Exchange messages with `info.participants` and update the global model; returns round metrics."""

    def end_stage(self, stage: int) -> None:
        """Called after the last round of each stage (before evaluation)."""

    def reply_schema(self, message: Message) -> ReplySchema | None:
        """What a reply to `message` must carry (checked by the `Grid` before the server sees it).

        None: only the generic checks (JSON scalars, finite tensors, sent tensors keep shape and dtype).
        """
        return None

    @abstractmethod
    def global_model(self) -> nn.Module:
        """The model the evaluator tests: images → logits over the whole label space."""

    def client_model(self, client: int, label_task: int | None = None) -> nn.Module:
        """The model that serves `client`'s label-space task in task-aware per-(client, task) evaluation (default:
        the global one; servers that send each client its own parameters, like C2Prompt's CPA, return that
        client's; the direct single-task reference and Powder return the task's own model). A server may reuse
        one object for every such model, so the result is only valid until the next call: memory then stays flat
        however many clients and tasks there are."""
        return self.global_model()

    def eval_model(self) -> nn.Module:
        """One model from the method's factory, built once and in eval mode, for a `client_model` that serves every
        (client, task) model through one object; built under a forked RNG so building it never moves the run."""
        if getattr(self, "_eval_model", None) is None:
            with torch.random.fork_rng(devices=[]):  # building a pool draws its first block: keep the run's RNG
                self._eval_model = self.new_model().eval()
        return self._eval_model

    def model_key(self, client: int, label_task: int) -> Hashable | None:
        """Which model `client_model(client, label_task)` is: None for the global model, else a key shared by
        exactly the (client, task) pairs one model serves (C2Prompt's CPA: the client; Powder and the direct
        reference: the task). The evaluator asks for each model once and tests all its tasks with it, and reads
        from these keys which model was scored (metrics.json `scored_model`)."""
        return None

    def personal_models(self) -> Iterator[tuple[int, nn.Module]] | None:
        """For runs scored as the mean over clients of each client's own model on the global test set (the
        local-only control, `methods.base.local_only`): (client, model) for every client in turn, possibly one
        reused object. None (default): the class-incremental regime scores the global model."""
        return None

    def ablations(self) -> dict[str, nn.Module]:
        """The final global model with one of the method's server-side components taken out, by component name
        (e.g. HGP's "rebalancing": the head as FedAvg left it). The class-incremental regime compares each with the
        global model on the final test set (metrics.json `ablations`: paired counts, McNemar verdict), the evidence
        of `validity.component_mechanism`. Default: none."""
        return {}

    def trained_tensors(self) -> dict[str, torch.Tensor]:
        """The trained tensors the server holds (default: the global model's exchanged state), read before and
        after every round to log how far each group moved (`move/<group>`, the validity gate's
        `parameters_moved`). Servers that keep trained state outside the global model (one model per task, per
        client) return it here, names prefixed by owner (`task3/prompt.…`)."""
        model = self.global_model()
        state = model.get_state() if hasattr(model, "get_state") else model.state_dict()
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

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


MessageHandler = Callable[[Any, Message, "ClientContext"], Message]


def handles(*kinds: str) -> Callable[[MessageHandler], MessageHandler]:
    """Mark a `ClientProgram` method as the handler of these message kinds: `@handles("train")`.

    The program's `handle` routes by kind; a subclass that overrides a marked method (without re-marking it) keeps
    its route, and one that marks another method for the same kind takes the route over.
    """

    def mark(fn: MessageHandler) -> MessageHandler:
        fn.__promptfcl_handles__ = kinds  # type: ignore[attr-defined]
        return fn

    return mark


class ClientProgram(_Program):
    """The client side of a method. Holds no per-client data: that lives in `ctx.state`.

    Each message kind the program answers has a method marked `@handles(kind)`; `message_kinds` lists them (engines
    that route by kind read it) and `handle` dispatches to them.
    """

    routes: ClassVar[dict[str, str]] = {}  # message kind → name of the method that handles it
    message_kinds: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        routes: dict[str, str] = {}
        for klass in reversed(cls.__mro__):  # base classes first, so subclasses take routes over
            for name, attr in vars(klass).items():
                for kind in getattr(attr, "__promptfcl_handles__", ()):
                    routes[kind] = name
        cls.routes = routes
        cls.message_kinds = tuple(routes)

    def handle(self, message: Message, ctx: ClientContext) -> Message:
        """Answer one server message with the method marked for its kind."""
        name = self.routes.get(message.kind)
        if name is None:
            raise ValueError(
                f"{type(self).__name__} cannot handle message kind {message.kind!r} "
                f"(it handles {', '.join(self.message_kinds) or 'none'})"
            )
        return getattr(self, name)(message, ctx)


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
    scenario_kinds: tuple[str, ...] | None = None  # the scenario kinds it is defined on (None: any)
    signals: tuple[ValiditySignal, ...] = ()  # its own validity checks, applied by the gate beside the generic ones
    builds_on: tuple[str, ...] = ()  # methods its paper builds on (their folders are the only ones it may import)
    # params → the (server, client) classes of a structural variant (e.g. C2Prompt's `base: powder`), or None
    variant: Callable[[Any], tuple[type[ServerProgram], type[ClientProgram]] | None] | None = None
    module: str = ""  # the module that registered it (its folder: `promptfcl.methods.<name>`)
    kind: ClassVar[str] = "method"

    def program_classes(self, params: BaseModel) -> tuple[type[ServerProgram], type[ClientProgram]]:
        """The server and client classes these params select (the registered ones unless a variant applies)."""
        chosen = self.variant(params) if self.variant is not None else None
        return chosen if chosen is not None else (self.server, self.client)

    def programs(self, env: MethodEnv, params: BaseModel) -> tuple[ServerProgram, ClientProgram]:
        server, client = self.program_classes(params)
        return server(env, params, self.build_model), client(env, params, self.build_model)
