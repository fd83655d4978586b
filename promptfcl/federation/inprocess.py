"""The default engine: every selected client runs in this process, one after another, on one device.

It owns client states (one `Record` per client, never shared) and delivers by copy (a client can never alias
the server's tensors or another client's). Stamping and byte accounting are the `Grid` base class's;
`run_client` (context, per-(task, round, client) seed, client program) is shared with every other engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from promptfcl.data.base import ImageSplit
from promptfcl.data.loader import LabeledSubset
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext, ClientProgram, Grid
from promptfcl.scenario.scenario import Scenario
from promptfcl.seeding import derive_seed, seed_everything


def run_client(
    client: ClientProgram,
    message: Message,
    client_id: int,
    state: Record,
    scenario: Scenario,
    train: ImageSplit,
    seed: int,
    device: torch.device,
) -> Message:
    """Handle one stamped message on the client side: build its context, seed, run the client program.

    Shared by every engine, so a client step is the same computation wherever it runs.
    """
    task, rnd = int(message.scalars["task"]), int(message.scalars["round"])
    client_seed = derive_seed(seed, "client", task, rnd, client_id, message.kind)
    seed_everything(client_seed)
    label_task = scenario.label_task(task, client_id)
    space = scenario.client_label_space(client_id)  # its own task sequence in a personalized scenario
    data = LabeledSubset.of(train, scenario.client_indices(task, client_id), space.task_class_to_logit(label_task))

    def local_test(t: int) -> LabeledSubset:
        return LabeledSubset.of(train, scenario.client_test_indices(t, client_id), space.task_class_to_logit(t))

    ctx = ClientContext(
        client_id, task, rnd, state, data, client_seed, device, label_task,
        space if scenario.personalized else None, local_test if scenario.personalized else None,
    )  # fmt: skip
    return client.handle(message, ctx)


ClientHook = Callable[[int, Message], None]


class InProcessGrid(Grid):
    """A `Grid` whose clients are a `ClientProgram` plus one state `Record` per client, run serially."""

    def __init__(
        self,
        client: ClientProgram,
        scenario: Scenario,
        train: ImageSplit,
        seed: int,
        device: torch.device,
        on_reply: ClientHook | None = None,
    ) -> None:
        super().__init__()
        self.client = client
        self.scenario = scenario
        self.train = train
        self.seed = seed
        self.device = device
        self.on_reply = on_reply
        self.states: dict[int, Record] = {k: Record() for k in range(scenario.num_clients)}

    def _deliver(self, messages: dict[int, Message]) -> dict[int, Message]:
        replies: dict[int, Message] = {}
        for cid in sorted(messages):
            t0 = time.perf_counter()
            reply = run_client(
                self.client, messages[cid], cid, self.states[cid], self.scenario, self.train, self.seed, self.device
            )
            self.traffic.client_seconds += time.perf_counter() - t0
            replies[cid] = reply.copy()
            if self.on_reply is not None:
                self.on_reply(cid, reply)
        return replies
