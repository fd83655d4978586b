"""HGP, CCVR and FedProto: the behaviour that defines each, on small synthetic federations."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from promptfcl.data.loader import LabeledSubset
from promptfcl.experiment import Experiment
from promptfcl.federation.message import Message
from promptfcl.methods.fedproto import PrototypeClassifier
from promptfcl.runtime import Runtime
from promptfcl.scenario.label_space import masked_logits
from promptfcl.seeding import torch_generator
from promptfcl.statistics import ClassStatistics, GaussianComponents, pooled

from .conftest import RecordingGrid, tiny_config

pytestmark = pytest.mark.slow

SKEWED = {
    "data": {
        "options": {"num_classes": 12, "train_per_class": 40, "test_per_class": 20, "noise": 0.15, "max_shift": 4}
    },
    "scenario": {"num_tasks": 3, "num_clients": 4, "rounds_per_task": 2, "partition": {"beta": 0.05, "min_samples": 2}},
}


def method(name: str, **kw) -> dict:
    return {"name": name, "length": 4, "layers": [0, 1], "local_epochs": 2, "batch_size": 16, "lr": 0.01, **kw}


def recorded_run(cfg, run_dir, grids: list[RecordingGrid] | None = None) -> tuple[Experiment, list]:
    """Run `cfg` in process and return the experiment and the log of every (task, round, sent, replies); the
    recording grid is appended to `grids` when one is given."""
    grids = [] if grids is None else grids

    def factory(rt: Runtime) -> RecordingGrid:
        grids.append(RecordingGrid(rt.programs()[1], rt.scenario, rt.dataset.train, rt.cfg.seed, rt.device))
        return grids[0]

    exp = Experiment(cfg, run_dir, show_progress=False, grid_factory=factory)
    exp.run()
    return exp, grids[0].log


def prediction_bias(exp: Experiment, model: torch.nn.Module, after_task: int) -> tuple[float, float]:
    """(normalised entropy of the prediction histogram on the balanced test set, accuracy on old tasks)."""
    space = exp.scenario.label_space
    mask = space.eval_mask(0, after_task)
    preds, ys = [], []
    with torch.no_grad():
        for t in range(after_task + 1):
            for x, y in exp.evaluator.subsets[t].batches(64, exp.evaluator.transform):
                preds.append(masked_logits(model(x), mask).argmax(1))
                ys.append(y)
    p, y = torch.cat(preds), torch.cat(ys)
    n = space.seen_logits(after_task)
    q = torch.bincount(p, minlength=n).double() / len(p)
    entropy = float(-(q[q > 0] * q[q > 0].log()).sum() / math.log(n))
    old = y < space.tasks[after_task].logits[0]
    return entropy, float((p[old] == y[old]).double().mean())


def test_rebalancing_removes_the_bias_toward_recent_and_local_classes(tmp_path) -> None:
    """β = 0.05: the FedAvg'd head favours the last task; HGP's rebalancing spreads predictions, lifts old tasks."""
    cfg = tiny_config(**SKEWED, method=method("hgp", rebalance="none"))
    exp = Experiment(cfg, tmp_path / "run", show_progress=False)
    exp.run()
    model = exp.server.global_model()
    ent_before, old_before = prediction_bias(exp, model, 2)
    exp.server.params = exp.server.params.model_copy(update={"rebalance": "all"})
    exp.server.rebalance(2, torch_generator(0, "test"))
    ent_after, old_after = prediction_bias(exp, model, 2)
    assert ent_after > ent_before + 0.2, (ent_before, ent_after)
    assert old_after > old_before + 0.2, (old_before, old_after)


def test_hgp_beats_its_prompt_only_ablation_under_strong_skew(tmp_path) -> None:
    faa = {}
    for rebalance in ("none", "all"):
        cfg = tiny_config(**SKEWED, method=method("hgp", rebalance=rebalance))
        faa[rebalance] = Experiment(cfg, tmp_path / rebalance, show_progress=False).run()["summary"]["faa"]
    assert faa["all"] > faa["none"] + 15, faa


def test_server_receives_only_parameters_and_class_statistics(tmp_path) -> None:
    exp, log = recorded_run(tiny_config(method=method("hgp")), tmp_path / "run")
    params = set(exp.server.model.state_dict())
    d = exp.env.backbone.embed_dim
    targets = exp.dataset.train.targets
    for task, _, _, replies in log:
        for cid, reply in replies.items():
            stats_names = {n for n in reply.tensors if n not in params}
            assert stats_names == {"stats/classes", "stats/counts", "stats/means", "stats/spread"}
            assert set(reply.scalars) == {"num_samples", "loss", "last_loss", "last_total", "chance_loss", "prior_loss"}
            s = ClassStatistics.from_tensors(reply.tensors)
            # exactly the client's classes with >= 2 samples, their true counts, one d-vector each
            idx = exp.scenario.client_indices(task, cid)
            logits = exp.scenario.label_space.to_logits(targets[torch.as_tensor(idx)])
            classes, counts = torch.unique(logits, return_counts=True)
            assert s.classes.tolist() == classes[counts >= 2].tolist()
            assert s.counts.tolist() == counts[counts >= 2].tolist()
            assert s.means.shape == (len(s), d) and s.spread.shape == (len(s), d)
            assert (s.spread >= 0).all()


def test_rebalance_none_is_fedavg_prompt(tmp_path) -> None:
    a = Experiment(tiny_config(method=method("fedavg_prompt")), tmp_path / "a", show_progress=False).run()
    b = Experiment(tiny_config(method=method("hgp", rebalance="none")), tmp_path / "b", show_progress=False).run()
    assert a["accuracy_matrix"] == b["accuracy_matrix"]


def test_hgp_server_state_round_trips(tmp_path) -> None:
    exp = Experiment(tiny_config(method=method("hgp")), tmp_path / "run", show_progress=False)
    exp.run()
    server2 = exp.runtime.programs()[0]
    server2.load_state(exp.server.state())
    assert len(server2.components) == len(exp.server.components) > 0
    for k, v in exp.server.state().tensors.items():
        assert torch.equal(server2.state().tensors[k], v), k


def test_kept_optimizer_state_lives_in_the_client_state(tmp_path) -> None:
    exp = Experiment(tiny_config(method=method("hgp", optimizer_reset="never")), tmp_path / "k", show_progress=False)
    exp.run()
    names = [n for n in exp.grid.states[0].tensors if n.startswith("optim/")]
    assert any(n.endswith("exp_avg") for n in names)
    steps = [float(v) for n, v in exp.grid.states[0].tensors.items() if n.endswith("/step")]
    assert steps and min(steps) > 2 * 2  # accumulated over several rounds, not reset every round
    reset = Experiment(tiny_config(method=method("hgp")), tmp_path / "r", show_progress=False)
    reset.run()
    assert not any(n.startswith("optim/") for n in reset.grid.states[0].tensors)


def test_ccvr_pools_client_gaussians_into_one_per_class(tmp_path) -> None:
    exp, log = recorded_run(tiny_config(method=method("ccvr", covariance="diag")), tmp_path / "run")
    last_task = exp.scenario.label_space.num_tasks - 1
    replies = [r for t, _, _, rs in log if t == last_task for r in rs.values()][-3:]
    expect = pooled([ClassStatistics.from_tensors(r.tensors) for r in replies])
    comps = exp.server.components
    cur = comps.task == last_task
    assert comps.cls[cur].tolist() == expect.classes.tolist()  # one component per class, not per client
    assert torch.allclose(comps.mean[cur], expect.means) and torch.allclose(comps.spread[cur], expect.spread)


def test_fedproto_prototypes_regularise_and_classify(tmp_path) -> None:
    exp, log = recorded_run(tiny_config(method=method("fedproto")), tmp_path / "run")
    # round 0 of a task carries no prototypes of its classes; round 1 carries the count-weighted means of round 0
    first_rounds = [next(iter(msgs.values())) for _, r, msgs, _ in log if r == 0]
    assert all(len(m.tensors["protos/classes"]) == 0 for m in first_rounds)
    t, r, msgs, _ = log[1]
    sent = next(iter(msgs.values())).tensors
    expect = pooled([ClassStatistics.from_tensors(x.tensors) for x in log[0][3].values()])
    assert sent["protos/classes"].tolist() == expect.classes.tolist()
    assert torch.allclose(sent["protos/means"], expect.means)
    # the round metric says when the regulariser was on: never in a task's first round, in its second
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert [r["proto_reg_classes"] for r in rounds] == [0, 3, 0, 3]  # 3 classes per task
    # the client loss is CE + λ·mean‖f(x) − C̄_y‖² (Eq. 7–8), λ = 1, each sample pulled to its class prototype
    client = exp.client
    ctx_msg = Message(dict(sent), {"task": 0, "round": 1}, kind="train")
    model = client.model
    model.set_state({k: sent[k] for k in model.state_dict()})
    data = exp.runtime.scenario.client_indices(0, 0)
    sub = LabeledSubset.of(exp.dataset.train, data, exp.scenario.label_space.class_to_logit)
    x, y = next(sub.batches(16, exp.env.eval_transform))
    mask = exp.scenario.label_space.train_mask(0, "current_task")
    ctx = SimpleNamespace(device=torch.device("cpu"))
    with torch.no_grad():
        with_proto = client.loss_fn(ctx_msg, ctx)(model, x, y, mask).total  # type: ignore[arg-type,union-attr]
        plain = client.loss_fn(Message({}, {}, kind="train"), ctx)(model, x, y, mask).total  # type: ignore[arg-type,union-attr]
        f = model.features(x)
    proto_of = dict(zip(sent["protos/classes"].tolist(), sent["protos/means"], strict=True))
    reg = sum(float(((f[i] - proto_of[int(y[i])]) ** 2).sum()) for i in range(len(y))) / f.numel()
    assert reg > 1e-3  # the features are not already at their prototypes: the term has something to pull
    assert float(with_proto) == pytest.approx(float(plain) + reg, rel=1e-4)


def test_fedproto_predicts_the_nearest_known_prototype_not_the_head() -> None:
    """§4.3: the label of the closest global prototype, among classes that have one; the head plays no part."""

    class Identity(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(2, 4)
            with torch.no_grad():  # a head that always says class 3
                self.head.weight.zero_()
                self.head.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 9.0]))

        def features(self, x: torch.Tensor) -> torch.Tensor:
            return x

    protos = torch.tensor([[4.0, 0.0], [0.0, 4.0], [0.0, 0.0], [-4.0, 0.0]])
    known = torch.tensor([True, True, False, True])  # class 2 has no prototype (yet)
    x = torch.tensor([[3.0, 0.5], [0.4, 3.0], [0.2, 0.1], [-3.5, -1.0], [0.5, 0.3]])
    # by hand: nearest known prototype of each point (the 3rd and 5th are closest to class 2's unknown one)
    expected = [0, 1, 0, 3, 0]
    pred = PrototypeClassifier(Identity(), protos, known)(x).argmax(1)
    assert pred.tolist() == expected


@pytest.mark.parametrize("ablation", ["current", "old"])
def test_cr_ablations_retrain_only_their_part_of_the_head(tmp_path, ablation: str) -> None:
    """CR_cur / CR_old (HGP Table 4): only the sampled classes' logits compete; the rest keep FedAvg's rows."""
    exp = Experiment(tiny_config(method=method("hgp", rebalance="none")), tmp_path / "run", show_progress=False)
    exp.run()
    head = exp.server.model.head
    before = {"weight": head.weight.detach().clone(), "bias": head.bias.detach().clone()}
    exp.server.params = exp.server.params.model_copy(update={"rebalance": ablation})
    exp.server.rebalance(1, torch_generator(0, "test"))
    current = list(exp.scenario.label_space.tasks[1].logits)
    old = list(exp.scenario.label_space.tasks[0].logits)
    trained, kept = (current, old) if ablation == "current" else (old, current)
    for name, value in before.items():
        after = getattr(head, name).detach()
        assert torch.equal(after[kept], value[kept]), f"a kept {name} row changed"
        # every retrained row is written back, not just some of them
        assert all(not torch.equal(after[j], value[j]) for j in trained), f"a retrained {name} row kept its value"


@pytest.mark.parametrize(
    ("covariance", "scale_full", "inflation"), [("diag", False, 3.0), ("full", False, 1.0), ("full", True, 3.0)]
)
def test_hgp_inflates_diagonal_variances_and_full_covariances_only_when_asked(
    covariance: str, scale_full: bool, inflation: float
) -> None:
    """fed-mammoth samples N(μ, 3·diag σ²) but N(μ, Σ) for full covariances; `scale_full_covariance` is the paper's
    reading (×3 for any covariance). The server's sampler must draw features with exactly that spread."""
    cfg = tiny_config(method=method("hgp", covariance=covariance, scale_full_covariance=scale_full))
    server = Runtime.build(cfg).programs()[0]
    d = server.env.backbone.embed_dim
    a = torch.randn(d, d, generator=torch.Generator().manual_seed(0)) / d**0.5
    cov = a @ a.T + 0.1 * torch.eye(d)
    spread = cov if covariance == "full" else cov.diagonal()
    stats = ClassStatistics(torch.tensor([1]), torch.tensor([50]), torch.zeros(1, d), spread[None])
    server.components = GaussianComponents.empty(d, covariance == "full").replace_task(0, [stats])
    feats, _ = server.sampler(torch.tensor([1])).sample(100_000, torch.Generator().manual_seed(1))
    got = torch.cov(feats.double().T)
    expect = inflation * (cov if covariance == "full" else torch.diag(cov.diagonal())).double()
    err = float((got - expect).abs().max())
    assert torch.allclose(got, expect, atol=0.05 * inflation), f"sampled covariance is {err:.2f} off {inflation}×Σ"


