"""`FlowerGrid` waiting for replies: a dead node is dropped from Flower's liveness, a slow live node is waited
for up to a deadline that scales with the measured reply times, `engine.client_timeout` stays a hard limit.

A fake SuperLink on a fake clock stands in for Flower's `Grid` (push / pull / online node ids, with a node
marked offline some seconds after it dies, as the SuperLink does when heartbeats stop), so these run in
milliseconds; `tests/test_flower.py` checks the same behaviour on a real loopback federation.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from promptfcl.federation.message import Message
from promptfcl.federation.protocol import GridPolicy, RoundFailed, RoundInfo

pytest.importorskip("flwr", reason="flwr not installed: pip install 'promptfcl[flower]'")

from flwr.common.constant import ErrorCode  # noqa: E402

from promptfcl.flower import grid as fg  # noqa: E402
from promptfcl.flower.records import from_record_dict, to_record_dict  # noqa: E402

HEARTBEAT_LAG = 45.0  # seconds after a node dies until the fake SuperLink marks it offline (Flower: 40-60 s)
SUPERLINK = 1  # Flower's SUPERLINK_NODE_ID: the source of the errors the SuperLink itself writes


@dataclass
class Node:
    """How a fake node behaves in the current round: answer after `reply_after` s (None: never), die at
    `dies_at` s after the round started (None: stays up)."""

    reply_after: float | None = 1.0
    dies_at: float | None = None
    error: str | None = None


class FakeSuperLink:
    """Flower's ServerApp `Grid` as `FlowerGrid` uses it: push, pull by message id, online node ids."""

    def __init__(self, unavailable_errors: bool = False) -> None:
        self.now = 0.0
        self.nodes: dict[int, Node] = {}
        self.round_start = 0.0
        self.pushed: dict[str, tuple[int, Message]] = {}
        self.unavailable_errors = unavailable_errors  # also answer a dead node's message with NODE_UNAVAILABLE

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def start_round(self, nodes: dict[int, Node]) -> None:
        self.nodes, self.round_start = nodes, self.now

    def _offline(self, node_id: int) -> bool:
        dies = self.nodes[node_id].dies_at
        return dies is not None and self.now - self.round_start >= dies + HEARTBEAT_LAG

    def get_node_ids(self) -> list[int]:
        return [n for n in self.nodes if not self._offline(n)]

    def push_messages(self, msgs: list) -> list[str]:
        ids = []
        for m in msgs:
            mid = f"m{len(self.pushed)}"
            self.pushed[mid] = (m.dst_node_id, from_record_dict(m.content))
            ids.append(mid)
        return ids

    def pull_messages(self, ids: list[str]) -> list:
        out = []
        for mid in ids:
            node_id, msg = self.pushed[mid]
            node = self.nodes[node_id]
            elapsed = self.now - self.round_start
            answered = node.reply_after is not None and elapsed >= node.reply_after
            if answered and (node.dies_at is None or node.reply_after < node.dies_at):
                meta = SimpleNamespace(src_node_id=node_id, reply_to_message_id=mid)
                if node.error is not None:
                    err = SimpleNamespace(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=node.error)
                    out.append(SimpleNamespace(metadata=meta, has_error=lambda: True, error=err))
                else:
                    reply = Message({k: v + 1 for k, v in msg.tensors.items()}, {"n": 1}, kind="train")
                    content = to_record_dict(reply)
                    out.append(SimpleNamespace(metadata=meta, has_error=lambda: False, content=content))
            elif self.unavailable_errors and self._offline(node_id):
                meta = SimpleNamespace(src_node_id=SUPERLINK, reply_to_message_id=mid)
                err = SimpleNamespace(code=ErrorCode.NODE_UNAVAILABLE, reason="Error: Node Unavailable")
                out.append(SimpleNamespace(metadata=meta, has_error=lambda: True, error=err))
        return out


@pytest.fixture
def make_grid(monkeypatch):
    monkeypatch.setattr(fg, "FlowerMessage", lambda **kw: SimpleNamespace(**kw))  # no Flower run context needed

    def make(link: FakeSuperLink, clients: int, **kw) -> fg.FlowerGrid:
        node_of_client = {c: 100 + c for c in range(clients)}
        link.start_round({n: Node() for n in node_of_client.values()})
        grid = fg.FlowerGrid(link, node_of_client, clock=link.clock, sleep=link.sleep, **kw)  # type: ignore[arg-type]
        grid.configure(GridPolicy())
        return grid

    return make


def run_round(grid: fg.FlowerGrid, link: FakeSuperLink, rnd: int, nodes: dict[int, Node]) -> dict[int, Message]:
    link.start_round({100 + c: node for c, node in nodes.items()})
    grid.start_round(RoundInfo(0, rnd, tuple(sorted(nodes))))
    return grid.send({c: Message({"w": torch.zeros(2)}, kind="train") for c in nodes})


def failures(grid: fg.FlowerGrid) -> dict[int, tuple[str, str]]:
    return {f.client: (f.kind, f.reason) for f in grid.failures}


