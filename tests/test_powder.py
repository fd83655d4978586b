"""Powder's defining behaviours: the served prompt is the two-step generation from the task pool (top-k tasks by W,
G_i = Σ_j W[i, j]·P_j, α-weighted, / k) with only the own block trainable; W from the prompt-choosing signatures
(over common tasks, power, row-normalised); the signatures are the clients' per-class mean α; forward and backward
transfer through W; owner aggregation with compact uplinks; the not-true distillation; exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from promptfcl.data.loader import LabeledSubset
from promptfcl.experiment import Experiment
from promptfcl.methods.powder import correlation, generate, not_true_distillation, signature_similarity, top_tasks
from promptfcl.prompts.codap import attention_weights

from .conftest import interrupted_then_resumed, tiny_config
from .test_c2prompt import ASYNC, POOL, programs_on_a_grid, run_round


def powder(**method) -> dict:
    return {**ASYNC, "method": {"name": "powder", "components_per_task": 2, "top_k": 2, **POOL, **method}}


def two_step_prompt(pool, W, trained, g, k, q):  # noqa: ANN001, ANN201
    """Powder's prompt for task g from scratch: per layer, the top-k tasks i of W[g, ·] among the trained ones, each
    G_i = Σ_j W[i, j]·P_j (P, K and A), their components α-weighted, the sum divided by k."""
    cols = torch.tensor(trained)
    picks = cols[torch.sort(W[g, cols], descending=True, stable=True).indices[:k]]
    out = []
    for layer in range(pool["prompts"].shape[1]):
        gen = {
            part: torch.cat([torch.einsum("t,t...->...", W[i, cols], t[cols, layer]) for i in picks])
            for part, t in pool.items()
        }
        alpha = attention_weights(q, gen["keys"], gen["attention"])
        out.append(torch.einsum("bn,nld->bld", alpha, gen["prompts"]) / len(picks))
    return out


def random_state(server, trained: list[int], seed: int = 0) -> torch.Tensor:  # noqa: ANN001
    """Fill the server's pool with random blocks and a random row-stochastic W; mark `trained`."""
    gen = torch.Generator().manual_seed(seed)
    for t in server.pool.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    T = server.W.shape[0]
    W = torch.rand(T, T, generator=gen) ** 3
    server.W = W / W.sum(1, keepdim=True)
    server.trained[:] = False
    server.trained[trained] = True
    return server.W


def test_served_prompt_is_the_two_step_generation_and_only_the_own_block_learns() -> None:
    rt, server, _ = programs_on_a_grid(powder())
    trained = [0, 1, 2, 4]
    W = random_state(server, trained)
    g = 4
    model = server.client_model(1, g)
    x = torch.rand(5, 3, 32, 32)
    q = rt.env.backbone.query(x)
    want = two_step_prompt(server.pool, W, trained, g, 2, q)
    model.train()
    spec = model.prompt(len(x), q)
    for layer, expected in zip(rt.params.layers, want, strict=True):
        k, v = spec.prefix[layer]
        assert torch.allclose(torch.cat([k, v], dim=1), expected, atol=1e-5), layer
    # the generated blocks' picks are the top-k of W[g, trained]
    assert model.prompt.active.tolist() == [1.0, 1.0]
    assert torch.allclose(model.prompt.coef, W[top_tasks(W, trained, g, 2), g])
    # only the own block (and the head) can learn: the remainders are buffers
    F.cross_entropy(model(x), torch.zeros(5, dtype=torch.long)).backward()
    learnable = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert learnable == {"prompt.own_prompts", "prompt.own_keys", "prompt.own_attention", "head.weight", "head.bias"}