@pytest.mark.parametrize("optimizer", ["sgd_cosine", "local_lr"])
def test_rebalance_optimizer_local_lr_is_sgd_at_the_local_lr_without_a_schedule(optimizer: str, monkeypatch) -> None:
    """`rebalance_optimizer: local_lr` (the later fed-mammoth code): the head is rebalanced by SGD at the clients' lr
    with no schedule (momentum as configured); the paper's `sgd_cosine` anneals the calibration lr 0.01 to 0."""
    cfg = tiny_config(method=method("hgp", rebalance_optimizer=optimizer, lr=0.02))
    server = Runtime.build(cfg).programs()[0]
    d = server.env.backbone.embed_dim
    stats = ClassStatistics(torch.tensor([0, 1]), torch.tensor([20, 20]), torch.randn(2, d), torch.ones(2, d))
    server.components = GaussianComponents.empty(d, False).replace_task(0, [stats])
    lrs: list[tuple[float, float]] = []
    step = torch.optim.SGD.step

    def recording_step(self, *args, **kwargs):  # noqa: ANN001, ANN202
        lrs.append((self.param_groups[0]["lr"], self.param_groups[0]["momentum"]))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", recording_step)
    server.rebalance(0, torch.Generator().manual_seed(0))
    assert len(lrs) == 5 * 2  # 5 epochs × ⌈256·2 / 256⌉ steps
    assert all(m == 0.9 for _, m in lrs)
    if optimizer == "local_lr":
        assert all(lr == 0.02 for lr, _ in lrs)
    else:
        assert lrs[0][0] == 0.01 and all(a[0] > b[0] for a, b in zip(lrs, lrs[1:], strict=False))


@pytest.mark.parametrize("weights", ["counts", "uniform"])
def test_hgp_class_weights_choose_how_often_each_class_is_sampled(weights: str) -> None:
    """`class_weights`: ω_c ∝ the class's clients' sample counts (paper Eq. 6) or uniform (the code's TODO)."""
    server = Runtime.build(tiny_config(method=method("hgp", class_weights=weights))).programs()[0]
    d = server.env.backbone.embed_dim
    stats = ClassStatistics(torch.tensor([0, 1]), torch.tensor([10, 90]), torch.zeros(2, d), torch.ones(2, d))
    server.components = GaussianComponents.empty(d, False).replace_task(0, [stats])
    _, labels = server.sampler(torch.tensor([0, 1])).sample(20_000, torch.Generator().manual_seed(0))
    share = float((labels == 0).double().mean())
    assert share == pytest.approx(0.1 if weights == "counts" else 0.5, abs=0.02)
