"""CAPT's defining behaviours: the two clusterings, L_ca, true-row-only updates, per-cluster downlinks of P_c and
P_g, the bandit's reward setting the sync period, what each CLIP baseline learns and averages, plus a tiny
end-to-end run of CAPT and a server-state round trip."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from promptfcl.config import build_config
from promptfcl.methods.capt.bandit import BanditScheduler
from promptfcl.methods.capt.clustering import (
    cluster_rows,
    complementarity,
    complementary_clusters,
    js_divergence,
    normalise,
    pairwise_distance,
)

from .clip_fixtures import tiny_lt_raw
from .conftest import interrupted_then_resumed

# ------------------------------------------------------------------------------------------- clustering


def test_js_clustering_groups_identical_label_distributions() -> None:
    profiles = np.array([[0.8, 0.1, 0.1, 0.0], [0.0, 0.1, 0.1, 0.8], [0.25, 0.25, 0.25, 0.25]])
    order = [0, 1, 2, 0, 2, 1, 1, 0, 2]  # three clients per profile, interleaved
    d = profiles[order]
    for metric in ("js", "kl", "wasserstein", "tv", "cosine"):
        labels = cluster_rows(pairwise_distance(d, metric), 3, "kmeans", seed=7)
        for p in range(3):
            members = {int(labels[i]) for i in range(len(order)) if order[i] == p}
            assert len(members) == 1, metric  # identical distributions share a cluster
        assert len(set(labels.tolist())) == 3, metric  # different profiles do not


def test_js_divergence_values() -> None:
    assert js_divergence(np.array([1.0, 0.0]), np.array([0.0, 1.0])) == pytest.approx(math.log(2))
    assert js_divergence(np.array([0.5, 0.5]), np.array([0.5, 0.5])) == pytest.approx(0.0)
    p, q = np.array([0.9, 0.1]), np.array([0.6, 0.4])
    m = (p + q) / 2
    kl = lambda a, b: float(np.sum(a * np.log(a / b)))  # noqa: E731
    assert js_divergence(p, q) == pytest.approx(0.5 * kl(p, m) + 0.5 * kl(q, m))


def test_complementarity_clustering_paper_groups_alike_clients_and_the_deal_mixes_them() -> None:
    head_heavy = [0.7, 0.2, 0.05, 0.05, 0.0, 0.0]
    tail_heavy = [0.0, 0.0, 0.05, 0.05, 0.2, 0.7]
    kinds = ["h", "t", "h", "h", "t", "t", "h", "t"]
    d = np.array([head_heavy if k == "h" else tail_heavy for k in kinds])
    head_and_tail = [0, 1, 4, 5]
    c = complementarity(d, head_and_tail)
    assert c[0, 1] == pytest.approx(sum(d[0, j] * (1 - d[1, j]) for j in head_and_tail))
    assert c[0, 1] > c[0, 2]  # a head-heavy client complements a tail-heavy one more than another head-heavy one
    labels = complementary_clusters(c, 4, "kmeans", seed=0)  # het_grouping: deal
    for g in range(4):
        members = [kinds[i] for i in range(len(kinds)) if labels[i] == g]
        assert sorted(members) == ["h", "t"]  # every cluster mixes the two profiles
    plain = cluster_rows(c, 2, "kmeans", seed=0)  # het_grouping: paper, K-means on the rows of C as printed
    assert all(len({kinds[i] for i in range(len(kinds)) if plain[i] == g}) == 1 for g in set(plain.tolist()))
    assert len(set(plain.tolist())) == 2  # ... which puts alike clients together


# ------------------------------------------------------------------------------------------------ losses


def test_l_ca_is_balanced_softmax_cross_entropy_on_a_hand_example() -> None:
    from promptfcl.methods.capt import balanced_softmax_cross_entropy, true_row_logits

    s = torch.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]])
    prior = torch.tensor([0.5, 0.3, 0.2])
    y = torch.tensor([0, 2])
    by_hand = []
    for i, yi in enumerate(y.tolist()):
        num = prior[yi] * math.exp(s[i, yi])
        den = sum(prior[j] * math.exp(s[i, j]) for j in range(3))
        by_hand.append(-math.log(num / den))
    assert balanced_softmax_cross_entropy(s, y, prior).item() == pytest.approx(sum(by_hand) / 2, rel=1e-6)
    # sample i's logits reach the text features only through its own class's row
    z, t = torch.randn(2, 4), torch.randn(3, 4, requires_grad=True)
    logits = true_row_logits(torch.tensor(2.0), z, t, y)
    for i, yi in enumerate(y.tolist()):
        (grad,) = torch.autograd.grad(logits[i].sum(), t, retain_graph=True)
        assert grad.abs().sum(1).nonzero().flatten().tolist() == [yi]
        assert torch.allclose(grad[yi], 2.0 * z[i])


@pytest.fixture(scope="module")
def runtime():
    from promptfcl.runtime import Runtime

    return Runtime.build(build_config(tiny_lt_raw()))


@pytest.mark.parametrize("ca_text", ["integrated", "class"])
def test_only_the_true_class_rows_of_p_c_change_after_a_step(runtime, ca_text) -> None:
    from promptfcl.methods.capt import capt_loss

    server, _ = runtime.programs()
    model = server.model
    before = model.get_state()
    x = torch.rand(4, 3, 32, 32)
    y = torch.tensor([1, 3, 3, 1])
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    loss = capt_loss(torch.full((6,), 1 / 6), 1.0, ca_text)(model, x, y, torch.ones(6, dtype=torch.bool))
    loss.backward()
    opt.step()
    after = model.get_state()
    changed = [c for c in range(6) if not torch.equal(before["class_ctx"][c], after["class_ctx"][c])]
    assert changed == [1, 3]
    assert not torch.equal(before["ctx"], after["ctx"])  # P_g learns from every sample (L_ge)
    assert not torch.equal(before["coupling.0.weight"], after["coupling.0.weight"])


# ---------------------------------------------------------------------------------------------- server


class RecordingGrid:
    """An in-process grid that keeps every message it delivers and every reply; `losses` (round → value) replaces
    the loss that training replies report (to script the bandit's rewards)."""

    @staticmethod
    def make(runtime, client, losses: dict[int, float] | None = None):
        from promptfcl.federation.inprocess import InProcessGrid

        class _Grid(InProcessGrid):
            def _received(self, cid, sent, reply):  # a folding server strips the model tensors: keep them whole
                self.whole[cid] = reply.copy()
                return super()._received(cid, sent, reply)

            def _deliver(self, messages):
                self.sent.append({c: m.copy() for c, m in messages.items()})
                self.whole = {}
                replies = super()._deliver(messages)
                for r in replies.values():
                    if losses is not None and r.kind == "train_reply":
                        r.scalars["loss"] = losses[self.round.round]
                self.replies.append({c: self.whole.get(c, r).copy() for c, r in replies.items()})
                return replies

        grid = _Grid(client, runtime.scenario, runtime.dataset.train, runtime.cfg.seed, runtime.device)
        grid.sent, grid.replies = [], []
        return grid


def one_round(server, grid, rnd: int, participants: tuple[int, ...]) -> dict[str, float]:
    from promptfcl.federation.protocol import RoundInfo

    info = RoundInfo(0, rnd, participants)
    grid.start_round(info)
    return server.run_round(grid, info)


def train_replies(grid) -> dict:
    return next(b for b in reversed(grid.replies) if b and all(r.kind == "train_reply" for r in b.values()))


def test_cluster_members_receive_identical_p_c_and_clusters_different_ones(runtime) -> None:
    from promptfcl.federation.protocol import RoundInfo
    from promptfcl.methods.capt.clustering import normalise
    from promptfcl.seeding import derive_seed

    params = runtime.params.model_copy(update={"scheduler": "fixed", "sync_period": 100, "sim_clusters": 2})
    server, client = runtime.spec.programs(runtime.env, params)
    grid = RecordingGrid.make(runtime, client)
    participants = (0, 1, 2, 3, 4, 5)
    info = RoundInfo(0, 0, participants)
    grid.start_round(info)
    server.run_round(grid, info)
    updates = grid.sent[-1]
    assert set(updates) == set(participants) and all(m.kind == "update" for m in updates.values())
    counts = np.stack([server.counts[c] for c in participants])
    labels = cluster_rows(pairwise_distance(normalise(counts), "js"), 2, "kmeans", derive_seed(0, "capt", 0, 0))
    assert len(set(labels.tolist())) == 2
    pc = {c: updates[c].tensors["model/class_ctx"] for c in participants}
    for i, a in enumerate(participants):
        for j, b in enumerate(participants):
            assert torch.equal(pc[a], pc[b]) == (labels[i] == labels[j])
    # each client now holds its cluster's P_c in its state, and trains from it next time
    assert all(torch.equal(grid.states[c].tensors["model/class_ctx"], pc[c]) for c in participants)
    assert "model/coupling.0.weight" not in updates[0].tensors  # F stays local between global syncs


@pytest.mark.parametrize("coupling_sync", ["global", "cluster"])
def test_each_heterogeneity_cluster_receives_the_sample_weighted_mean_of_its_members_p_g(
    runtime, coupling_sync: str
) -> None:
    """Heterogeneity clustering as printed (default `het_grouping: paper`): K-means on the rows of the
    complementarity matrix over head ∪ tail classes; the members of a cluster receive the sample-weighted mean of
    their uploaded P_g (context and deep context), different clusters different ones. F stays local
    (`coupling_sync: global`, the default) or travels and is averaged with P_g in the same clusters (`cluster`)."""
    from promptfcl.methods.capt.clustering import normalise
    from promptfcl.seeding import derive_seed

    params = runtime.params.model_copy(
        update={"scheduler": "fixed", "sync_period": 100, "het_clusters": 2, "coupling_sync": coupling_sync}
    )
    assert runtime.params.het_grouping == "paper" and runtime.params.het_clusters == 3  # the paper's defaults
    server, client = runtime.spec.programs(runtime.env, params)
    grid = RecordingGrid.make(runtime, client)
    participants = (0, 1, 2, 3, 4, 5)
    metrics = one_round(server, grid, 0, participants)
    replies, updates = train_replies(grid), grid.sent[-1]
    d = normalise(np.stack([server.counts[c] for c in participants]))
    comp = complementarity(d, server.head_and_tail())
    labels = cluster_rows(comp, 2, "kmeans", derive_seed(0, "capt", 0, 0) + 1)
    assert metrics["het_clusters"] == 2 and len(set(labels.tolist())) == 2
    for g in set(labels.tolist()):
        members = [c for c, lab in zip(participants, labels, strict=True) if lab == g]
        n = torch.tensor([float(replies[c].scalars["num_samples"]) for c in members])
        coupling = [k for k in replies[members[0]].tensors if k.startswith("coupling.")]
        assert bool(coupling) == (coupling_sync == "cluster")  # F uploaded every round only with `cluster`
        for name in ("ctx", "deep_ctx", *coupling):
            expected = sum(w * replies[c].tensors[name].double() for w, c in zip(n / n.sum(), members, strict=True))
            for c in members:
                assert torch.allclose(updates[c].tensors["model/" + name].double(), expected, atol=1e-6)
    a, b = (next(c for c, lab in zip(participants, labels, strict=True) if lab == g) for g in (0, 1))
    assert not torch.equal(updates[a].tensors["model/ctx"], updates[b].tensors["model/ctx"])
    sent_f = [k.startswith("model/coupling") for m in updates.values() for k in m.tensors]
    assert any(sent_f) == (coupling_sync == "cluster")


@pytest.mark.parametrize(
    ("losses", "period"),
    [
        ([1.0, 0.99, 0.9, 0.3, 0.3, 0.3], 2),  # syncing every 2 rounds bought the larger loss drop per byte
        ([1.0, 0.5, 0.5, 0.49, 0.49, 0.49], 1),  # syncing every round did
    ],
)
def test_the_bandit_reward_sets_the_sync_period(runtime, losses, period) -> None:
    """Arms are sync periods {1, 2}; with c = 0 the bandit keeps the arm whose reward (relative loss decrease per
    unit of communication since the previous sync) was larger, and the next rounds sync with that period."""
    params = runtime.params.model_copy(update={"scheduler": "bandit", "arms": [1, 2], "bandit_c": 0.0})
    server, client = runtime.spec.programs(runtime.env, params)
    grid = RecordingGrid.make(runtime, client, dict(enumerate(losses)))
    log = [one_round(server, grid, r, (0, 2, 4)) for r in range(4)]
    assert [m["sync"] for m in log] == [1.0, 1.0, 0.0, 1.0]  # period 1 (tried first), then 2 (untried)
    assert "bandit_reward" in log[1] and "bandit_reward" in log[3] and server.bandit.pulls == [1, 1]
    assert log[3]["bandit_period"] == period
    log += [one_round(server, grid, r, (0, 2, 4)) for r in range(4, 6)]
    assert [m["sync"] for m in log[4:]] == ([1.0, 1.0] if period == 1 else [0.0, 1.0])
    assert set(grid.sent[-1]) == set(range(6))  # a sync round ends with the global prompts sent to every client


def test_global_sync_sends_the_same_prompts_to_every_client(runtime) -> None:
    from promptfcl.federation.protocol import RoundInfo

    params = runtime.params.model_copy(update={"scheduler": "fixed", "sync_period": 1})
    server, client = runtime.spec.programs(runtime.env, params)
    grid = RecordingGrid.make(runtime, client)
    info = RoundInfo(0, 0, (1, 4, 5))
    grid.start_round(info)
    metrics = server.run_round(grid, info)
    assert metrics["sync"] == 1.0
    updates = grid.sent[-1]
    assert set(updates) == set(range(6))  # non-participants too
    state = server.model.get_state()
    for m in updates.values():
        assert all(torch.equal(m.tensors["model/" + k], v) for k, v in state.items())


# ---------------------------------------------------------------------------------------------- bandit


def test_bandit_values_follow_the_update_rule() -> None:
    b = BanditScheduler([1, 2, 4], c=0.5, eps=1e-6)
    assert [b.select() for _ in range(1)] == [0]  # untried arms first, in order
    rewards = [0.3, 0.1, 0.5]
    v = 0.0
    for n, r in enumerate(rewards, start=1):
        b.update(1, r)
        v = v + (1 / n) * (r - v)  # Eq. 7 with η = 1/N: the running mean
        assert b.values[1] == pytest.approx(v)
    assert b.values[1] == pytest.approx(np.mean(rewards)) and b.pulls == [0, 3, 0]
    const = BanditScheduler([1, 2], eta=0.25)
    const.update(0, 1.0)
    const.update(0, 0.0)
    assert const.values[0] == pytest.approx(0.25 * 1.0 * 0.75)
    b.update(0, 0.2)
    b.update(2, 0.4)
    total = 5
    expected = [
        b.values[a] / (b.pulls[a] + 1e-6) + 0.5 * math.sqrt(math.log(total) / (b.pulls[a] + 1e-6)) for a in range(3)
    ]
    assert [b.score(a) for a in range(3)] == pytest.approx(expected)
    assert b.select() == int(np.argmax(expected))
    restored = BanditScheduler([1, 2, 4])
    restored.load_dict(b.to_dict())
    assert restored.values == b.values and restored.pulls == b.pulls


# ------------------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_capt_runs_end_to_end_and_its_state_round_trips(tmp_path) -> None:
    from promptfcl.experiment import Experiment

    cfg = build_config(tiny_lt_raw(method={"arms": [1, 2]}))
    exp = Experiment(cfg, tmp_path / "run", show_progress=False)
    metrics = exp.run()
    groups = metrics["summary"]["class_groups"]
    assert set(groups) == {"overall", "head", "mid", "tail"}
    assert groups["overall"] == pytest.approx(metrics["summary"]["sample_weighted_accuracy"])
    state = exp.server.state()
    server2, _ = exp.runtime.programs()
    server2.load_state(state)
    again = server2.state()
    assert again.scalars == state.scalars
    assert state.tensors.keys() == again.tensors.keys()
    assert all(torch.equal(state.tensors[k], again.tensors[k]) for k in state.tensors)
    resumed = Experiment.from_run_dir(tmp_path / "run", show_progress=False)
    assert resumed.run(resume=True)["summary"] == metrics["summary"]  # nothing left to run: same result


BASELINE_PARTS = {  # what each CLIP baseline learns (and so uploads and averages)
    "promptfl": {"ctx"},
    "maple_fedavg": {"ctx", "deep_ctx", "coupling.0.weight", "coupling.0.bias", "coupling.1.weight", "coupling.1.bias"},
    "cocoop_fedavg": {"ctx", "meta_net.0.weight", "meta_net.0.bias", "meta_net.2.weight", "meta_net.2.bias"},
    "fedclip": {"adapter.0.weight", "adapter.0.bias", "adapter.2.weight", "adapter.2.bias"},
    "clip_zeroshot": set(),
}


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(BASELINE_PARTS))
def test_clip_baselines_train_their_own_part_and_average_it_by_samples(method) -> None:
    """Each baseline learns exactly its paper's part (PromptFL: one context for all classes; MaPLe: deep text
    prompts + coupling; CoCoOp: context + meta-net; FedCLIP: the adapter), every part moves in local training,
    and the server's model is the sample-weighted mean of the uploads; zero-shot contacts no client and scores
    CLIP's cosine with "a photo of a {class}."."""
    import torch.nn.functional as F

    from promptfcl.runtime import Runtime

    extra = {"depth": 2 if method == "maple_fedavg" else 1}
    raw = tiny_lt_raw(method={"name": method, "lr": 0.05, "batch_size": 16, **extra})
    rt = Runtime.build(build_config(raw))
    server, client = rt.programs()
    grid = RecordingGrid.make(rt, client)
    before = server.global_model().get_state()
    assert set(before) == BASELINE_PARTS[method]
    one_round(server, grid, 0, (0, 2, 4))
    after = server.global_model().get_state()
    if method == "clip_zeroshot":
        assert not grid.sent
        model, clip = server.global_model(), rt.env.backbone
        x = torch.rand(3, 3, 32, 32)
        tokens = clip.tokenize([f"a photo of a {n.replace('_', ' ')}." for n in rt.env.class_names])
        text = F.normalize(clip.encode_text(clip.token_embeddings(tokens), tokens), dim=-1)
        image = F.normalize(clip.encode_image(x), dim=-1)
        assert torch.allclose(model(x), clip.logit_scale * image @ text.t(), atol=1e-4)
        return
    replies = train_replies(grid)
    n = torch.tensor([float(r.scalars["num_samples"]) for r in replies.values()])
    assert len(set(n.tolist())) > 1  # unequal clients: a uniform mean would differ
    for k in before:
        assert not torch.equal(after[k], before[k]), k  # the part learns
        mean = sum(w * r.tensors[k].double() for w, r in zip(n / n.sum(), replies.values(), strict=True))
        assert torch.allclose(after[k].double(), mean, atol=1e-6), k


