"""C2Prompt's defining behaviours: exact moment matching and each client's global Gaussians, LCDC lowers the NLL
and pulls clients' class means together, compensation prompts only in training at rate p, histogram → W → each
client's rows, client-specific downlinks, Fed-CODAP as the both-off ablation, exact resume, FWT, which model the
reports say was scored."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from promptfcl.backbones.vit import FrozenViT, build_vit
from promptfcl.config import BackboneConfig
from promptfcl.data.base import ImageSplit
from promptfcl.data.loader import LabeledSubset
from promptfcl.data.transforms import ImageTransform
from promptfcl.evaluation.regimes import SlotRegime
from promptfcl.experiment import Experiment
from promptfcl.federation.protocol import RoundInfo
from promptfcl.methods.base.fedavg import SupervisedClient
from promptfcl.methods.c2prompt import C2PromptClient, TrainingPass
from promptfcl.methods.c2prompt.compensation_prompts import CompensationPrompts
from promptfcl.methods.c2prompt.compensation_training import mean_nll, train_compensation
from promptfcl.methods.c2prompt.cpa import class_affinity_weights, mix_rows
from promptfcl.runtime import Runtime
from promptfcl.statistics import pooled, summarize

from .conftest import TINY, RecordingGrid, deep_update, interrupted_then_resumed, tiny_config

ASYNC = {
    "data": {"options": {"num_classes": 12, "train_per_class": 24, "test_per_class": 6}},
    "scenario": {
        "kind": "asynchronous",
        "num_tasks": 2,
        "num_clients": 3,
        "classes_per_task": 4,
        "rounds_per_task": 2,
        "asynchronous": {"data_slices": 2},
    },
}
POOL = {"layers": [0, 1], "local_epochs": 1, "batch_size": 8, "lr": 0.01, "length": 2}


def c2p(**method) -> dict:
    return {**ASYNC, "method": {"name": "c2prompt", "components_per_stage": 2, **POOL, **method}}


def programs_on_a_grid(raw: dict):  # noqa: ANN201
    rt = Runtime.build(tiny_config(**raw))
    server, client = rt.programs()
    return rt, server, RecordingGrid(client, rt.scenario, rt.dataset.train, rt.cfg.seed, rt.device)


def run_round(server, grid: RecordingGrid, task: int, rnd: int, clients: tuple[int, ...]) -> dict:  # noqa: ANN001
    info = RoundInfo(task, rnd, clients)
    grid.start_round(info)
    return server.run_round(grid, info)


def test_moment_matching_equals_the_pooled_data_statistics() -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 1.0, 0.0), (12, 3.0, 2.0), (4, 0.5, -1.0)]
    parts = [torch.randn(n, 5, generator=gen, dtype=torch.float64) * s + m for n, s, m in shapes]
    stats = [summarize(f.float(), torch.zeros(len(f), dtype=torch.long)) for f in parts]
    glob = pooled(stats)
    allf = torch.cat(parts)
    assert torch.allclose(glob.means[0].double(), allf.mean(0), atol=1e-5)
    assert torch.allclose(glob.spread[0].double(), allf.var(0), atol=1e-4)  # unbiased pooled variance
    assert glob.counts[0] == len(allf)


def test_round_zero_sends_each_client_the_moment_matched_gaussians_of_its_classes() -> None:
    """Round 0: the clients' q(x) statistics go up, and each client receives, for every real class of its task,
    the mean and variance of q(x) over all participants' images of that class (computed here from the images)."""
    raw = deep_update(
        c2p(), {"scenario": {"asynchronous": {"slice_rule": "distinct", "min_overlap": 2, "data_slices": 4}}}
    )
    rt, server, grid = programs_on_a_grid(raw)  # distinct slices: clients sharing a class hold different images
    server.begin_stage(0)
    run_round(server, grid, 0, 0, (0, 1, 2))
    assert [m.kind for m in grid.sent[0].values()] == ["stats"] * 3
    sent = grid.sent[1]
    feats: dict[int, list[torch.Tensor]] = {}
    identity = torch.arange(rt.dataset.num_classes)
    for k in range(3):
        data = LabeledSubset.of(rt.dataset.train, rt.scenario.client_indices(0, k), identity)
        for x, c in data.batches(64, rt.env.eval_transform):
            q = rt.env.backbone.query(x)
            for cls in c.unique().tolist():
                feats.setdefault(cls, []).append(q[c == cls])
    shared = 0
    for k in range(3):
        task = rt.scenario.label_space.tasks[rt.env.label_task(0, k)]
        classes = sent[k].tensors["lcdc/classes"].tolist()
        assert sorted(classes) == sorted(task.classes)
        for i, c in enumerate(classes):
            allf = torch.cat(feats[c]).double()
            assert torch.allclose(sent[k].tensors["lcdc/mean"][i].double(), allf.mean(0), atol=1e-5)
            assert torch.allclose(sent[k].tensors["lcdc/var"][i].double(), allf.var(0), rtol=1e-3, atol=1e-6)
            if len(feats[c]) > 1:  # held by several clients: the spread between their means counts too
                within = sum((len(f) - 1) * f.double().var(0) for f in feats[c]) / (len(allf) - 1)
                shared = max(shared, float((allf.var(0) - within).abs().max()))
    assert shared > 1e-2  # some class's pooled variance is not the clients' within-class variance alone