def test_dead_node_dropped_by_liveness_while_a_slow_live_node_is_waited_for(make_grid) -> None:
    link = FakeSuperLink()
    grid = make_grid(link, 3, timeout=60.0, timeout_factor=5.0)
    # round 0: every node answers in 20 s, so the deadline for a live node becomes max(60, 5 x 20) = 100 s
    assert set(run_round(grid, link, 0, {c: Node(reply_after=20.0) for c in range(3)})) == {0, 1, 2}
    assert grid.deadline("train") == pytest.approx(100.0, abs=1.5)
    # round 1: node 2 dies 1 s in (offline for the SuperLink 46 s in); node 1 is live but takes 80 s (> timeout)
    drops: dict[int, float] = {}
    fail = grid.fail
    grid.fail = lambda c, k, r: (drops.setdefault(c, link.now - link.round_start), fail(c, k, r))[1]
    nodes = {0: Node(reply_after=20.0), 1: Node(reply_after=80.0), 2: Node(reply_after=20.0, dies_at=1.0)}
    replies = run_round(grid, link, 1, nodes)
    assert set(replies) == {0, 1}, failures(grid)  # the slow live node was waited for past `timeout`
    assert failures(grid) == {2: ("no_reply", "node offline (liveness)")}
    # dropped at the first liveness check after the SuperLink marked it offline, not at a timeout
    assert 1.0 + HEARTBEAT_LAG <= drops[2] <= 1.0 + HEARTBEAT_LAG + grid.liveness_interval + 1.0
    assert torch.equal(replies[1].tensors["w"], torch.ones(2))


def test_node_already_offline_is_not_sent_the_message(make_grid) -> None:
    link = FakeSuperLink()
    grid = make_grid(link, 2, timeout=60.0)
    link.now = 100.0
    nodes = {0: Node(), 1: Node(dies_at=-HEARTBEAT_LAG)}  # offline before the round starts
    assert set(run_round(grid, link, 0, nodes)) == {0}
    assert failures(grid) == {1: ("no_reply", "node offline (liveness)")}
    assert [node for node, _ in link.pushed.values()] == [100]  # nothing was pushed to the offline node
    assert link.now - 100.0 < 5.0  # and nobody waited for it


def test_node_unavailable_error_from_the_superlink_is_a_liveness_drop(make_grid) -> None:
    """Flower answers a pending message of a node that went offline with a NODE_UNAVAILABLE error written by the
    SuperLink (its source is the SuperLink, not the node): matched by message id, recorded as offline."""
    link = FakeSuperLink(unavailable_errors=True)
    grid = make_grid(link, 3, timeout=600.0, liveness_interval=1000.0)  # only the error reply can tell
    nodes = {0: Node(reply_after=2.0), 1: Node(reply_after=50.0, dies_at=1.0), 2: Node(error="boom")}
    assert set(run_round(grid, link, 0, nodes)) == {0}
    got = failures(grid)
    assert got[1] == ("no_reply", "node offline (liveness)")
    assert got[2][0] == "error" and "boom" in got[2][1]
    assert link.now < 1.0 + HEARTBEAT_LAG + 2.0


def test_live_node_that_never_answers_is_dropped_at_the_scaled_deadline(make_grid) -> None:
    link = FakeSuperLink()
    grid = make_grid(link, 2, timeout=10.0, timeout_factor=3.0)
    run_round(grid, link, 0, {0: Node(reply_after=8.0), 1: Node(reply_after=8.0)})
    assert grid.deadline("train") == pytest.approx(24.0, abs=3.5)  # 3 x the median 8 s (+ poll granularity)
    assert grid.deadline("evaluate") == 10.0  # no measurement for that kind yet: the floor
    replies = run_round(grid, link, 1, {0: Node(reply_after=8.0), 1: Node(reply_after=None)})  # hung, heart-beating
    assert set(replies) == {0}
    kind, reason = failures(grid)[1]
    assert kind == "no_reply" and reason.startswith("live node gave no reply within") and "3 x median" in reason
    assert grid.deadline("train") < link.now - link.round_start < grid.deadline("train") + 2.0


def test_engine_client_timeout_stays_a_hard_limit(make_grid) -> None:
    link = FakeSuperLink()
    grid = make_grid(link, 2, timeout=600.0)
    grid.configure(GridPolicy(client_timeout=30.0))
    replies = run_round(grid, link, 0, {0: Node(reply_after=5.0), 1: Node(reply_after=40.0)})
    assert set(replies) == {0}
    assert failures(grid) == {1: ("timeout", "no reply within 30 s, the engine.client_timeout limit")}
    assert link.now < 33.0  # it stopped waiting at the limit


def test_quorum_still_applies(make_grid) -> None:
    link = FakeSuperLink()
    grid = make_grid(link, 2, timeout=60.0)
    grid.configure(GridPolicy(min_clients=2))
    with pytest.raises(RoundFailed, match="node offline"):
        run_round(grid, link, 0, {0: Node(), 1: Node(reply_after=None, dies_at=0.5)})