@pytest.mark.slow
def test_capt_resume_mid_run_equals_uninterrupted_run(tmp_path) -> None:
    """Server state (bandit, counts, clusters' inputs) and client states (cluster prompts) checkpoint exactly."""
    from promptfcl.experiment import Experiment

    raw = tiny_lt_raw(method={"arms": [1, 2]}, scenario={"rounds_per_task": 4})
    reference = Experiment(build_config(raw), tmp_path / "ref", show_progress=False).run()

    resumed = interrupted_then_resumed(build_config(raw), tmp_path / "cut", rounds=2)
    strip = lambda m: {k: v for k, v in m.items() if k != "timing"}  # noqa: E731
    assert strip(resumed) == strip(reference)


@pytest.mark.slow
def test_continual_extension_runs_class_incremental_and_is_refused_without_the_flag(tmp_path) -> None:
    from promptfcl.config import ConfigError
    from promptfcl.experiment import Experiment

    from .conftest import tiny_raw

    raw = tiny_raw(scenario={"rounds_per_task": 2})
    raw["backbone"] = tiny_lt_raw()["backbone"]
    raw["method"] = {"name": "capt", "depth": 2, "lr": 0.05, "batch_size": 16, "arms": [1, 2]}
    with pytest.raises(ConfigError, match="continual"):
        Experiment(build_config(raw), tmp_path / "refused", show_progress=False).run()
    raw["method"]["continual"] = True
    exp = Experiment(build_config(raw), tmp_path / "ci", show_progress=False)
    metrics = exp.run()
    assert len(metrics["accuracy_matrix"]) == 2 and exp.server.counts_task == 1
    new_classes = exp.scenario.label_space.tasks[1].logits
    assert exp.server.counts[:, list(new_classes)].sum() > 0  # π of task 1 comes from task 1's counts
    old = list(exp.scenario.label_space.tasks[0].logits)
    assert exp.server.counts[:, old].sum() == 0