def tiny_backbone():
    cfg = BackboneConfig(**TINY["backbone"])
    return build_vit(cfg)


def client_split(shift: float, gen: torch.Generator) -> ImageSplit:
    """One class of images whose brightness depends on the client: the intra-class gap LCDC compensates."""
    base = torch.rand(1, 3, 32, 32, generator=gen)
    imgs = (base + 0.15 * torch.rand(24, 3, 32, 32, generator=gen) + shift).clamp(0, 1)
    return ImageSplit((imgs * 255).to(torch.uint8), torch.zeros(24, dtype=torch.long))


def test_lcdc_lowers_the_nll_and_pulls_client_class_means_together() -> None:
    """Two clients see one class under different brightness; their unprompted class means straddle the global
    Gaussian. Each client's trained compensation prompt lowers the NLL below the unprompted features' and brings
    the two clients' class means closer (in the global Gaussian's Mahalanobis metric)."""
    torch.manual_seed(0)
    backbone = tiny_backbone()
    tf = ImageTransform(32, (0.5,) * 3, (0.5,) * 3)
    base = client_split(0.0, torch.Generator().manual_seed(1))
    splits = [ImageSplit((base.images.float() * s).clamp(0, 255).to(torch.uint8), base.targets) for s in (0.8, 1.2)]
    subsets = [LabeledSubset.of(s, torch.arange(24), torch.tensor([0])) for s in splits]
    with torch.no_grad():
        feats = [torch.cat([backbone(x) for x, _ in sub.batches(24, tf)]) for sub in subsets]
    glob = pooled([summarize(f, torch.zeros(24, dtype=torch.long)) for f in feats])
    var = glob.spread[0] + 1e-4
    index_of, dev = torch.tensor([0]), torch.device("cpu")
    after_means = []
    for k, sub in enumerate(subsets):
        prompts = CompensationPrompts(1, 3, backbone.embed_dim, torch.Generator().manual_seed(k))
        out = train_compensation(
            backbone, prompts, sub, index_of, glob.means, glob.spread, tf, 20, 0.05, 24, torch.Generator(), dev
        )
        unprompted = mean_nll(backbone, None, sub, index_of, glob.means, glob.spread, tf, dev, 1e-4)
        assert out["lcdc_nll_unprompted"] == pytest.approx(unprompted)  # the logged reference is q(x)'s NLL
        assert out["lcdc_nll_after"] < out["lcdc_nll_before"] and out["lcdc_nll_after"] < unprompted - 3.0
        with torch.no_grad():
            idx = torch.zeros(24, dtype=torch.long)
            after_means.append(torch.cat([backbone(x, prompts.spec(idx)) for x, _ in sub.batches(24, tf)]).mean(0))
    gap_before = ((feats[0].mean(0) - feats[1].mean(0)).pow(2) / var).sum()
    gap_after = ((after_means[0] - after_means[1]).pow(2) / var).sum()
    assert gap_after < 0.7 * gap_before


