"""The default engine: every selected client runs in this process, one after another, on one device.

It owns client states (one `Record` per client, never shared) and delivers by copy (a client can never alias
the server's tensors or another client's): each client gets its own copy of its message when it runs, so a
round holds one downlink copy at a time however many clients it addresses. A client that raises is dropped
from the round with its error; each client is timed (wall and process CPU seconds, `RoundTraffic`), so the base
class can drop one over `engine.client_timeout`. Stamping, byte accounting and reply validation are the `Grid`
base class's; `run_client` (context, per-(task, round, client) seed, injected fault, client program) is shared
with every other engine.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from promptfcl.data.base import ImageSplit
from promptfcl.data.loader import LabeledSubset
from promptfcl.federation.faults import pop_fault, run_with_fault
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
    fault = pop_fault(message)  # an injected fault of the plan (tests and drills); the program never sees it
    task, rnd = int(message.scalars["task"]), int(message.scalars["round"])
    client_seed = derive_seed(seed, "client", task, rnd, client_id, message.kind)
    seed_everything(client_seed)
    label_task = scenario.label_task(task, client_id)
    space = scenario.client_label_space(client_id)  # its own task sequence in a personalized scenario
    domain = scenario.client_domain(client_id)  # its fixed image domain (scenario.domains), None when off
    data = LabeledSubset.of(
        train, scenario.client_indices(task, client_id), space.task_class_to_logit(label_task), domain
    )

    def local_test(t: int) -> LabeledSubset:
        return LabeledSubset.of(train, scenario.client_test_indices(t, client_id), space.task_class_to_logit(t), domain)

    ctx = ClientContext(
        client_id, task, rnd, state, data, client_seed, device, label_task,
        space if scenario.personalized else None, local_test if scenario.personalized else None,
    )  # fmt: skip
    return run_with_fault(fault, lambda: client.handle(message, ctx))


ClientHook = Callable[[int, Message], None]


def describe_error(e: BaseException) -> str:
    """`Type: message (at file:line in function)` of the innermost frame, for the failure log."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"raised {type(e).__name__}: {e}{where}"


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
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                reply = run_client(  # a private copy per client, made when it runs (one downlink copy alive)
                    self.client, messages[cid].copy(), cid, self.states[cid], self.scenario, self.train, self.seed,
                    self.device,
                )  # fmt: skip
            except Exception as e:  # noqa: BLE001 - any client-side error drops that client, with its reason
                self.fail(cid, "error", describe_error(e))
                continue
            finally:
                took = time.perf_counter() - t0
                self.elapsed[cid] = took
                self.traffic.client_seconds += took
                cpu = time.process_time() - c0  # the process's CPU: the client's, as clients run one at a time
                self.traffic.client_cpu_seconds = (self.traffic.client_cpu_seconds or 0.0) + cpu
            if self.on_reply is not None:
                self.on_reply(cid, reply)
            if self._fold is None:
                replies[cid] = reply.copy()
                continue
            kept = self._received(cid, messages[cid], reply.copy())  # folded now: no full reply is held
            if kept is not None:
                replies[cid] = kept
        return replies
