"""Per-client image domains (`scenario.domains`) and clients that never share a training image
(`slice_rule: disjoint`): the scenario C2Prompt's LCDC has something to fix in."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from pydantic import ValidationError

from promptfcl.config import ConfigError, DomainsConfig, EvalConfig, ScenarioConfig, build_config
from promptfcl.data.domains import ImageDomain, draw_domains, keyed_normal
from promptfcl.data.loader import LabeledSubset
from promptfcl.data.transforms import ImageTransform
from promptfcl.evaluation.regimes import SlotEvaluator, SlotRegime
from promptfcl.experiment import Experiment
from promptfcl.federation.inprocess import run_client
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext, ClientProgram
from promptfcl.report.comparison import scenario_label
from promptfcl.runtime import Runtime
from promptfcl.scenario import Scenario, build_scenario
from promptfcl.scenario.partition import PartitionError
from promptfcl.statistics.client_gap import client_class_features, client_class_gap

from .conftest import TINY, deep_update

CIFAR_LIKE = np.repeat(np.arange(100), 100)


def async_cfg(**asynchronous) -> ScenarioConfig:
    """The CPU C2Prompt scenario's shape: 5 clients × 5 tasks of 10 classes out of 100, 1/5 slices."""
    return ScenarioConfig(
        kind="asynchronous", num_tasks=5, classes_per_task=10, num_clients=5, rounds_per_task=3,
        asynchronous={"min_overlap": 0, "data_slices": 5, **asynchronous},
    )  # fmt: skip


def client_images(s: Scenario) -> list[set[int]]:
    """[client] → every training image it trains on over the run (its scheduled tasks)."""
    out: list[set[int]] = [set() for _ in range(s.num_clients)]
    for stage, row in enumerate(s.schedule or []):
        for k in range(len(row)):
            out[k] |= set(s.client_train[stage][k].tolist())
    return out


