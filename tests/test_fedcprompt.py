"""Fed-CPrompt's defining behaviours: asynchronous prompt learning (each client trains the CODA-P block of its own
task position while others train theirs), the previous-task model kept per client from its task switch, the C2L
triplet (and its positive-only form on a first task) on features or logits, and Fed-CODAP when C2L is off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from promptfcl.data.loader import LabeledSubset
from promptfcl.experiment import Experiment
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext
from promptfcl.methods.fedcprompt import PREV, FedCPromptParams, contrastive_continual_loss, sequence_position
from promptfcl.scenario.label_space import masked_logits

from .conftest import tiny_config
from .test_c2prompt import ASYNC, POOL, programs_on_a_grid, run_round


def fcp(**method) -> dict:
    return {**ASYNC, "method": {"name": "fedcprompt", "pool_size": 4, **POOL, **method}}


def test_c2l_is_the_scaled_triplet_and_positive_only_without_a_negative() -> None:
    gen = torch.Generator().manual_seed(0)
    a, p, n = (torch.randn(6, 5, generator=gen) for _ in range(3))
    params = FedCPromptParams()  # the official scales: 1e3, 1e1, margin 1
    pos, neg = 1e3 * (a - p).pow(2).sum(1), 1e1 * (a - n).pow(2).sum(1)
    assert contrastive_continual_loss(a, p, n, params) == pytest.approx(float(F.relu((pos - neg).sum() + 1.0)))
    assert contrastive_continual_loss(a, p, None, params) == pytest.approx(float(pos.sum()))
    far = a + 100.0  # a negative far away: the hinge is inactive
    assert float(contrastive_continual_loss(a, a, far, params)) == 0.0


def test_each_client_trains_the_block_of_its_own_task_position() -> None:
    """Stage 1: the client that switched trains block 1 (block 0 used, detached); the clients still on their first
    task train block 0 and leave block 1 alone — asynchronous prompt learning."""
    rt, server, grid = programs_on_a_grid(fcp())
    for stage, rounds in ((0, 2), (1, 1)):
        server.begin_stage(stage)
        for r in range(rounds):
            run_round(server, grid, stage, r, (0, 1, 2))
    sent, replies = grid.sent[-1], grid.replies[-1]
    positions = {k: sequence_position(rt.env, 1, k) for k in range(3)}
    assert sorted(positions.values()) == [0, 0, 1]
    for k, pos in positions.items():
        for name in ("prompt.prompts", "prompt.keys", "prompt.attention"):
            block = [slice(0, 2), slice(2, 4)]
            trained, other = block[pos], block[1 - pos]
            assert not torch.equal(replies[k].tensors[name][:, trained], sent[k].tensors[name][:, trained]), (k, name)
            assert torch.equal(replies[k].tensors[name][:, other], sent[k].tensors[name][:, other]), (k, name)
    # the switching client kept, as its previous-task model, the global model it received when it switched
    switched = next(k for k, pos in positions.items() if pos == 1)
    state = grid.states[switched]
    assert state.scalars["fcp_prev_position"] == 0 and state.scalars["fcp_position"] == 1
    for name, t in sent[switched].tensors.items():
        if name in server.model.state_dict():
            assert torch.equal(state.tensors[PREV + name], t)
    assert not any(n.startswith(PREV) for k, pos in positions.items() if pos == 0 for n in grid.states[k].tensors)


@pytest.mark.parametrize("c2l_on", ["features", "logits"])
def test_local_loss_is_ce_plus_c2l_against_the_received_and_previous_task_models(c2l_on: str) -> None:
    rt, server, grid = programs_on_a_grid(fcp(c2l_on=c2l_on))
    client = grid.client
    server.begin_stage(0)
    server.begin_stage(1)
    received = server.model.get_state()
    gen = torch.Generator().manual_seed(3)
    previous = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in received.items()}
    k = next(c for c in range(3) if sequence_position(rt.env, 1, c) == 1)
    g = rt.env.label_task(1, k)
    data = LabeledSubset.of(
        rt.dataset.train, rt.scenario.client_indices(1, k), rt.scenario.label_space.task_class_to_logit(g)
    )
    x, y = next(data.batches(8, rt.env.eval_transform))
    mask = rt.scenario.label_space.train_mask(g, "current_task")

    def model_of(state: dict, task: int):  # noqa: ANN202
        m = client.new_model()
        m.set_state(state)
        m.prompt.set_task(task)
        return m

    for prev in (True, False):
        scalars = {"fcp_label_task": g, "fcp_position": 1, "fcp_prev_position": 0} if prev else {}
        tensors = {PREV + n: t for n, t in previous.items()} if prev else {}
        ctx = ClientContext(k, 1, 1, Record(tensors, scalars), data, 0, torch.device("cpu"), label_task=g)
        loss = client.loss_fn(Message(received, kind="train"), ctx)
        student = model_of({n: v + 0.02 * torch.randn(v.shape, generator=gen) for n, v in received.items()}, 1)
        student.eval()
        got = loss(student, x, y, mask)
        with torch.no_grad():
            rep = (lambda m: m.features(x)) if c2l_on == "features" else (lambda m: m(x))  # noqa: E731
            pos = rep(model_of(received, 1))
            neg = rep(model_of(previous, 0)) if prev else None
            want = F.cross_entropy(masked_logits(student(x), mask), y)
            want = want + contrastive_continual_loss(rep(student), pos, neg, client.params)
        assert float(got.detach()) == pytest.approx(float(want), rel=1e-5), prev


@pytest.mark.slow
def test_without_c2l_on_a_synchronous_scenario_it_is_fed_codap(tmp_path) -> None:  # noqa: ANN001
    """All clients on the same task: every client trains the run's task block, as Fed-CODAP."""
    shared = {"pool_size": 4, "layers": [0, 1], "length": 2, "local_epochs": 1, "batch_size": 8, "lr": 0.01,
              "weighting": "samples"}  # fmt: skip
    runs = {}
    for name, method in (("codap", {"name": "fedcodap"}), ("off", {"name": "fedcprompt", "c2l_weight": 0.0}),
                         ("on", {"name": "fedcprompt"})):  # fmt: skip
        exp = Experiment(tiny_config(method={**method, **shared}), tmp_path / name, show_progress=False)
        runs[name] = (exp.run(), exp.server.model.get_state())
    assert runs["off"][0]["accuracy_matrix"] == runs["codap"][0]["accuracy_matrix"]
    assert all(torch.equal(runs["off"][1][n], t) for n, t in runs["codap"][1].items())
    assert not torch.equal(runs["on"][1]["prompt.prompts"], runs["codap"][1]["prompt.prompts"])  # C2L changes training


def test_c2l_holds_the_clients_representation_near_the_received_models() -> None:
    """C2L's positive term is a leash to the received global model: the logged final-epoch distance between the
    client's prompted features and the received model's (`c2l_distance`) shrinks as the weight grows, and the
    representation's norm (`c2l_anchor_norm`) is logged beside it for scale."""
    reach = {}
    for weight in (1e-6, 1.0):
        rt, server, grid = programs_on_a_grid(fcp(c2l_weight=weight, local_epochs=3))
        server.begin_stage(0)
        metrics = run_round(server, grid, 0, 0, (0, 1, 2))
        reach[weight] = metrics["c2l_distance"]
        assert metrics["c2l_anchor_norm"] > 0
    assert reach[1.0] < 0.5 * reach[1e-6], reach
