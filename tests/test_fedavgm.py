"""FedAvgM on the prefix prompt (the "Adding a method" example): the server applies the averaged change with
momentum, w_t = w_{t-1} − η(β v_{t-1} + w_{t-1} − mean_t); β = 0, η = 1 is FedAvg; its signal fails without momentum."""

from __future__ import annotations

import torch

from promptfcl.evaluation.validity import RunEvidence
from promptfcl.federation.message import Message
from promptfcl.federation.protocol import RoundInfo
from promptfcl.methods import METHODS
from promptfcl.methods.fedavgm_prompt import check_momentum
from promptfcl.runtime import Runtime

from .conftest import tiny_config


def server_of(**method):
    rt = Runtime.build(tiny_config(method={"name": "fedavgm_prompt", **method}))
    server, _ = rt.programs()
    return server


def replies_around(state: dict[str, torch.Tensor], shifts: list[float], counts: list[int]) -> dict[int, Message]:
    return {
        k: Message({n: t + s for n, t in state.items()}, {"num_samples": c, "loss": 1.0}, kind="train_reply")
        for k, (s, c) in enumerate(zip(shifts, counts, strict=True))
    }


def test_server_step_is_the_momentum_update_of_the_fedavg_change() -> None:
    beta, eta = 0.5, 0.8
    server = server_of(server_momentum=beta, server_lr=eta)
    server.round_info = RoundInfo(0, 0, (0, 1))
    w0 = server.model.get_state()
    server.aggregate(replies_around(w0, [0.2, 0.5], [1, 3]))  # mean shift (0.2 + 3·0.5)/4 = 0.425
    w1 = server.model.get_state()
    v1 = {k: -0.425 * torch.ones_like(t) for k, t in w0.items()}  # w0 − mean
    for k in w0:
        assert torch.allclose(w1[k], w0[k] - eta * v1[k], atol=1e-6), k
    server.aggregate(replies_around(w1, [-0.1, -0.1], [2, 2]))  # mean shift −0.1
    w2 = server.model.get_state()
    for k in w0:
        v2 = beta * v1[k] + 0.1
        assert torch.allclose(w2[k], w1[k] - eta * v2, atol=1e-6), k


def test_no_momentum_and_unit_server_lr_is_fedavg() -> None:
    plain, fedavg = server_of(server_momentum=0.0, server_lr=1.0), server_of()
    w0 = plain.model.get_state()
    replies = replies_around(w0, [0.3, -0.1], [5, 1])
    plain.aggregate(replies)
    METHODS.get("fedavg_prompt").server.aggregate(fedavg, replies)  # the FedAvg mean on an identical server
    for k, t in plain.model.get_state().items():
        assert torch.allclose(t, fedavg.model.get_state()[k], atol=1e-6), k


def test_velocity_survives_a_checkpoint() -> None:
    server = server_of()
    server.aggregate(replies_around(server.model.get_state(), [0.2, 0.4], [1, 1]))
    again = server_of()
    again.load_state(server.state())
    assert again.velocity.keys() == server.velocity.keys()
    assert all(torch.equal(again.velocity[k], v) for k, v in server.velocity.items())


def test_the_momentum_signal_fails_when_the_mechanism_is_off() -> None:
    rounds = [{"server_velocity_norm": 0.5}, {"server_velocity_norm": 0.4}]
    assert check_momentum(RunEvidence({"method": {"server_momentum": 0.9}}, rounds)).passed
    assert not check_momentum(RunEvidence({"method": {"server_momentum": 0.0}}, rounds)).passed
    assert check_momentum in METHODS.get("fedavgm_prompt").signals