def test_generation_takes_in_exactly_the_blocks_w_points_to() -> None:
    """Forward and backward transfer: task g's served model depends on block j only through W — a block with
    W[i, j] = 0 for every picked i leaves it unchanged, and once W links them (re-measured in a later stage) an
    earlier task's model moves when a later task's block changes."""
    rt, server, _ = programs_on_a_grid(powder())
    trained = [0, 1, 2, 3]
    server.trained[trained] = True
    for t in server.pool.values():
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)))
    x = torch.rand(4, 3, 32, 32)

    def logits_of(g: int) -> torch.Tensor:
        with torch.no_grad():
            return server.client_model(0, g)(x)

    server.W = torch.eye(6)  # no correlation: task 0 sees its own block (and unrelated blocks with weight 0)
    before = logits_of(0)
    server.pool["prompts"][3] += 1.0  # a later task's block changes
    assert torch.allclose(logits_of(0), before)
    server.W[0] = torch.tensor([0.6, 0.0, 0.0, 0.4, 0.0, 0.0])  # W now links task 0 to task 3: backward transfer
    linked = logits_of(0)
    server.pool["prompts"][3] += 1.0
    assert not torch.allclose(logits_of(0), linked)
    # forward transfer: a new task 3 correlated with task 1 is served block 1's components from its first round
    server.W[3] = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0, 0.0])
    picks = top_tasks(server.W, trained, 3, 2)
    state = generate(server.pool, server.W, trained, 3, picks, 2)
    own = picks.index(3)  # task 3's own generated block G_3 = 0.5·P_3 + 0.5·P_1
    assert state["prompt.coef"][own] == 0.5
    assert torch.allclose(state["prompt.rest_prompts"][own], 0.5 * server.pool["prompts"][1])


def test_top_tasks_reads_the_served_tasks_row_of_w() -> None:
    """Task g is served by the trained tasks i with the largest W[g, i] — its row, not its column (here they pick
    different tasks) — ties going to the earlier task."""
    W = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.0, 1.0, 0.0, 0.0], [0.05, 0.0, 0.95, 0.0], [0.9, 0.0, 0.0, 0.1]])
    assert top_tasks(W, [0, 1, 2, 3], 0, 2) == [1, 2]  # the column W[:, 0] would pick 3 first
    assert top_tasks(W, [0, 2, 3], 0, 2) == [2, 0]  # only trained tasks; W[0, 0] = W[0, 3]: the earlier one


def test_correlation_is_the_powered_signature_cosine_over_common_tasks() -> None:
    gen = torch.Generator().manual_seed(0)
    N, L = 2, 3
    base = torch.rand(L, 2 * N, generator=gen)
    sigs = {
        0: ([0, 3], base),
        1: ([0, 3], torch.rand(L, 2 * N, generator=gen)),
        # measured later, against one more task (2) between them: on the common tasks 0, 3 it equals task 0's
        3: ([0, 2, 3], torch.cat([base[:, :N], torch.rand(L, N, generator=gen), base[:, N:]], dim=1)),
    }
    assert signature_similarity(sigs[0], sigs[3], N) == pytest.approx(1.0)
    keys, W = correlation(sigs, N, 30.0)
    assert keys == [0, 1, 3] and torch.allclose(W.sum(1), torch.ones(3))
    sim = torch.tensor([[signature_similarity(sigs[a], sigs[b], N) for b in keys] for a in keys])
    want = sim.clamp_min(0) ** 30
    assert torch.allclose(W, (want / want.sum(1, keepdim=True)).float(), atol=1e-6)
    assert W[2, 0] == pytest.approx(W[2, 2]) and W[2, 0] > 10 * W[2, 1]
    # class correlations: same-group pairs are cut, only the top-k of each row survive
    _, Wc = correlation(sigs, N, 30.0, top_k=2, group={0: 0, 1: 1, 3: 0})
    assert Wc[0, 2] == 0 and Wc[2, 0] == 0 and (Wc > 0).sum(1).le(2).all()


def test_round_zero_signatures_are_the_per_class_mean_alpha_and_set_w(tmp_path: Path) -> None:
    """Round 0 of a stage: each participant receives the generated keys / attention vectors of every trained task
    and returns, per class of its task, the mean over its images of α(q(x)) (computed here from the images); the
    server's W over the signed tasks is the powered, row-normalised cosine of the class-mean averages."""
    rt, server, grid = programs_on_a_grid(powder())
    server.begin_stage(0)
    run_round(server, grid, 0, 0, (0, 1, 2))
    sent, replies = grid.sent[0], grid.replies[0]
    assert [m.kind for m in sent.values()] == ["signature"] * 3 and [m.kind for m in grid.sent[1].values()] == [
        "train"
    ] * 3
    trained = sent[0].scalars["trained"]
    K, A = sent[0].tensors["powder/keys"], sent[0].tensors["powder/attention"]
    assert trained == sorted(rt.env.label_task(0, k) for k in range(3)) and K.shape[0] == 3
    space = rt.scenario.label_space
    for k in range(3):
        g = rt.env.label_task(0, k)
        data = LabeledSubset.of(rt.dataset.train, rt.scenario.client_indices(0, k), space.task_class_to_logit(g))
        x, y = next(data.batches(10_000, rt.env.eval_transform))
        q = rt.env.backbone.query(x)
        alpha = torch.stack([attention_weights(q, K[:, i].flatten(0, 1), A[:, i].flatten(0, 1)) for i in range(2)], 1)
        got = replies[k].tensors["powder/class_signature"]
        for c, logit in enumerate(space.tasks[g].logits):
            assert torch.allclose(got[c], alpha[y == logit].mean(0), atol=1e-5), (k, c)
    keys, rows = correlation(server.signatures, 2, rt.params.correlation_power)
    assert keys == trained and torch.allclose(server.W[torch.tensor(keys)][:, torch.tensor(keys)], rows)