def test_split_ce_separates_compensated_from_plain_samples() -> None:
    """The LCDC shortcut diagnostic: the round's CE means over the samples that carried their label's compensation
    prompt and over the others, accumulated across batches (hand-computed on two batches)."""
    run = TrainingPass(torch.zeros(0))
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    y = torch.tensor([0, 0, 1])
    run.record_split_ce(logits, y, torch.tensor([True, False, False]))
    run.record_split_ce(logits[:1], y[:1], torch.tensor([True]))
    easy, hard, even = math.log(1 + math.exp(-2)), math.log(1 + math.exp(2)), math.log(2)
    out = run.split_ce()
    assert out["lcdc_ce_compensated"] == pytest.approx(easy)
    assert out["lcdc_ce_plain"] == pytest.approx((hard + even) / 2)
    assert TrainingPass(torch.zeros(0), split=torch.tensor([1.0, 1.0, 0.0, 0.0])).split_ce() == {}


def test_cpa_rows_sum_to_one_and_weight_agreeing_clients_more() -> None:
    # 3 clients x 2 components over 4 classes: client 1's profiles agree with client 0's, client 2's are reversed
    h0 = torch.tensor([[5.0, 1.0, 0.0, 0.0], [1.0, 5.0, 0.0, 0.0]])
    hist = torch.stack([h0, h0 + 0.1 * torch.rand(2, 4), h0.flip(0)])
    for norm in ("centered_l2", "l2", "l1", "none"):
        W = class_affinity_weights(hist if norm == "centered_l2" else hist.reshape(6, 4), 0.2, norm)
        assert W.shape == (6, 6) and torch.allclose(W.sum(1), torch.ones(6, dtype=W.dtype))
        assert (W >= 0).all()
    W = class_affinity_weights(hist, 0.2, "centered_l2")
    assert W[0, 2] > 10 * W[0, 4]  # component 0 of client 0: its counterpart at client 1 ≫ the reversed client 2
    assert W[0, 5] > 10 * W[0, 4]  # client 2's component with the agreeing profile is the one that counts
    rows = torch.randn(6, 3, 4)
    mixed = mix_rows(W, rows)
    assert torch.allclose(mixed[0], (W[0, :, None, None].float() * rows).sum(0), atol=1e-6)


