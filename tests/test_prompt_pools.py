"""Prompt pools: selection, weighting, growth and auxiliary losses behave as their papers define them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from promptfcl.backbones.vit import build_vit
from promptfcl.model import PromptedClassifier
from promptfcl.prompts import CodaPool, DualPromptPool, L2PPool, WeightedPool

from .test_backbone import CFG

D = 48


def queries(n: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed))


def test_l2p_selects_the_top_k_keys_and_the_pull_loss_moves_only_them() -> None:
    torch.manual_seed(0)
    pool = L2PPool(D, pool_size=16, length=3, top_k=3).train()
    q = queries()
    spec = pool(len(q), q)
    brute = torch.stack([torch.argsort(-F.cosine_similarity(qi[None], pool.keys), stable=True)[:3] for qi in q])
    assert torch.equal(pool.selected.sort(1).values, brute.sort(1).values)
    assert spec.tokens.shape == (6, 9, D) and spec.token_position == "prepend"
    assert torch.equal(spec.tokens[0, :3], pool.prompts[0, pool.selected[0, 0]])
    before = pool.keys.detach().clone()
    cos_before = F.cosine_similarity(q[:, None], before[pool.selected], dim=-1)
    pool.aux_loss.backward()
    assert pool.prompts.grad is None  # the pull loss trains keys only
    with torch.no_grad():
        pool.keys -= 0.5 * pool.keys.grad
    chosen = torch.unique(pool.selected)
    untouched = torch.tensor([i for i in range(16) if i not in chosen.tolist()], dtype=torch.long)
    assert len(untouched) > 0
    assert torch.equal(pool.keys[untouched], before[untouched])
    cos_after = F.cosine_similarity(q[:, None], pool.keys.detach()[pool.selected], dim=-1)
    assert cos_after.mean() > cos_before.mean()


def test_l2p_batchwise_voting_and_task_partition() -> None:
    torch.manual_seed(1)
    pool = L2PPool(D, pool_size=8, length=2, top_k=2, batchwise_voting=True).train()
    pool(6, queries())
    assert (pool.selected == pool.selected[0]).all()
    part = L2PPool(D, pool_size=8, length=2, top_k=2, task_partition=2).train()
    part.set_task(2)
    part(6, queries())
    assert set(part.selected.flatten().tolist()) <= {4, 5}  # training task 2 may use only its own block
    part.eval()
    part(6, queries())
    assert set(part.selected.flatten().tolist()) <= set(range(6))  # evaluation: every block seen so far


def test_dualprompt_uses_the_task_prompt_in_training_and_the_nearest_key_at_test() -> None:
    torch.manual_seed(2)
    pool = DualPromptPool(D, g_layers=[0], e_layers=[1, 2], pool_size=4, g_length=2, e_length=3).train()
    pool.set_task(2)
    q = queries()
    spec = pool(len(q), q)
    assert (pool.selected == 2).all()
    assert torch.equal(spec.prefix[1][0][0], pool.e_prompts[0, 2, :3]) and spec.prefix[0][0].shape == (1, 2, D)
    assert pool.aux_loss.requires_grad and pool.aux_loss > 0
    pool.eval()
    spec = pool(len(q), q)
    nearest = F.cosine_similarity(q[:, None], pool.keys[None, :3], dim=-1).argmax(1)
    assert torch.equal(pool.selected, nearest)
    assert torch.equal(spec.prefix[2][1][3], pool.e_prompts[1, nearest[3], 3:])


def test_coda_weights_match_the_formula_and_only_seen_components_contribute() -> None:
    torch.manual_seed(3)
    pool = CodaPool(D, num_tasks=4, layers=[0, 1], pool_size=8, length=2)
    pool.start_task(1)
    pool.eval()
    q = queries()
    alpha = pool.component_weights(q, 1)
    assert alpha.shape == (6, 4)  # tasks 0 and 1: 2 components each
    for b in range(6):
        for m in range(4):
            expect = F.cosine_similarity(q[b] * pool.attention[1, m], pool.keys[1, m], dim=0)
            assert torch.allclose(alpha[b, m], expect, atol=1e-6)
    spec = pool(6, q)
    manual = sum(alpha[:, m, None, None] * pool.prompts[1, m] for m in range(4))
    assert torch.allclose(spec.prefix[1][0], manual[:, :1]) and torch.allclose(spec.prefix[1][1], manual[:, 1:])


def test_coda_detaches_earlier_tasks_and_grows_orthogonally() -> None:
    torch.manual_seed(4)
    pool = CodaPool(D, num_tasks=4, layers=[0], pool_size=8, length=2)
    block0 = pool.keys[0, :2].detach().clone()
    pool.start_task(1)
    assert torch.equal(pool.keys[0, :2], block0)  # growing never touches earlier blocks
    for t in (pool.keys[0], pool.attention[0], pool.prompts[0].flatten(1)):
        gram = t[:4].detach() @ t[:4].detach().T
        assert torch.allclose(gram, torch.eye(4), atol=1e-5)  # new block orthonormal to the old one
    pool.train()
    q = queries()
    spec = pool(6, q)
    (spec.prefix[0][0].sum() + spec.prefix[0][1].sum()).backward()
    g = pool.prompts.grad[0]
    assert (g[:2] == 0).all() and (g[2:4] != 0).any() and (g[4:] == 0).all()
    assert (pool.keys.grad[0, :2] == 0).all() and (pool.keys.grad[0, 2:4] != 0).any()
    pool.start_task(1)  # idempotent: a resumed run re-calls it
    assert int(pool.initialized_tasks) == 2


def test_weighted_pool_is_the_explicit_cosine_weighted_sum() -> None:
    torch.manual_seed(5)
    pool = WeightedPool(D, layers=[0, 2], pool_size=5, length=4)
    q = queries()
    spec = pool(6, q)
    for i, layer in enumerate([0, 2]):
        for b in range(6):
            manual = sum(F.cosine_similarity(q[b], pool.keys[i, m], dim=0) * pool.prompts[i, m] for m in range(5))
            assert torch.allclose(spec.prefix[layer][0][b], manual[:2], atol=1e-5)
            assert torch.allclose(spec.prefix[layer][1][b], manual[2:], atol=1e-5)


@pytest.mark.parametrize(
    "make",
    [
        lambda: L2PPool(D, pool_size=8, length=2, top_k=2, task_partition=2),
        lambda: DualPromptPool(D, g_layers=[0], e_layers=[1], pool_size=4, g_length=2, e_length=2),
        lambda: CodaPool(D, num_tasks=4, layers=[0, 1], pool_size=8, length=2),
        lambda: WeightedPool(D, layers=[0, 1], pool_size=5, length=4),
    ],
)
def test_state_shapes_do_not_depend_on_the_task_and_gradients_reach_the_pool(make) -> None:
    pool = make()
    shapes0 = {k: v.shape for k, v in pool.state_dict().items()}
    pool.start_task(3)
    assert {k: v.shape for k, v in pool.state_dict().items()} == shapes0  # FedAvg of any two tasks' states
    vit = build_vit(CFG)
    model = PromptedClassifier(vit, 10, pool).train()
    x = torch.rand(4, 3, 32, 32)
    logits = model(x)
    assert torch.isfinite(logits).all()
    (logits.sum() + pool.aux_loss).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in pool.parameters())
