"""The default engine: every selected client runs in this process, one after another, on one device.

It owns what an engine must own: client states (one `Record` per client, never shared), message delivery by
copy (a client can never alias the server's tensors or another client's), byte accounting, and the
per-(task, round, client) seeding that makes every client step reproducible.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from promptfcl.data.base import ImageSplit
from promptfcl.data.loader import LabeledSubset
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext, ClientFailure, ClientProgram, Grid, RoundInfo
from promptfcl.scenario.scenario import Scenario
from promptfcl.seeding import derive_seed, seed_everything


@dataclass
class RoundTraffic:
    """Bytes and timing of one round's exchanges."""

    bytes_down: int = 0
    bytes_up: int = 0
    messages: int = 0
    client_seconds: float = 0.0
    per_client: dict[int, dict[str, float]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"bytes_down": self.bytes_down, "bytes_up": self.bytes_up, "messages": self.messages,
                "client_seconds": round(self.client_seconds, 4)}


ClientHook = Callable[[int, Message], None]


class InProcessGrid(Grid):
    """A `Grid` whose clients are a `ClientProgram` plus one state `Record` per client, run serially."""

    def __init__(self, client: ClientProgram, scenario: Scenario, train: ImageSplit, seed: int,
                 device: torch.device, on_reply: ClientHook | None = None) -> None:
        self.client = client
        self.scenario = scenario
        self.train = train
        self.seed = seed
        self.device = device
        self.on_reply = on_reply
        self.states: dict[int, Record] = {k: Record() for k in range(scenario.num_clients)}
        self.round = RoundInfo(0, 0, ())
        self.traffic = RoundTraffic()
        self.failures: list[ClientFailure] = []

    def start_round(self, info: RoundInfo) -> None:
        self.round = info
        self.traffic = RoundTraffic()
        self.failures = []

    def client_data(self, task: int, client: int) -> LabeledSubset:
        return LabeledSubset.of(self.train, self.scenario.client_indices(task, client),
                                self.scenario.label_space.class_to_logit)

    def send(self, messages: Mapping[int, Message]) -> dict[int, Message]:
        replies: dict[int, Message] = {}
        info = self.round
        for cid in sorted(messages):
            msg = messages[cid].copy()
            msg.scalars.setdefault("task", info.task)
            msg.scalars.setdefault("round", info.round)
            seed = derive_seed(self.seed, "client", info.task, info.round, cid, msg.kind)
            seed_everything(seed)
            ctx = ClientContext(cid, info.task, info.round, self.states[cid], self.client_data(info.task, cid),
                                seed, self.device)
            t0 = time.perf_counter()
            reply = self.client.handle(msg, ctx)
            dt = time.perf_counter() - t0
            self.traffic.bytes_down += msg.nbytes()
            self.traffic.bytes_up += reply.nbytes()
            self.traffic.messages += 1
            self.traffic.client_seconds += dt
            replies[cid] = reply.copy()
            if self.on_reply is not None:
                self.on_reply(cid, reply)
        return replies