def test_compensation_prompts_only_in_training_at_rate_p(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every backbone forward of a run, by phase: LCDC fits the compensation prompts alone (no discriminative
    prompt); discriminative training appends the label's frozen prompt to a share p of the samples; evaluation
    never appends one, and no upload carries them (they stay in the client's state)."""
    phase = {"now": "other"}
    calls: list[tuple[str, int, bool, bool]] = []  # (phase, samples, compensation tokens, discriminative prefix)
    forward = FrozenViT.forward

    def spy(self, x, spec=None):  # noqa: ANN001, ANN202
        calls.append((phase["now"], len(x), spec is not None and spec.tokens is not None, bool(spec and spec.prefix)))
        return forward(self, x, spec)

    def during(name: str, fn):  # noqa: ANN001, ANN202
        def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            before, phase["now"] = phase["now"], name
            try:
                return fn(*args, **kwargs)
            finally:
                phase["now"] = before

        return wrapped

    leaked: list[str] = []
    handle = C2PromptClient.handle

    def checked_handle(self, message, ctx):  # noqa: ANN001, ANN202
        reply = handle(self, message, ctx)
        own = ctx.state.tensors.get("lcdc/prompts")
        for name, t in reply.tensors.items():
            if name.startswith("lcdc") or (own is not None and t.shape == own.shape and torch.equal(t, own)):
                leaked.append(name)
        return reply

    monkeypatch.setattr(FrozenViT, "forward", spy)
    monkeypatch.setattr(C2PromptClient, "compensate", during("lcdc", C2PromptClient.compensate))
    monkeypatch.setattr(C2PromptClient, "train", during("train", SupervisedClient.train))
    monkeypatch.setattr(SlotRegime, "evaluate", during("eval", SlotRegime.evaluate))
    monkeypatch.setattr(C2PromptClient, "handle", checked_handle)
    p = 0.3
    Experiment(tiny_config(**c2p(compensation_prob=p)), tmp_path / "run", show_progress=False).run()

    lcdc = [c for c in calls if c[0] == "lcdc" and c[2]]
    assert lcdc and not any(c[3] for c in lcdc)  # LCDC: compensation prompt alone, no discriminative prompt
    train = [c for c in calls if c[0] == "train" and c[3]]  # discriminative forwards (the query has no prompt)
    total, compensated = sum(c[1] for c in train), sum(c[1] for c in train if c[2])
    assert total >= 300 and abs(compensated / total - p) < 0.08, (compensated, total)  # ±4.5 binomial sd
    evaluation = [c for c in calls if c[0] == "eval"]
    assert evaluation and not any(c[2] for c in evaluation)  # no compensation prompt at test time
    assert not leaked  # compensation prompts are never uploaded


def test_histogram_weights_and_each_clients_rows(tmp_path: Path) -> None:
    """The clients' uploaded histograms H_k[l, m, c] (columns = the real classes they trained) give, per layer,
    W = row-softmax(Ĥ Ĥᵀ / τ) (computed here from scratch); client k's stage block becomes rows [kN, (k+1)N) of
    W·P for prompts, keys and attention vectors; the next round sends each client exactly that."""
    rt, server, grid = programs_on_a_grid(c2p(lcdc=False))
    server.begin_stage(0)
    run_round(server, grid, 0, 0, (0, 1, 2))
    replies, K, N = grid.replies[-1], 3, 2
    tau = rt.params.cpa_temperature
    for k in range(K):
        hist = replies[k].tensors["cpa/hist"]  # (layers, N, real classes)
        task = rt.scenario.label_space.tasks[rt.env.label_task(0, k)]
        assert hist.shape == (2, N, 12) and set((hist != 0).any(0).any(0).nonzero().flatten().tolist()) == set(
            task.classes
        )
    for layer in range(2):
        H = torch.stack([replies[k].tensors["cpa/hist"][layer] for k in range(K)]).double()  # (K, N, C)
        H = H - H.mean(dim=1, keepdim=True)  # centred per client (histogram_norm: centered_l2)
        H = (H / H.norm(dim=2, keepdim=True)).reshape(K * N, -1)
        W = torch.exp(H @ H.T / tau)
        W = W / W.sum(dim=1, keepdim=True)
        for name in ("prompt.prompts", "prompt.keys", "prompt.attention"):
            P = torch.cat([replies[k].tensors[name][layer, :N] for k in range(K)]).double()
            mixed = (W @ P.reshape(K * N, -1)).reshape(P.shape)
            for k in range(K):
                got = server.pools[k][name][layer]
                assert torch.allclose(got[:N].double(), mixed[k * N : (k + 1) * N], atol=1e-6), (name, k)
                assert torch.equal(got[N:], replies[k].tensors[name][layer, N:])  # later stages' rows untouched
    pools = {k: {n: t.clone() for n, t in server.pools[k].items()} for k in range(K)}
    run_round(server, grid, 0, 1, (0, 1, 2))
    for k, msg in grid.sent[-1].items():
        assert all(torch.equal(msg.tensors[n], t) for n, t in pools[k].items())


def test_c2prompt_run_sends_each_client_its_own_prompts_and_lcdc_fits(tmp_path: Path) -> None:
    exp = Experiment(tiny_config(**c2p()), tmp_path / "c2p", show_progress=False)
    m = exp.run()
    s = exp.server
    block = slice(2, 4)  # stage 1's components
    pools = [s.pools[k]["prompt.prompts"][:, block] for k in range(3)]
    assert not torch.allclose(pools[0], pools[1]) and not torch.allclose(pools[1], pools[2])
    rounds = [json.loads(x) for x in (tmp_path / "c2p" / "rounds.jsonl").read_text().splitlines()]
    stage_starts = [r for r in rounds if r["round"] == 0]
    assert len(stage_starts) == 2 and all(r["lcdc_nll_after"] < r["lcdc_nll_before"] for r in stage_starts)
    assert all(r["lcdc_nll_unprompted"] != r["lcdc_nll_before"] for r in stage_starts)  # q(x), not the fresh prompt
    assert all("lcdc_nll_after" not in r for r in rounds if r["round"] > 0)
    for r in rounds:  # every round trains with the stage's compensation prompts, so both CE means are logged
        assert r["lcdc_ce_compensated"] > 0 and r["lcdc_ce_plain"] > 0
    assert stage_starts[0]["messages"] == 6  # statistics exchange + train, 3 clients
    for r in rounds:  # CPA's mixing diagnostics: a component keeps part of itself and mixes with other clients
        assert 0 < r["cpa_self_weight"] <= r["cpa_own_client_weight"] < 1 and 0 < r["cpa_weight_entropy"] <= 1
    ev = m["evaluations"]
    assert {(r["stage"], r["label_task"]) for r in ev if r["stage_end"]} == {
        (st, g) for st in range(2) for g in exp.scenario.trained_label_tasks(st)
    }
    assert m["regime"] == "task_aware_slots" and m["scored_model"] == "client"  # each client's own CPA model
    assert (
        "| scored on | each client's own aggregated model, per (client, task) |"
        in (tmp_path / "c2p" / "report.md").read_text()
    )
    for f in ("scenario_timeline.png", "accuracy_matrix.png", "accuracy_matrix.csv", "report.md"):
        assert (tmp_path / "c2p" / f).is_file()


@pytest.mark.slow
def test_both_ablations_off_is_fed_codap(tmp_path: Path) -> None:
    a = Experiment(
        tiny_config(**ASYNC, method={"name": "fedcodap", "pool_size": 4, **POOL}), tmp_path / "a", show_progress=False
    ).run()
    b = Experiment(tiny_config(**c2p(lcdc=False, cpa=False)), tmp_path / "b", show_progress=False).run()
    assert a["evaluations"] == b["evaluations"]
    assert a["communication"]["bytes_up"] < b["communication"]["bytes_up"]  # + the histograms
    # the reports say which model each row scored: Fed-CODAP the global one, C2Prompt each client's own
    assert a["scored_model"] == "global" and b["scored_model"] == "client"
    from promptfcl.cli import main

    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp")]) == 0
    md = (tmp_path / "cmp" / "report.md").read_text()
    setup = [line for line in md.splitlines() if "scored per (client, task)" in line]  # rows in argument order
    assert len(setup) == 2
    assert "on the global model" in setup[0] and "on each client's own aggregated model" in setup[1]
    assert "Scored models differ" in md


def test_resume_mid_run_equals_uninterrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_config(**c2p())
    ref = Experiment(cfg, tmp_path / "ref", show_progress=False).run()
    resumed = interrupted_then_resumed(cfg, tmp_path / "cut", rounds=3)
    assert resumed["evaluations"] == ref["evaluations"] and resumed["summary"] == ref["summary"]


def test_direct_reference_gives_forward_transfer(tmp_path: Path) -> None:
    direct_cfg = tiny_config(**{**ASYNC, "method": {"name": "codap_direct", "components_per_stage": 2, **POOL}})
    d = Experiment(direct_cfg, tmp_path / "direct", show_progress=False).run()
    # every (client, task) has its own model: the first-stage accuracies never change afterwards
    first = {r["label_task"]: r["accuracy"] for r in d["evaluations"] if r["stage"] == 0}
    later = {r["label_task"]: r["accuracy"] for r in d["evaluations"] if r["stage"] == 1}
    sched = Experiment(direct_cfg, tmp_path / "x", show_progress=False)
    sched.setup(False)
    done = set(sched.scenario.finished_label_tasks(0))
    assert all(later[g] == first[g] for g in done)
    assert d["scored_model"] == "task"  # one model per (client, task), read from the models the server served
    cfg = tiny_config(**c2p(), eval={"direct_reference": str(tmp_path / "direct")})
    m = Experiment(cfg, tmp_path / "c2p", show_progress=False).run()
    acc = {(r["stage"], r["label_task"]): r["accuracy"] for r in m["evaluations"]}
    ref = {(r["stage"], r["label_task"]): r["accuracy"] for r in d["evaluations"]}
    per_stage = []
    for st in range(2):
        fin = sched.scenario.finished_label_tasks(st)
        per_stage.append(sum(acc[st, g] - ref[st, g] for g in fin) / len(fin))
    assert m["summary"]["fwt"] == pytest.approx(sum(per_stage) / 2)
    assert m["direct_reference"] == str(tmp_path / "direct")
    # the same numbers post hoc from the two run directories
    from promptfcl.cli import main

    plain = Experiment(tiny_config(**c2p()), tmp_path / "plain", show_progress=False).run()
    assert plain["summary"]["fwt"] != plain["summary"]["fwt"]  # NaN: no reference given
    assert main(["transfer", str(tmp_path / "plain"), "--direct", str(tmp_path / "direct")]) == 0
    updated = json.loads((tmp_path / "plain" / "metrics.json").read_text())
    assert updated["summary"]["fwt"] == pytest.approx(m["summary"]["fwt"])