def images_shared_by_two_clients(s: Scenario) -> int:
    imgs = client_images(s)
    return sum(len(imgs[a] & imgs[b]) for a in range(len(imgs)) for b in range(a + 1, len(imgs)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_distinct_slices_still_let_two_clients_share_images_disjoint_never(seed: int) -> None:
    """`distinct` cycles once a class occurs more than `data_slices` times (here up to 13), so a cycled slice can be
    another client's: images are shared. `disjoint` reuses only the client's own slices: none shared, and every
    class repeat still sees fresh images while the class has unused slices."""
    distinct = build_scenario(async_cfg(slice_rule="distinct"), CIFAR_LIKE, CIFAR_LIKE, 100, seed)
    assert images_shared_by_two_clients(distinct) > 0
    disjoint = build_scenario(async_cfg(slice_rule="disjoint"), CIFAR_LIKE, CIFAR_LIKE, 100, seed)
    assert disjoint.task_classes == distinct.task_classes and disjoint.schedule == distinct.schedule
    assert images_shared_by_two_clients(disjoint) == 0
    # each (client, task) still holds 1/5 of every class of the task: 20 of 100 images per class
    for stage, row in enumerate(disjoint.schedule or []):
        for k, g in enumerate(row):
            idx = disjoint.client_train[stage][k]
            counts = np.bincount(CIFAR_LIKE[idx], minlength=100)
            assert sorted(np.flatnonzero(counts).tolist()) == sorted(disjoint.task_classes[g])
            assert set(counts[counts > 0].tolist()) == {20}
    # a class occurring at most data_slices times gets the same (all fresh) slices under both rules
    occurrences: dict[int, int] = {}
    for t in distinct.task_classes:
        for c in t:
            occurrences[c] = occurrences.get(c, 0) + 1
    compared = 0
    for stage, row in enumerate(distinct.schedule or []):
        for k in range(len(row)):
            a, b = distinct.client_train[stage][k], disjoint.client_train[stage][k]
            for c in set(CIFAR_LIKE[a].tolist()):
                if occurrences[c] <= 5:
                    assert set(a[CIFAR_LIKE[a] == c].tolist()) == set(b[CIFAR_LIKE[b] == c].tolist())
                    compared += 1
    assert compared > 10


def test_disjoint_refuses_more_clients_per_class_than_slices() -> None:
    cfg = ScenarioConfig(
        kind="asynchronous", num_tasks=2, classes_per_task=10, num_clients=6, rounds_per_task=1,
        asynchronous={"min_overlap": 10, "data_slices": 2, "slice_rule": "disjoint"},
    )  # fmt: skip
    with pytest.raises(PartitionError, match="raise scenario.asynchronous.data_slices"):
        build_scenario(cfg, CIFAR_LIKE, CIFAR_LIKE, 100, 0)


# ------------------------------------------------------------------------------------------ the transforms


def test_domains_are_fixed_deterministic_and_distinct_per_client() -> None:
    """Each client's domain is drawn from (seed, client): the same on every call and every rebuild, different between
    clients and seeds; an image's domain-shifted version depends on the image alone (not on its batch), so the
    content-addressed caches hit and a resumed run sees the same inputs; the steps do what they say."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (12, 3, 16, 16), generator=gen, dtype=torch.uint8)
    doms = draw_domains(DomainsConfig(clients="mixed"), 5, seed=0)
    assert [d.name for d in doms] == ["colour", "blur", "noise", "colour+blur", "colour+noise"]
    assert doms == draw_domains(DomainsConfig(clients="mixed"), 5, seed=0)
    assert doms != draw_domains(DomainsConfig(clients="mixed"), 5, seed=1)
    outs = [d(x) for d in doms]
    for d, y in zip(doms, outs, strict=True):
        assert y.dtype == torch.uint8 and y.shape == x.shape
        assert torch.equal(d(x), y)  # fixed
        assert torch.equal(d(x[3:7]), y[3:7])  # per image, whatever the batch
        assert (y.float() - x.float()).abs().mean() > 5  # it changes the images
    for a in range(5):
        for b in range(a + 1, 5):
            assert (outs[a].float() - outs[b].float()).abs().mean() > 5
    # same kind, other client: other parameters, other images (noise: another pattern)
    two_noise = draw_domains(DomainsConfig(clients=["noise", "noise"]), 2, seed=0)
    assert two_noise[0].noise_seed != two_noise[1].noise_seed
    assert not torch.equal(two_noise[0](x), two_noise[1](x))
    assert torch.equal(ImageDomain()(x), x)  # none: the identity
    grey = torch.full((2, 3, 8, 8), 100, dtype=torch.uint8)
    assert torch.equal(ImageDomain(("colour",), hue_degrees=123.0)(grey), grey)  # hue rotation keeps grey grey
    assert torch.equal(ImageDomain(("blur",), blur_sigma=0.2)(grey), grey)  # blur keeps a flat image flat
    z = keyed_normal(torch.randint(0, 256, (64, 3, 16, 16), generator=gen, dtype=torch.uint8), seed=5)
    assert abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1) < 0.02  # the noise is standard normal
    assert ImageDomain.from_json(doms[4].to_json()) == doms[4]


def test_domain_config_is_validated_up_front() -> None:
    ok = {"kind": "asynchronous", "num_tasks": 2, "classes_per_task": 4, "num_clients": 3}
    with pytest.raises(ValidationError, match="lists 2 domains but num_clients is 3"):
        ScenarioConfig(**ok, domains={"clients": ["colour", "blur"]})
    with pytest.raises(ValidationError, match="did you mean 'colour'"):
        ScenarioConfig(**ok, domains={"clients": ["color", "blur", "none"]})
    with pytest.raises(ValidationError, match="defined on asynchronous scenarios"):
        ScenarioConfig(**{**ok, "kind": "class_incremental"}, domains={"clients": "mixed"})
    with pytest.raises(ValidationError, match="0 ≤ low ≤ high"):
        ScenarioConfig(**ok, domains={"clients": "mixed", "noise_std": [0.2, 0.1]})
    assert ScenarioConfig(**ok, domains={"clients": ["colour+noise", "none", "blur"]}).domains is not None


def test_a_probe_cell_refuses_a_scenario_with_domains(tmp_path: Path) -> None:
    """The frozen probe pools every client's images, which per-client domains make ill-defined: a clear error."""
    from promptfcl.frozen_probe import probe_run

    with pytest.raises(ConfigError, match="drop probe: true"):
        probe_run(build_config(deep_update(TINY, DOMAIN_RUN)), tmp_path / "probe")


# ------------------------------------------------------------------------------------------ where they are applied

DOMAIN_RUN = {
    "data": {"options": {"num_classes": 12, "train_per_class": 24, "test_per_class": 6}},
    "scenario": {
        "kind": "asynchronous",
        "num_tasks": 2,
        "num_clients": 3,
        "classes_per_task": 4,
        "rounds_per_task": 2,
        "asynchronous": {"data_slices": 3, "slice_rule": "disjoint", "min_overlap": 2},
        "domains": {"clients": ["colour", "none", "blur+noise"]},
    },
    "method": {"name": "fedcodap", "pool_size": 4, "layers": [0, 1], "length": 2, "local_epochs": 1, "batch_size": 8},
}


def domain_runtime(on: bool = True) -> Runtime:
    raw = deep_update(TINY, DOMAIN_RUN)
    if not on:
        raw["scenario"].pop("domains")
    return Runtime.build(build_config(raw))


class ImageProbe(ClientProgram):
    """Replies with the (transformed) images its training data yields, in order, and their indices."""

    def handle(self, message: Message, ctx: ClientContext) -> Message:
        x = torch.cat([x for x, _ in ctx.train_data.batches(64, self.env.eval_transform)])
        return Message({"x": x, "idx": ctx.train_data.indices.clone()}, kind="probe_reply")


def seen_by(rt: Runtime, client: int, stage: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    msg = Message({}, {"task": stage, "round": 0}, kind="train")
    reply = run_client(ImageProbe(rt.env, None), msg, client, Record(), rt.scenario, rt.dataset.train, 0, rt.device)
    return reply.tensors["x"], reply.tensors["idx"]


def test_each_client_trains_on_its_images_in_its_own_domain() -> None:
    """`run_client` (every engine's client step) hands a client its training images through its own domain: what it
    sees equals eval_transform(its domain(stored images)), differs from the stored images and from any other
    client's domain; client 1 (`none`) and every client of a run without domains see the stored images."""
    rt, off = domain_runtime(), domain_runtime(on=False)
    doms = rt.scenario.domains
    assert [d.name for d in doms] == ["colour", "none", "blur+noise"] and off.scenario.domains is None
    tf, images = rt.env.eval_transform, rt.dataset.train.images
    for stage in range(2):
        for k in range(3):
            x, idx = seen_by(rt, k, stage)
            raw = images[idx]
            assert torch.equal(x, tf(doms[k](raw)))
            if doms[k].steps:
                assert not torch.allclose(x, tf(raw), atol=0.05)
            for other in range(3):
                if doms[other] != doms[k]:
                    assert not torch.allclose(x, tf(doms[other](raw)), atol=0.05)
            x_off, idx_off = seen_by(off, k, stage)
            assert torch.equal(idx_off, idx) and torch.equal(x_off, tf(raw))  # off: the same images, as stored


class LookupModel(torch.nn.Module):
    """Answers correctly exactly the inputs it was taught (a test image of a label-space task, seen in a given
    domain); any other input gets all-zero logits (the first slot)."""

    def __init__(self, num_logits: int) -> None:
        super().__init__()
        self.num_logits = num_logits
        self.answers: dict[bytes, set[int]] = {}
        self.calls = 0

    def teach(self, x: torch.Tensor, logits: torch.Tensor) -> None:
        for row, j in zip(x, logits.tolist(), strict=True):
            self.answers.setdefault(row.numpy().tobytes(), set()).add(j)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = torch.zeros(len(x), self.num_logits)
        for i, row in enumerate(x):
            for j in self.answers.get(row.numpy().tobytes(), ()):
                out[i, j] = 1.0
        return out


def taught_model(rt: Runtime, with_domains: bool, only: int | None = None) -> LookupModel:
    """A model that is right on every (client, task)'s test images (or label-space task `only`'s) iff they are
    seen in its client's domain (`with_domains`) or as stored."""
    s, test, space = rt.scenario, rt.dataset.test, rt.scenario.label_space
    model = LookupModel(space.num_logits)
    for g, idx in enumerate(s.test_indices):
        if only is not None and g != only:
            continue
        domain = s.client_domain(s.owners[g][0]) if with_domains else None
        raw = test.images[idx]
        model.teach(
            rt.env.eval_transform(domain(raw) if domain else raw), space.task_class_to_logit(g)[test.targets[idx]]
        )
    return model


def slot_accuracy(rt: Runtime, models: dict[int, torch.nn.Module]) -> dict[int, float]:
    ev = SlotEvaluator(rt.dataset.test, rt.scenario, rt.env.eval_transform, 16, rt.device)
    served: dict[int, tuple[torch.nn.Module, list[int]]] = {}  # each model with the tasks it serves
    for g, m in models.items():
        served.setdefault(id(m), (m, []))[1].append(g)
    return {r["label_task"]: r["accuracy"] for m, tasks in served.values() for r in ev.evaluate(m, tasks)}


@pytest.mark.parametrize("per_client", [False, True])
def test_each_client_task_is_evaluated_in_its_owner_clients_domain(per_client: bool) -> None:
    """The task-aware evaluation shows every (client, task)'s test images in its own client's domain — with one
    global model for all (the images of a class several clients hold are then fed once per domain) or one model per
    client (CPA) — and as stored when domains are off. A model that knows the test images only in the right domain
    scores 100 % everywhere; one that knows them only as stored fails the domain-shifted clients."""
    rt, off = domain_runtime(), domain_runtime(on=False)
    owners = rt.scenario.owners

    def models(model_of) -> dict[int, torch.nn.Module]:  # noqa: ANN001
        return {g: model_of(owners[g][0]) for g in range(len(owners))}

    right, stored = taught_model(rt, True), taught_model(rt, False)
    if per_client:
        by_client = {k: taught_model(rt, True) for k in range(3)}
        acc = slot_accuracy(rt, models(lambda k: by_client[k]))
    else:
        acc = slot_accuracy(rt, models(lambda k: right))
    assert set(acc.values()) == {100.0}
    wrong = slot_accuracy(rt, models(lambda k: stored))
    for g, a in wrong.items():
        if rt.scenario.client_domain(owners[g][0]) is None:
            assert a == 100.0  # client 1: domain none
        else:
            assert a < 60.0, (g, a)  # chance is 25 % (4 slots)
    assert set(slot_accuracy(off, models(lambda k: taught_model(off, False))).values()) == {100.0}
    ev = SlotEvaluator(rt.dataset.test, rt.scenario, rt.env.eval_transform, 16, rt.device)
    for g in range(len(owners)):  # the prompt-effect batches too
        x = torch.cat([x for x, _, _ in ev.task_batches(g)])
        domain = rt.scenario.client_domain(owners[g][0])
        raw = rt.dataset.test.images[rt.scenario.test_indices[g]]
        assert torch.equal(x, rt.env.eval_transform(domain(raw) if domain else raw))


class SwitchingModel(torch.nn.Module):
    """One object that answers as the model of whichever task it was last set to (a server reusing one model)."""

    def __init__(self, models: dict[int, LookupModel]) -> None:
        super().__init__()
        self.models, self.current = models, -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.models[self.current](x)


@pytest.mark.parametrize("key", ["task", "client"])
def test_task_aware_evaluation_tests_each_served_model_before_asking_for_the_next(key: str) -> None:
    """A server may serve every (client, task) model through one reused object (Powder, C2Prompt's CPA, the direct
    reference: memory flat in clients): the evaluation asks for each `model_key` once and tests all its tasks
    before asking for the next. Each task's model is right only on its own task's images, so testing a task with
    another's (e.g. asking for all models first) fails it; `scored_model` follows the keys."""
    rt = domain_runtime()
    s = rt.scenario
    owners = s.owners

    class OneObjectServer:
        def __init__(self) -> None:
            if key == "task":
                per = {g: taught_model(rt, True, only=g) for g in range(len(owners))}
            else:  # one model per client: right on all its tasks
                per = {}
                for g in range(len(owners)):
                    per.setdefault(owners[g][0], LookupModel(s.label_space.num_logits))
                    for x, logits in taught_model(rt, True, only=g).answers.items():
                        per[owners[g][0]].answers.setdefault(x, set()).update(logits)
            self.model, self.asked = SwitchingModel(per), []

        def model_key(self, client: int, label_task: int) -> int:
            return label_task if key == "task" else client

        def client_model(self, client: int, label_task: int | None = None) -> torch.nn.Module:
            k = self.model_key(client, label_task)
            self.asked.append(k)
            self.model.current = k
            return self.model

    server = OneObjectServer()
    regime = SlotRegime(SlotEvaluator(rt.dataset.test, s, rt.env.eval_transform, 16, rt.device), EvalConfig())
    state: dict = {}
    regime.init_state(state)
    out = regime.evaluate(server, s.num_tasks - 1, 0, True, state)  # type: ignore[arg-type]
    trained = s.trained_label_tasks(s.num_tasks - 1)
    assert sorted(map(int, out["accuracy"])) == trained and set(out["accuracy"].values()) == {100.0}
    assert sorted(server.asked) == sorted({server.model_key(owners[g][0], g) for g in trained})
    assert state["scored_model"] == key


def test_c2prompt_uploads_the_class_statistics_of_its_domain_shifted_images() -> None:
    """Methods need no change: C2Prompt's round-0 statistics of q(x) are computed on the client's images in its own
    domain (and LCDC's diagnostic subset keeps the domain)."""
    raw = deep_update(TINY, {**DOMAIN_RUN, "method": {**DOMAIN_RUN["method"], "name": "c2prompt"}})
    raw["method"].pop("pool_size")
    raw["method"]["components_per_stage"] = 2
    rt = Runtime.build(build_config(raw))
    _, client = rt.programs()
    tf, train, query = rt.env.eval_transform, rt.dataset.train, rt.env.backbone.query
    msg = Message({}, {"task": 0, "round": 0}, kind="stats")
    for k in range(3):
        reply = run_client(client, msg, k, Record(), rt.scenario, train, 0, rt.device)
        idx = torch.as_tensor(rt.scenario.client_indices(0, k))
        domain = rt.scenario.client_domain(k)
        feats = query(tf(domain(train.images[idx]) if domain else train.images[idx]))
        plain = query(tf(train.images[idx]))
        for i, c in enumerate(reply.tensors["stats/classes"].tolist()):
            sel = train.targets[idx] == c
            assert torch.allclose(reply.tensors["stats/means"][i], feats[sel].mean(0), atol=1e-5), (
                f"client {k} class {c}"
            )
            if domain is not None:
                assert not torch.allclose(reply.tensors["stats/means"][i], plain[sel].mean(0), atol=1e-3)
    sub = LabeledSubset.of(train, np.arange(10), torch.arange(12), rt.scenario.client_domain(0))
    assert sub.head(4).domain == sub.domain and len(sub.head(4)) == 4


# ------------------------------------------------------------------------------------------ the gap they open


def test_client_gap_is_at_its_sampling_floor_for_one_distribution_and_grows_with_a_shift() -> None:
    """The gap ‖μ_a − μ_b‖ / s of two samples of one Gaussian averages its floor √(1/n_a + 1/n_b); a shift of the
    whole class by δ·(within-class RMS spread) for one client raises it to ≈ δ."""
    gen = torch.Generator().manual_seed(0)
    n, d, classes = 20, 16, 200
    y = torch.arange(classes).repeat_interleave(2 * n)
    k = torch.tensor([0] * n + [1] * n).repeat(classes)
    centres = 3 * torch.randn(classes, d, generator=gen)
    f = centres[y] + torch.randn(len(y), d, generator=gen)
    same = client_class_gap(f, y, k)
    assert same.pairs == classes and same.samples == 2 * n * classes
    assert abs(same.floor - (2 / n) ** 0.5) < 1e-12
    assert abs(same.gap / same.floor - 1) < 0.06, same.as_dict()
    assert same.between_class > 2  # different classes are far apart at this scale
    shift = torch.zeros(d)
    shift[0] = 2.0 * d**0.5  # 2 within-class RMS spreads (tr Σ = d)
    shifted = client_class_gap(f + (k == 1).float()[:, None] * shift, y, k)
    assert abs(shifted.gap - 2.0) < 0.1, shifted.as_dict()


def test_client_domains_open_a_cross_client_class_gap_in_the_frozen_features() -> None:
    """On synthetic images and the tiny frozen ViT, the unprompted features of a class held by two clients lie at the
    sampling floor apart without domains, and many within-class spreads apart with `clients: mixed` — the same
    images (disjoint slices), only seen through each client's domain."""
    raw = deep_update(TINY, DOMAIN_RUN)
    raw["data"]["options"]["train_per_class"] = 60
    raw["scenario"]["domains"] = {"clients": "mixed"}
    rt = Runtime.build(build_config(raw))
    args = (rt.env.backbone.query, rt.scenario, rt.dataset.train, rt.env.eval_transform, rt.device)
    on = client_class_gap(*client_class_features(*args))
    off = client_class_gap(*client_class_features(*args, domains=False))
    assert on.pairs == off.pairs >= 3 and on.samples == off.samples
    assert off.gap < 1.5 * off.floor, off.as_dict()
    assert on.gap > 10 * on.floor, on.as_dict()


# ------------------------------------------------------------------------------------------ a run, its files, reports


def test_a_c2prompt_run_with_domains_records_them_and_reports_show_them(tmp_path: Path) -> None:
    """End to end: scenario.json keeps every client's domain with its parameters (a reloaded scenario — resume,
    Flower nodes — has the same domains), metrics.json and report.md list them, the comparison set-up line names
    them and the disjoint slices."""
    raw = deep_update(TINY, {**DOMAIN_RUN, "method": {**DOMAIN_RUN["method"], "name": "c2prompt"}})
    raw["method"].pop("pool_size")
    raw["method"]["components_per_stage"] = 2
    exp = Experiment(build_config(raw), tmp_path / "run", show_progress=False)
    m = exp.run()
    saved = json.loads((tmp_path / "run" / "scenario.json").read_text())
    assert [d["steps"] for d in saved["client_domains"]] == [["colour"], [], ["blur", "noise"]]
    assert Scenario.load(tmp_path / "run" / "scenario.json").domains == exp.scenario.domains
    assert m["client_domains"][1] == "none" and m["client_domains"][2].startswith("blur σ=")
    assert "| client image domains | colour " in (tmp_path / "run" / "report.md").read_text()
    label = scenario_label(yaml.safe_load((tmp_path / "run" / "config.yaml").read_text()))
    assert label.endswith("no image shared by two clients), per-client image domains: colour / none / blur+noise, "
                          "2 rounds/task")  # fmt: skip


@pytest.mark.assets
def test_the_cifar100_domains_preset_gives_every_client_its_own_domain_and_images(assets_dir, monkeypatch) -> None:
    """configs/cpu/c2prompt_cifar100_domains.yaml on the real CIFAR-100: five different domains, no training image
    used by two clients, every (client, task) tested in its owner's domain (the scenario only: nothing is trained)."""
    from promptfcl.config import load_config
    from promptfcl.runtime import load_dataset

    monkeypatch.setenv("PROMPTFCL_ASSETS", str(assets_dir))
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "cpu" / "c2prompt_cifar100_domains.yaml")
    ds = load_dataset(cfg)
    s = build_scenario(cfg.scenario, ds.train.targets.numpy(), ds.test.targets.numpy(), 100, cfg.seed)
    assert s.domains is not None and len(set(s.domains)) == 5 and all(d.steps for d in s.domains)
    assert images_shared_by_two_clients(s) == 0
    ev = SlotEvaluator(ds.test, s, ImageTransform(112), 64, torch.device("cpu"))
    assert all(ev.domain(g) == s.domains[s.owners[g][0]] for g in range(len(s.task_classes)))
