"""HePCo's server consolidation, the query cache in a real run, and the pool baselines' defining terms."""

from __future__ import annotations

import copy

import pytest
import torch

from promptfcl.config import build_config
from promptfcl.experiment import Experiment
from promptfcl.federation.message import Message
from promptfcl.federation.protocol import RoundInfo
from promptfcl.methods.hepco import prompt_output
from promptfcl.runtime import Runtime
from promptfcl.training.latent_generator import LatentGenerator, Teacher, train_generator
from promptfcl.training.regularizers import lwf_mc_loss, proximal_term

from .conftest import tiny_raw

POOL = {"pool_size": 8, "length": 4, "layers": [0, 1], "local_epochs": 2, "batch_size": 8, "lr": 0.01}


def pool_config(name: str, **kw):
    raw = tiny_raw()
    raw["method"] = {"name": name, "augment": "flip", **POOL, **kw}
    return build_config(raw)


def clients_and_server(seed: int = 0):
    """A HePCo server program and two client models that differ from it (as after local training)."""
    torch.manual_seed(seed)
    rt = Runtime.build(pool_config("hepco"))
    server = rt.programs()[0]
    server.begin_task(0)
    clients = []
    for k in range(2):
        m = copy.deepcopy(server.model)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * (0.3 + 0.2 * k))
        clients.append(m)
    counts = torch.zeros(rt.scenario.label_space.num_logits, dtype=torch.long)
    counts[:3] = torch.tensor([20, 10, 5])
    replies = {
        k: Message({**m.get_state(), "label_counts": counts.clone()}, {"num_samples": 35})
        for k, m in enumerate(clients)
    }
    return rt, server, clients, replies


def test_generator_learns_latents_the_client_heads_classify_as_their_label() -> None:
    rt, server, clients, replies = clients_and_server()
    allowed = torch.zeros(rt.scenario.label_space.num_logits, dtype=torch.bool)
    allowed[:3] = True
    hist = torch.tensor([1.0, 1.0, 1.0, 0, 0, 0])
    teachers = [Teacher(m.head, lambda z, m=m: prompt_output(m, z), torch.full((6,), 0.5)) for m in clients]
    g = LatentGenerator(6, rt.env.backbone.embed_dim)
    torch.manual_seed(0)
    y = torch.arange(3).repeat(100)
    with torch.no_grad():
        before = sum((m.head(g.eval()(y))[:, :3].argmax(1) == y).float().mean() for m in clients) / 2
    train_generator(g, teachers, server.model.head, lambda z: prompt_output(server.model, z), hist, allowed,
                    200, 64, 1e-3, 1.0, 0.1, torch.Generator().manual_seed(0))  # fmt: skip
    with torch.no_grad():
        after = sum((m.head(g(y))[:, :3].argmax(1) == y).float().mean() for m in clients) / 2
    assert after > 0.9 and after > before + 0.3, (before, after)  # chance is 1/3


@pytest.mark.parametrize("distill_prompts", [True, False])
def test_latent_distillation_pulls_the_server_prompts_toward_the_clients(distill_prompts: bool) -> None:
    rt, server, clients, replies = clients_and_server()
    server.params = server.params.model_copy(
        update={"generator_iterations": 30, "kd_iterations": 150, "kd_lr": 1e-2, "distill_prompts": distill_prompts}
    )
    with torch.no_grad():  # start the student away from the clients, to watch distillation close the gap
        server.model.prompt.prompts.add_(torch.randn_like(server.model.prompt.prompts))
    z = torch.randn(256, rt.env.backbone.embed_dim, generator=torch.Generator().manual_seed(1))

    def gap() -> float:
        with torch.no_grad():
            s = prompt_output(server.model, z)
            return float(sum((s - prompt_output(m, z)).pow(2).mean() for m in clients))

    head_before = server.model.head.weight.detach().clone()
    before = gap()
    counts = torch.stack([r.tensors["label_counts"] for r in replies.values()])
    metrics = server.consolidate(replies, counts, RoundInfo(0, 0, (0, 1)))
    if distill_prompts:
        assert gap() < 0.75 * before, (before, gap())
        assert {"generator_loss", "prompt_kd_loss", "head_kd_loss"} <= set(metrics)
    else:  # the ablation leaves the prompts alone
        assert gap() == pytest.approx(before)
    assert not torch.equal(server.model.head.weight, head_before)  # stage B trained the head


@pytest.mark.slow
def test_hepco_keeps_the_previous_server_and_counts_across_a_resume(tmp_path) -> None:
    cfg = pool_config("hepco", generator_iterations=5, kd_iterations=5)
    exp = Experiment(cfg, tmp_path / "run", show_progress=False)
    exp.run()
    assert exp.server.prev is not None and int(exp.server.cumulative.sum()) == sum(
        len(exp.scenario.client_indices(t, c)) for t in range(2) for r in exp.scenario.participants[t] for c in r
    )
    fresh = exp.runtime.programs()[0]
    fresh.load_state(exp.server.state())
    assert torch.equal(fresh.cumulative, exp.server.cumulative)
    for k, v in exp.server.prev.get_state().items():
        assert torch.equal(fresh.prev.get_state()[k], v)


@pytest.mark.slow
def test_query_cache_gives_the_same_run_as_recomputing_queries(tmp_path) -> None:
    results = {}
    for cached in (False, True):
        exp = Experiment(
            pool_config("fedavg_prompt_pool", query_cache=cached), tmp_path / str(cached), show_progress=False
        )
        results[cached] = exp.run()
        cache = exp.env.backbone.query_cache
        assert (cache is not None) == cached
        if cached:
            assert cache.hits > cache.misses  # images recur across epochs, rounds and evaluation
    assert results[True]["accuracy_matrix"] == results[False]["accuracy_matrix"]


def test_proximal_term_and_lwf_mc_distillation() -> None:
    lin = torch.nn.Linear(3, 2)
    ref = {k: v.detach().clone() + 1.0 for k, v in lin.named_parameters()}
    term = proximal_term(lin, ref, mu=0.01)
    assert torch.allclose(term, torch.tensor(0.5 * 0.01 * 8.0))  # 8 parameters, each 1 away
    term.backward()
    assert torch.allclose(lin.weight.grad, torch.full((2, 3), -0.01))  # pulls toward the server weights
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    prev = torch.tensor([[3.0, -2.0, 9.0, 9.0]])
    y = torch.tensor([2])
    expect = torch.nn.functional.binary_cross_entropy_with_logits(
        logits[:, :3], torch.tensor([[torch.sigmoid(torch.tensor(3.0)), torch.sigmoid(torch.tensor(-2.0)), 1.0]])
    )
    assert torch.allclose(lwf_mc_loss(logits, y, prev, old=2, seen=3), expect)
    no_prev = torch.nn.functional.binary_cross_entropy_with_logits(logits[:, 2:3], torch.ones(1, 1))
    assert torch.allclose(lwf_mc_loss(logits, y, None, old=2, seen=3), no_prev)
