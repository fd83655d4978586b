"""Prompt pools: selection, weighting, growth and auxiliary losses behave as their papers define them."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from promptfcl.backbones.vit import FrozenViT, build_vit
from promptfcl.config import BackboneConfig
from promptfcl.federation.aggregation import weighted_mean
from promptfcl.model import PromptedClassifier
from promptfcl.prompts import CodaPool, DualPromptPool, L2PPool, WeightedPool
from promptfcl.prompts.pools import PromptPool

D = 48
VIT5 = BackboneConfig(
    name="vit_tiny_patch16_224", img_size=32, kwargs={"patch_size": 8, "depth": 5, "embed_dim": D, "num_heads": 3}
)


def queries(n: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed))


def cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a, b, dim=-1)


# --- L2P ----------------------------------------------------------------------------------------------------------


def test_l2p_selects_the_top_k_keys_and_builds_token_prompts() -> None:
    torch.manual_seed(0)
    pool = L2PPool(D, pool_size=16, length=3, top_k=3).train()
    q = queries()
    spec = pool(len(q), q)
    brute = torch.stack([torch.argsort(-cos(qi[None], pool.keys))[:3] for qi in q])
    assert torch.equal(pool.selected, brute)
    assert spec.tokens.shape == (6, 9, D) and spec.token_position == "prepend" and spec.token_pos_embed is None
    for b in range(6):
        expect = torch.cat([pool.prompts[0, i] for i in brute[b]])
        assert torch.equal(spec.tokens[b], expect)
    manual = 0.1 * torch.stack([1 - cos(q[b], pool.keys[brute[b, j]]) for b in range(6) for j in range(3)]).mean()
    assert torch.allclose(pool.aux_loss, manual)
    pool.eval()
    pool(len(q), q)
    assert pool.aux_loss.item() == 0 and not pool.aux_loss.requires_grad


def test_l2p_pull_step_raises_selected_similarity_and_leaves_other_keys_alone() -> None:
    torch.manual_seed(1)
    pool = L2PPool(D, pool_size=16, length=3, top_k=3).train()
    q = queries()
    pool(len(q), q)
    sel = pool.selected.clone()
    before = pool.keys.detach().clone()
    pool.aux_loss.backward()
    assert pool.prompts.grad is None  # the pull loss trains keys only
    with torch.no_grad():
        pool.keys -= 10.0 * pool.keys.grad  # one SGD step
    chosen = set(sel.flatten().tolist())
    unchosen = [i for i in range(16) if i not in chosen]
    assert unchosen and torch.equal(pool.keys[unchosen], before[unchosen])
    for k in chosen:  # every selected key moved towards the queries that selected it
        rows = (sel == k).any(1)
        assert cos(q[rows], pool.keys[k].detach()).sum() > cos(q[rows], before[k]).sum()


def test_l2p_batchwise_voting_uses_the_most_frequent_ids_for_every_sample() -> None:
    torch.manual_seed(2)
    voting = L2PPool(D, pool_size=8, length=2, top_k=2, batchwise_voting=True).train()
    plain = copy.deepcopy(voting)
    plain.batchwise = False
    q = queries(12)
    voting(len(q), q)
    plain(len(q), q)
    assert (voting.selected == voting.selected[0]).all()
    counts = torch.bincount(plain.selected.flatten(), minlength=8)
    top = counts.sort(descending=True, stable=True).indices[:2]
    assert set(voting.selected[0].tolist()) == set(top.tolist())


def test_l2p_task_partition_restricts_training_selection_only() -> None:
    torch.manual_seed(3)
    pool = L2PPool(D, pool_size=8, length=2, top_k=2, task_partition=2).train()
    q = queries()
    with torch.no_grad():
        pool.keys[1] = q[0]  # block of task 0 holds sample 0's nearest key
    pool.set_task(2)
    pool(len(q), q)
    assert set(pool.selected.flatten().tolist()) == {4, 5}  # training task 2 uses only its own block
    pool.eval()
    pool(len(q), q)
    assert set(pool.selected.flatten().tolist()) <= set(range(6))  # evaluation: every block seen so far
    assert 1 in pool.selected[0].tolist()
    with pytest.raises(ValueError):
        pool.set_task(4)  # needs prompts 8..9, the pool holds 8


def test_l2p_prefix_mode_splits_every_selected_prompt_into_key_and_value_halves() -> None:
    torch.manual_seed(4)
    pool = L2PPool(D, pool_size=6, length=4, top_k=2, mode="prefix", layers=[0, 2]).train()
    q = queries()
    spec = pool(len(q), q)
    assert spec.tokens is None and set(spec.prefix) == {0, 2}
    ids = pool.selected
    for b in range(6):
        keys, values = spec.prefix[2][0][b], spec.prefix[2][1][b]
        assert torch.equal(keys, torch.cat([pool.prompts[1, ids[b, 0], :2], pool.prompts[1, ids[b, 1], :2]]))
        assert torch.equal(values, torch.cat([pool.prompts[1, ids[b, 0], 2:], pool.prompts[1, ids[b, 1], 2:]]))
    with pytest.raises(ValueError):
        L2PPool(D, length=5, mode="prefix")


# --- DualPrompt ---------------------------------------------------------------------------------------------------


def test_dualprompt_uses_the_task_prompt_in_training_and_the_nearest_seen_key_at_test() -> None:
    torch.manual_seed(5)
    pool = DualPromptPool(D, g_layers=[0], e_layers=[1, 2], pool_size=4, g_length=2, e_length=3).train()
    pool.set_task(2)
    q = queries()
    spec = pool(len(q), q)
    assert (pool.selected == 2).all()
    assert spec.prefix[0][0].shape == (1, 2, D) and torch.equal(spec.prefix[0][1][0], pool.g_prompts[0, 2:])
    assert torch.equal(spec.prefix[1][0][4], pool.e_prompts[0, 2, :3])
    assert torch.equal(spec.prefix[2][1][4], pool.e_prompts[1, 2, 3:])
    assert torch.allclose(pool.aux_loss, (1 - cos(q, pool.keys[2][None])).mean())
    pool.aux_loss.backward()
    assert (pool.keys.grad[[0, 1, 3]] == 0).all() and (pool.keys.grad[2] != 0).any()

    pool.eval()
    with torch.no_grad():
        pool.keys[3] = q[0]  # task 3 is not seen yet: its key must not be chosen
    spec = pool(len(q), q)
    nearest = cos(q[:, None], pool.keys[None, :3]).argmax(1)
    assert torch.equal(pool.selected, nearest) and len(set(nearest.tolist())) > 1
    assert torch.equal(spec.prefix[2][1][3], pool.e_prompts[1, nearest[3], 3:])
    assert pool.aux_loss.item() == 0
    pool.batchwise = True
    pool(len(q), q)
    assert (pool.selected == pool.selected[0]).all()


# --- CODA-P -------------------------------------------------------------------------------------------------------


def test_coda_weights_match_the_formula_and_only_tasks_up_to_t_contribute() -> None:
    torch.manual_seed(6)
    pool = CodaPool(D, num_tasks=4, layers=[0, 1], pool_size=8, length=2)
    pool.set_task(1)
    pool.eval()
    q = queries()
    alpha = pool.component_weights(q, 1)
    assert alpha.shape == (6, 4)  # tasks 0 and 1: 2 components each
    for b in range(6):
        for m in range(4):
            assert torch.allclose(alpha[b, m], cos(q[b] * pool.attention[1, m], pool.keys[1, m]), atol=1e-6)
    spec = pool(6, q)
    manual = sum(alpha[:, m, None, None] * pool.prompts[1, m] for m in range(4))
    assert torch.allclose(spec.prefix[1][0], manual[:, :1]) and torch.allclose(spec.prefix[1][1], manual[:, 1:])
    with torch.no_grad():
        pool.set_task(3)
        pool.prompts[:, 4:] += 5.0  # components of tasks 2 and 3
        pool.set_task(1)
    assert torch.equal(pool(6, q).prefix[1][0], spec.prefix[1][0])  # later tasks do not contribute


def test_coda_training_gives_no_gradient_to_earlier_or_later_tasks() -> None:
    torch.manual_seed(7)
    pool = CodaPool(D, num_tasks=4, layers=[0], pool_size=8, length=2, ortho_mu=0.5)
    pool.set_task(1)
    pool.train()
    spec = pool(6, queries())
    assert pool.aux_loss > 0
    (spec.prefix[0][0].sum() + spec.prefix[0][1].sum() + pool.aux_loss).backward()
    for t in (pool.prompts, pool.keys, pool.attention):
        g = t.grad[0].flatten(1)
        assert (g[:2] == 0).all() and (g[2:4] != 0).any() and (g[4:] == 0).all()


def test_coda_set_task_draws_each_new_block_once_orthogonal_to_the_earlier_ones() -> None:
    torch.manual_seed(8)
    pool = CodaPool(D, num_tasks=4, layers=[0, 1], pool_size=8, length=2)
    with torch.no_grad():  # "training" on task 0 makes its block non-orthonormal
        for t in (pool.prompts, pool.keys, pool.attention):
            t[:, :2] += 0.5 * torch.randn_like(t[:, :2])
    old = {n: t[:, :2].detach().clone() for n, t in pool.named_parameters()}
    pool.set_task(1)
    for name, t in pool.named_parameters():
        assert torch.equal(t[:, :2], old[name])  # growing never touches earlier blocks
        for layer in range(2):
            rows = t[layer].detach().flatten(1)
            new = rows[2:4]
            assert torch.allclose(new @ new.T, torch.eye(2), atol=1e-5)
            assert torch.allclose(new @ rows[:2].T, torch.zeros(2, 2), atol=1e-5)
    assert int(pool.initialized_tasks) == 2
    drawn = copy.deepcopy(pool.state_dict())
    pool.set_task(1)  # idempotent: a resumed run or a client re-calls it
    fresh = CodaPool(D, num_tasks=4, layers=[0, 1], pool_size=8, length=2)
    fresh.load_state_dict(drawn)
    fresh.set_task(1)  # the loaded state says block 1 exists: nothing is redrawn
    for name, value in drawn.items():
        assert torch.equal(pool.state_dict()[name], value) and torch.equal(fresh.state_dict()[name], value)
    with pytest.raises(ValueError):
        pool.set_task(4)


# --- HePCo's weighted pool ----------------------------------------------------------------------------------------


def test_weighted_pool_is_the_explicit_cosine_weighted_sum() -> None:
    torch.manual_seed(9)
    pool = WeightedPool(D, layers=[0, 2], pool_size=5, length=4)
    assert pool.keys.min() >= 0 and pool.prompts.max() <= 1  # U(0, 1) init
    q = queries()
    spec = pool(6, q)
    for i, layer in enumerate([0, 2]):
        for b in range(6):
            manual = sum(cos(q[b], pool.keys[i, m]) * pool.prompts[i, m] for m in range(5))
            assert torch.allclose(spec.prefix[layer][0][b], manual[:2], atol=1e-5)
            assert torch.allclose(spec.prefix[layer][1][b], manual[2:], atol=1e-5)
    assert pool.selected is None and pool.aux_loss.item() == 0


@pytest.mark.parametrize("detach", [False, True])
def test_weighted_pool_detach_query_switch(detach: bool) -> None:
    pool = WeightedPool(D, layers=[0], pool_size=3, length=2, detach_query=detach)
    z = queries().requires_grad_(True)
    spec = pool(6, z)
    spec.prefix[0][0].sum().backward()
    assert (z.grad is None) == detach
    assert pool.keys.grad is not None and pool.keys.grad.abs().sum() > 0


# --- shared protocol ----------------------------------------------------------------------------------------------

POOLS: list[Callable[[], PromptPool]] = [
    lambda: L2PPool(D, pool_size=8, length=2, top_k=2, task_partition=2),
    lambda: DualPromptPool(D, pool_size=4, g_length=2, e_length=2),
    lambda: CodaPool(D, num_tasks=4, pool_size=8, length=2, ortho_mu=0.1),
    lambda: WeightedPool(D, pool_size=5, length=4),
]


@pytest.mark.parametrize("make", POOLS)
def test_state_shapes_do_not_depend_on_the_task(make: Callable[[], PromptPool]) -> None:
    pool = make()
    s0 = copy.deepcopy(pool.state_dict())
    pool.set_task(3)
    s3 = pool.state_dict()
    assert {k: v.shape for k, v in s3.items()} == {k: v.shape for k, v in s0.items()}
    pool.load_state_dict(weighted_mean([s0, s3]))  # FedAvg of a task-0 and a task-3 client


@pytest.fixture(scope="module")
def vit() -> FrozenViT:
    return build_vit(VIT5)


@pytest.mark.parametrize("make", POOLS)
def test_end_to_end_logits_are_finite_and_gradients_reach_every_pool_parameter(
    make: Callable[[], PromptPool], vit: FrozenViT
) -> None:
    torch.manual_seed(10)
    pool = make()
    pool.set_task(1)
    model = PromptedClassifier(vit, 10, pool).train()
    logits = model(torch.rand(4, 3, 32, 32))
    assert logits.shape == (4, 10) and torch.isfinite(logits).all()
    (logits.sum() + pool.aux_loss).backward()
    for name, p in pool.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    copy.deepcopy(pool)  # a pool holding a graph-attached aux_loss must still copy (server snapshots)
