"""`FlowerGrid`: the promptfcl `Grid` over Flower's `Grid` — our client ids are the SuperNodes' partition ids.

A dead SuperNode is recognised from Flower's node liveness (the SuperLink's view of which nodes heart-beat),
a slow live one is waited for up to a deadline that scales with the measured reply times (see `FlowerGrid`).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable

from flwr.app import ConfigRecord, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid as FlowerGridAPI

from promptfcl.federation.message import Message
from promptfcl.federation.protocol import Grid
from promptfcl.flower.records import flower_message_type, from_record_dict, to_record_dict

HELLO = "query.promptfcl_hello"
OFFLINE = "node offline (liveness)"
DEFAULT_TIMEOUT_FACTOR = 5.0  # a live node may take this many times the median reply time
DEFAULT_LIVENESS_INTERVAL = 5.0  # seconds between two asks of which nodes are online
DEFAULT_POLL_INTERVAL = 1.0  # seconds between two pulls of replies
DEFAULT_WINDOW = 20  # replies per message kind the median reply time is taken over


def discover_partitions(grid: FlowerGridAPI, expected: int, wait_seconds: float = 60.0) -> dict[int, int]:
    """Ask every connected SuperNode for its `partition-id`; returns {partition id: node id}."""
    deadline = time.time() + wait_seconds
    while True:
        nodes = list(grid.get_node_ids())
        if len(nodes) >= expected or time.time() > deadline:
            break
        time.sleep(1.0)
    msgs = [
        FlowerMessage(content=RecordDict({"q": ConfigRecord({"q": "partition"})}), dst_node_id=n, message_type=HELLO)
        for n in nodes
    ]
    mapping: dict[int, int] = {}
    for reply in grid.send_and_receive(msgs, timeout=wait_seconds):
        if reply.has_error():
            continue
        pid = int(reply.content["hello"]["partition-id"])
        if pid in mapping:
            raise RuntimeError(f"two SuperNodes claim partition-id {pid}; give each a distinct one")
        mapping[pid] = reply.metadata.src_node_id
    missing = sorted(set(range(expected)) - set(mapping))
    if missing:
        raise RuntimeError(
            f"no SuperNode serves partition(s) {missing}; start one per client with "
            "--node-config 'partition-id=K num-partitions=N'"
        )
    return mapping


class FlowerGrid(Grid):
    """Delivers our messages as Flower messages and collects the replies; validation and the quorum are the
    `Grid` base class's.

    Waiting for a round's replies (`_deliver`) polls `pull_messages` every `poll_interval` seconds and tells a
    dead node from a slow one by Flower's own node liveness:

    - **offline**: every `liveness_interval` seconds (and before pushing) it asks the SuperLink which nodes are
      online (`get_node_ids()`; a SuperNode heart-beats every ~20 s and the SuperLink marks it offline when none
      came for 2 × its 30 s interval, at once when it stops cleanly). A pending message whose node is no longer
      online, or that the SuperLink answers with a `NODE_UNAVAILABLE` error, is dropped at once as
      `no_reply` with the reason "node offline (liveness)";
    - **live but slow**: a live node is waited for up to the round's deadline, max(`timeout`, `timeout_factor`
      × the median reply time of this message kind over the last `window` replies, this round's included) —
      it grows with the measured round time instead of being a fixed number; past it the message is dropped as
      `no_reply`;
    - **`engine.client_timeout`** keeps its engine-neutral meaning, a hard limit on any client: the grid stops
      waiting for a client at that limit and records `timeout`, as the in-process engine does for a reply that
      took longer.

    A client whose ClientApp raised comes back as an error reply (`error`); a reply that does not decode is
    `schema`.
    """

    def __init__(
        self,
        grid: FlowerGridAPI,
        node_of_client: dict[int, int],
        timeout: float | None = None,
        timeout_factor: float = DEFAULT_TIMEOUT_FACTOR,
        liveness_interval: float = DEFAULT_LIVENESS_INTERVAL,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        window: int = DEFAULT_WINDOW,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__()
        for name, value in (("timeout_factor", timeout_factor), ("liveness_interval", liveness_interval)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        self.grid = grid
        self.node_of_client = node_of_client
        self.client_of_node = {n: c for c, n in node_of_client.items()}
        self.timeout = timeout
        self.timeout_factor = timeout_factor
        self.liveness_interval = liveness_interval
        self.poll_interval = poll_interval
        self.clock, self.sleep = clock, sleep
        # seconds from push to reply of the last `window` usable replies, per message kind
        self.reply_times: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=window))

    def deadline(self, kind: str) -> float | None:
        """How long a live node is waited for on a message of `kind`: max(timeout, factor × median reply time)."""
        times = self.reply_times.get(kind)
        scaled = self.timeout_factor * statistics.median(times) if times else None
        limits = [t for t in (self.timeout, scaled) if t is not None]
        return max(limits) if limits else None

    def online(self) -> set[int]:
        """The node ids the SuperLink currently sees as online (heart-beating)."""
        return set(self.grid.get_node_ids())

    def _deliver(self, messages: dict[int, Message]) -> dict[int, Message]:
        t0 = self.clock()
        replies: dict[int, Message] = {}
        online = self.online()
        for cid in sorted(messages):
            if self.node_of_client[cid] not in online:
                self.fail(cid, "no_reply", OFFLINE)
        out = {
            cid: FlowerMessage(
                content=to_record_dict(m),
                dst_node_id=self.node_of_client[cid],
                message_type=flower_message_type(m.kind),
                group_id=f"{self.round.stage}.{self.round.round}",
            )
            for cid, m in messages.items()
            if self.node_of_client[cid] in online
        }
        pending: dict[str, int] = {}
        if out:
            ids = list(self.grid.push_messages(list(out.values())))
            for k, cid in enumerate(out):
                if k < len(ids) and ids[k]:
                    pending[ids[k]] = cid
                else:
                    self.fail(cid, "error", "the SuperLink did not accept the message (see the ServerApp log)")
        kind_of = {cid: m.kind for cid, m in messages.items()}
        hard = self.policy.client_timeout
        next_liveness = t0 + self.liveness_interval
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                cid = pending.pop(reply.metadata.reply_to_message_id, None)
                if cid is None:
                    continue
                if reply.has_error():
                    if reply.error.code == ErrorCode.NODE_UNAVAILABLE:
                        self.fail(cid, "no_reply", OFFLINE)
                    else:
                        self.fail(cid, "error", f"client error: {reply.error.reason}")
                    continue
                try:
                    replies[cid] = from_record_dict(reply.content)
                except Exception as e:  # noqa: BLE001 - a reply that does not decode is a schema failure
                    self.fail(cid, "schema", f"reply does not decode: {type(e).__name__}: {e}")
                    continue
                self.reply_times[kind_of[cid]].append(self.clock() - t0)
            if not pending:
                break
            now = self.clock()
            if now >= next_liveness:
                online = self.online()
                next_liveness = now + self.liveness_interval
                for mid, cid in list(pending.items()):
                    if self.node_of_client[cid] not in online:
                        del pending[mid]
                        self.fail(cid, "no_reply", OFFLINE)
            waited = now - t0
            for mid, cid in list(pending.items()):
                live = self.deadline(kind_of[cid])
                if hard is not None and waited > hard and (live is None or hard <= live):
                    del pending[mid]
                    self.fail(cid, "timeout", f"no reply within {hard:g} s, the engine.client_timeout limit")
                elif live is not None and waited > live:
                    del pending[mid]
                    self.fail(cid, "no_reply", self._late_reason(kind_of[cid], live))
            if pending:
                self.sleep(self.poll_interval)
        self.traffic.client_seconds += self.clock() - t0
        return replies

    def _late_reason(self, kind: str, deadline: float) -> str:
        times = self.reply_times.get(kind)
        median = f"{statistics.median(times):.1f} s" if times else "none measured yet"
        floor = "none" if self.timeout is None else f"{self.timeout:g} s"
        return (
            f"live node gave no reply within {deadline:.1f} s, the round deadline max(timeout {floor}, "
            f"{self.timeout_factor:g} x median reply time {median})"
        )
