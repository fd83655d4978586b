"""C2Prompt on Powder's base (`base: powder`): with LCDC and CPA off it is Powder; CPA mixes the participants' own
task blocks by their class histograms; a full run exchanges statistics, signatures and training at every stage
start, fits LCDC and scores each (client, task) on its generated prompt — so the paper's ablation rows "Powder",
"+ LCDC", "+ CPA" and C2Prompt are four configs of one method."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from promptfcl.experiment import Experiment
from promptfcl.methods.c2prompt import C2PromptPowderClient, C2PromptPowderServer
from promptfcl.methods.c2prompt.cpa import class_affinity_weights
from promptfcl.prompts.codap import attention_weights

from .conftest import tiny_config
from .test_c2prompt import ASYNC, POOL, programs_on_a_grid, run_round

SHAPE = {"top_k": 2, **POOL}


def c2p_powder(**method) -> dict:
    return {**ASYNC, "method": {"name": "c2prompt", "base": "powder", "components_per_stage": 2, **SHAPE, **method}}


@pytest.mark.slow
def test_powder_base_without_lcdc_and_cpa_is_powder(tmp_path: Path) -> None:
    a = Experiment(
        tiny_config(**ASYNC, method={"name": "powder", "components_per_task": 2, **SHAPE}), tmp_path / "a",
        show_progress=False,
    ).run()  # fmt: skip
    b = Experiment(tiny_config(**c2p_powder(lcdc=False, cpa=False)), tmp_path / "b", show_progress=False).run()
    assert a["evaluations"] == b["evaluations"] and a["scored_model"] == b["scored_model"] == "task"
    assert a["communication"]["bytes_up"] < b["communication"]["bytes_up"]  # + the histograms


def test_cpa_on_powder_mixes_the_participants_own_blocks() -> None:
    """Each participant uploads H_k[l, m, c] over its own block's N components (columns = the real classes it
    trained); per layer W = row-softmax(Ĥ Ĥᵀ / τ) (from scratch) and task g_k's block becomes rows k of W·P."""
    rt, server, grid = programs_on_a_grid(c2p_powder(lcdc=False))
    assert isinstance(server, C2PromptPowderServer) and isinstance(grid.client, C2PromptPowderClient)
    server.begin_stage(0)
    run_round(server, grid, 0, 0, (0, 1, 2))
    replies, K, N = grid.replies[-1], 3, 2
    for k in range(K):
        task = rt.scenario.label_space.tasks[rt.env.label_task(0, k)]
        hist = replies[k].tensors["cpa/hist"]
        assert hist.shape == (2, N, 12)
        assert set((hist != 0).any(0).any(0).nonzero().flatten().tolist()) == set(task.classes)
    for layer in range(2):
        H = torch.stack([replies[k].tensors["cpa/hist"][layer] for k in range(K)])
        W = class_affinity_weights(H, rt.params.cpa_temperature, rt.params.histogram_norm)
        for part in ("prompts", "keys", "attention"):
            P = torch.cat([replies[k].tensors[f"prompt.own_{part}"][layer] for k in range(K)]).double()
            mixed = (W @ P.reshape(K * N, -1)).reshape(P.shape)
            for k in range(K):
                got = server.pool[part][rt.env.label_task(0, k), layer].double()
                assert torch.allclose(got, mixed[k * N : (k + 1) * N], atol=1e-6), (part, k)
                assert not torch.allclose(got, replies[k].tensors[f"prompt.own_{part}"][layer].double())


def test_c2prompt_on_powder_runs_lcdc_signatures_and_cpa(tmp_path: Path) -> None:
    m = Experiment(tiny_config(**c2p_powder()), tmp_path / "run", show_progress=False).run()
    rounds = [json.loads(x) for x in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    starts = [r for r in rounds if r["round"] == 0]
    assert all(r["messages"] == 9 for r in starts)  # statistics, signatures, training: 3 clients each
    assert all(r["lcdc_nll_after"] < r["lcdc_nll_before"] and "powder_self_weight" in r for r in starts)
    assert all(0 < r["cpa_self_weight"] < r["cpa_own_client_weight"] < 1 for r in rounds)
    assert m["scored_model"] == "task" and m["regime"] == "task_aware_slots"


def test_powder_base_histogram_counts_the_own_blocks_alpha_per_layer() -> None:
    """H[l, m, c] += Σ_{x of real class c} α^{(l)}_m(x), α from the client's own block's keys and attention vectors
    of layer l (computed here from scratch)."""
    rt, server, grid = programs_on_a_grid(c2p_powder(lcdc=False))
    server.begin_stage(0)
    server.trained[0] = True
    model, client = server.client_model(0, 0), grid.client
    x = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    q, real = rt.env.backbone.query(x), torch.tensor([3, 3, 5, 7, 5, 3])
    hist = torch.zeros(2, 2, 12)
    client.accumulate(hist, model, q, real)
    for layer in range(2):
        alpha = attention_weights(q, model.prompt.own_keys[layer], model.prompt.own_attention[layer])
        want = torch.zeros(2, 12).index_add_(1, real, alpha.detach().T)
        assert torch.allclose(hist[layer], want, atol=1e-6), layer
