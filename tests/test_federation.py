"""Messages (byte counts, serialisation), aggregation math, and the in-process engine's guarantees."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from promptfcl.config import ScenarioConfig
from promptfcl.data.base import ImageSplit
from promptfcl.federation.aggregation import weighted_mean
from promptfcl.federation.inprocess import InProcessGrid
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext, ClientProgram, RoundInfo
from promptfcl.scenario import build_class_incremental


def test_message_byte_count_is_tensor_bytes_plus_json() -> None:
    scalars = {"num_samples": 12, "loss": 0.5}
    m = Message(
        {"a": torch.zeros(10, 4), "b": torch.zeros(3, dtype=torch.float64), "c": torch.zeros(5, dtype=torch.int8)},
        scalars,
        kind="train",
    )
    expected = 10 * 4 * 4 + 3 * 8 + 5 + len(json.dumps(scalars, sort_keys=True)) + len("train")
    assert m.nbytes() == expected


def test_message_roundtrips_through_bytes_without_pickle() -> None:
    m = Message({"w": torch.randn(3, 2)}, {"task": 1, "names": ["x", "y"], "ok": True}, kind="train_reply")
    back = Message.from_bytes(m.to_bytes())
    assert back.kind == "train_reply" and back.scalars == m.scalars and torch.equal(back.tensors["w"], m.tensors["w"])
    r = Record.from_bytes(Record({"s": torch.ones(2)}, {"k": 1}).to_bytes())
    assert r.scalars == {"k": 1}


def test_message_rejects_non_json_scalars_and_non_tensors() -> None:
    with pytest.raises(TypeError):
        Message({}, {"bad": object()}).nbytes()
    with pytest.raises(TypeError):
        Message({}, {"nan": float("nan")}).nbytes()
    with pytest.raises(TypeError):
        Message({"x": np.zeros(2)})  # type: ignore[dict-item]


def test_copy_does_not_alias() -> None:
    m = Message({"w": torch.zeros(2)}, {"l": [1]}, kind="k")
    c = m.copy()
    c.tensors["w"] += 1
    c.scalars["l"].append(2)
    assert m.tensors["w"].sum() == 0 and m.scalars["l"] == [1] and c.kind == "k"


def test_weighted_mean() -> None:
    a, b = {"w": torch.tensor([0.0, 2.0])}, {"w": torch.tensor([4.0, 6.0])}
    assert torch.allclose(weighted_mean([a, b], [1, 3])["w"], torch.tensor([3.0, 5.0]))
    assert torch.allclose(weighted_mean([a, b])["w"], torch.tensor([2.0, 4.0]))
    with pytest.raises(ValueError):
        weighted_mean([a, {"v": torch.zeros(2)}])
    with pytest.raises(ValueError):
        weighted_mean([a, b], [0, 0])


class CountingClient(ClientProgram):
    """Keeps a private counter and a tensor in its state; replies with them; tries to corrupt its input."""

    def handle(self, message: Message, ctx: ClientContext) -> Message:
        n = ctx.state.scalars.get("visits", 0) + 1
        ctx.state.scalars["visits"] = n
        ctx.state.tensors["mine"] = torch.full((2,), float(ctx.client_id))
        message.tensors["shared"].add_(100.0)  # must not leak to the server or other clients
        return Message(
            {"seen": message.tensors["shared"].clone()},
            {"visits": n, "samples": len(ctx.train_data), "task": message.scalars["task"]},
            kind="reply",
        )


@pytest.fixture
def grid() -> InProcessGrid:
    y = np.repeat(np.arange(4), 10)
    split = ImageSplit(torch.zeros(40, 3, 8, 8, dtype=torch.uint8), torch.tensor(y))
    sc = build_class_incremental(
        ScenarioConfig(num_tasks=2, num_clients=3, rounds_per_task=2, partition={"min_samples": 1}), y, y, 4, 0
    )
    return InProcessGrid(CountingClient(None, None), sc, split, seed=0, device=torch.device("cpu"))  # type: ignore[arg-type]


def test_client_state_persists_and_is_isolated(grid: InProcessGrid) -> None:
    shared = torch.zeros(3)
    msg = Message({"shared": shared}, kind="go")
    grid.start_round(RoundInfo(0, 0, (0, 1, 2)))
    r1 = grid.broadcast([0, 1], msg)
    grid.start_round(RoundInfo(0, 1, (0, 1, 2)))
    r2 = grid.broadcast([0], msg)
    assert r1[0].scalars["visits"] == 1 and r2[0].scalars["visits"] == 2
    assert grid.states[1].scalars["visits"] == 1 and "visits" not in grid.states[2].scalars
    assert torch.equal(grid.states[1].tensors["mine"], torch.ones(2))
    assert torch.equal(grid.states[0].tensors["mine"], torch.zeros(2))
    assert shared.sum() == 0  # the server's tensor was delivered by copy
    assert torch.equal(r1[1].tensors["seen"], torch.full((3,), 100.0))  # each client got a fresh copy


def test_traffic_counts_every_message(grid: InProcessGrid) -> None:
    msg = Message({"shared": torch.zeros(3)}, kind="go")
    grid.start_round(RoundInfo(1, 0, (0, 1, 2)))
    replies = grid.broadcast([0, 1, 2], msg)
    stamped = msg.copy()
    stamped.scalars.update({"task": 1, "round": 0})
    assert grid.traffic.bytes_down == 3 * stamped.nbytes()
    assert grid.traffic.bytes_up == sum(r.nbytes() for r in replies.values())
    assert grid.traffic.messages == 3
    assert all(r.scalars["task"] == 1 for r in replies.values())
    assert sum(r.scalars["samples"] for r in replies.values()) == 20  # task 1 holds 2 classes × 10 samples