def test_owner_aggregation_and_compact_uplink() -> None:
    """Each upload carries the own block and the head only; block g becomes its owner's upload, other blocks keep
    their values; the downlinks differ per participant (each its own generated prompt)."""
    rt, server, grid = programs_on_a_grid(powder())
    server.begin_stage(0)
    before = {part: t.clone() for part, t in server.pool.items()}
    run_round(server, grid, 0, 0, (0, 1))
    replies = grid.replies[-1]
    for k, r in replies.items():
        assert not any(n.startswith(("prompt.rest_", "prompt.coef", "prompt.active")) for n in r.tensors)
        g = rt.env.label_task(0, k)
        for part in server.pool:
            assert torch.equal(server.pool[part][g], r.tensors[f"prompt.own_{part}"])
            assert not torch.equal(server.pool[part][g], before[part][g])
    untouched = [g for g in range(6) if g not in {rt.env.label_task(0, k) for k in replies}]
    assert all(torch.equal(server.pool[p][g], before[p][g]) for p in server.pool for g in untouched)
    down = grid.sent[-1]
    assert not torch.equal(down[0].tensors["prompt.own_prompts"], down[1].tensors["prompt.own_prompts"])
    up = sum(r.nbytes() for r in replies.values())
    assert up < sum(m.nbytes() for m in down.values())


def test_not_true_distillation_is_the_weighted_kl_over_the_other_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(4, 9, generator=gen), torch.randn(4, 9, generator=gen)
    slots, y = torch.tensor([3, 4, 5, 6]), torch.tensor([3, 5, 6, 4])
    w = torch.softmax(torch.randn(4, generator=gen), 0)
    tau = 3.0
    want = 0.0
    for b in range(4):
        keep = [int(s) for s in slots if s != y[b]]
        pt = F.softmax(teacher[b, keep] / tau, 0)
        ps = F.softmax(student[b, keep] / tau, 0)
        want += w[b] * tau**2 * (pt * (pt.log() - ps.log())).sum()
    got = not_true_distillation(student, teacher, y, slots, w, tau)
    assert got == pytest.approx(float(want), rel=1e-5)
    assert float(not_true_distillation(teacher, teacher, y, slots, w, tau)) == pytest.approx(0.0, abs=1e-7)
    moved = student.clone()
    moved[torch.arange(4), y] += 5.0  # the label's own logit is not distilled
    assert not_true_distillation(moved, teacher, y, slots, w, tau) == pytest.approx(float(got), rel=1e-5)


def test_powder_run_scores_each_tasks_generated_prompt_and_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tiny_config(**powder())
    ref = Experiment(cfg, tmp_path / "ref", show_progress=False).run()
    assert ref["regime"] == "task_aware_slots" and ref["scored_model"] == "task"
    rounds = [json.loads(x) for x in (tmp_path / "ref" / "rounds.jsonl").read_text().splitlines()]
    starts = [r for r in rounds if r["round"] == 0]
    assert all(r["messages"] == 6 and 0 < r["powder_self_weight"] <= 1 for r in starts)  # signatures + train
    assert all(r["last_loss"] < r["chance_loss"] for r in rounds if r["round"] == 1)
    resumed = interrupted_then_resumed(cfg, tmp_path / "cut", rounds=3)
    assert resumed["evaluations"] == ref["evaluations"] and resumed["summary"] == ref["summary"]