def test_the_prompt_free_pass_of_a_clip_model_is_zero_shot_clip(runtime) -> None:
    """Inside `prompts_disabled()` a prompted ClipClassifier predicts exactly as zero-shot CLIP (template texts,
    prompt-free image features): the validity gate's prompt benefit is then what the learned prompts add."""
    import torch.nn.functional as F

    model, clip = runtime.programs()[0].global_model(), runtime.env.backbone
    assert model.prompted
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # prompts away from their init, so with and without differ
    x = torch.rand(4, 3, 32, 32)
    tokens = clip.tokenize([f"a photo of a {n.replace('_', ' ')}." for n in runtime.env.class_names])
    text = F.normalize(clip.encode_text(clip.token_embeddings(tokens), tokens), dim=-1)
    zero_shot = clip.logit_scale * F.normalize(clip.encode_image(x), dim=-1) @ text.t()
    with torch.no_grad(), clip.prompts_disabled():
        assert torch.allclose(model(x), zero_shot, atol=1e-4)
    assert not torch.allclose(model(x), zero_shot, atol=1e-3)


def test_cluster_gain_is_one_for_identical_groups_and_near_zero_for_random_ones() -> None:
    from promptfcl.methods.capt.clustering import cluster_gain

    d = normalise(np.array([[9, 1, 0], [9, 1, 0], [0, 1, 9], [0, 1, 9], [5, 0, 5], [5, 0, 5]], dtype=float))
    dist = pairwise_distance(d, "js")
    assert cluster_gain(dist, np.array([0, 0, 1, 1, 2, 2])) == pytest.approx(1.0)
    assert cluster_gain(dist, np.array([0, 1, 2, 0, 1, 2])) < 0  # grouping unlike clients: worse than chance
    assert cluster_gain(dist, np.array([0, 1, 2, 3, 4, 5])) is None  # no cluster holds two clients


def test_capt_signals_fail_with_clustering_off_or_idle() -> None:
    from promptfcl.evaluation.validity import RunEvidence
    from promptfcl.methods.capt.signals import check_clustering, clustering_on

    on = RunEvidence({"method": {"clustering": True}}, [{"sim_cluster_gain": 0.4}, {"sim_cluster_gain": 0.3}])
    assert check_clustering(on).passed and clustering_on(on).passed
    assert not check_clustering(RunEvidence({"method": {"clustering": True}}, [{"sim_cluster_gain": 0.01}])).passed
    off = RunEvidence({"method": {"clustering": False}}, [])
    assert not clustering_on(off).passed and check_clustering(off) is None


@pytest.mark.slow
def test_capt_run_without_clustering_fails_its_own_check(tmp_path) -> None:
    """The CLIP family's defining mechanism switched off (`clustering: false`: FedAvg of every part every round)
    is flagged by the gate, through the check CAPT declares."""
    from promptfcl.evaluation.validity import failed_checks
    from promptfcl.experiment import Experiment

    off = Experiment(build_config(tiny_lt_raw(method={"clustering": False})), tmp_path / "off", show_progress=False)
    assert "clustering_on" in failed_checks(off.run()["validity"])
