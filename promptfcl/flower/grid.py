"""`FlowerGrid`: the promptfcl `Grid` over Flower's `Grid` — our client ids are the SuperNodes' partition ids."""

from __future__ import annotations

import time

from flwr.app import ConfigRecord, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.serverapp import Grid as FlowerGridAPI

from promptfcl.federation.message import Message
from promptfcl.federation.protocol import Grid
from promptfcl.flower.records import flower_message_type, from_record_dict, to_record_dict

HELLO = "query.promptfcl_hello"


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
    """Delivers our messages as Flower messages; a client that errors or times out (the smaller of `timeout` and
    `engine.client_timeout`) is a recorded failure; validation and the quorum are the `Grid` base class's."""

    def __init__(self, grid: FlowerGridAPI, node_of_client: dict[int, int], timeout: float | None = None) -> None:
        super().__init__()
        self.grid = grid
        self.node_of_client = node_of_client
        self.client_of_node = {n: c for c, n in node_of_client.items()}
        self.timeout = timeout

    def _deliver(self, messages: dict[int, Message]) -> dict[int, Message]:
        out = [
            FlowerMessage(
                content=to_record_dict(m),
                dst_node_id=self.node_of_client[cid],
                message_type=flower_message_type(m.kind),
                group_id=f"{self.round.task}.{self.round.round}",
            )
            for cid, m in messages.items()
        ]
        t0 = time.perf_counter()
        replies: dict[int, Message] = {}
        limits = [t for t in (self.timeout, self.policy.client_timeout) if t is not None]
        timeout = min(limits) if limits else None
        for reply in self.grid.send_and_receive(out, timeout=timeout):
            cid = self.client_of_node[reply.metadata.src_node_id]
            if reply.has_error():
                self.fail(cid, "error", f"client error: {reply.error.reason}")
                continue
            try:
                replies[cid] = from_record_dict(reply.content)
            except Exception as e:  # noqa: BLE001 - a reply that does not decode is a schema failure
                self.fail(cid, "schema", f"reply does not decode: {type(e).__name__}: {e}")
        for cid in sorted(set(messages) - set(replies) - {f.client for f in self.failures}):
            self.fail(cid, "no_reply", f"no reply within {timeout} s")
        self.traffic.client_seconds += time.perf_counter() - t0
        return replies
