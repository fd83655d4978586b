"""PILoRA: the orthogonality term, the prototype re-weighting equation, incremental LoRA, prototype logits."""

from __future__ import annotations

import json
import math

import pytest
import torch

from promptfcl.federation.message import Message
from promptfcl.methods.pilora import PILoRAServer, PrototypeLoRAClassifier
from promptfcl.methods.pilora.incremental_lora import IncrementalQVLoRA, orthogonality_loss
from promptfcl.methods.pilora.prototypes import prototype_reweight
from promptfcl.runtime import Runtime
from promptfcl.statistics import ClassStatistics

from .conftest import tiny_config


def orthonormal_rows(d: int, n: int, seed: int = 0) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed)))
    return q[:, :n].T.contiguous()  # n orthonormal rows of length d


def test_orthogonality_term_is_zero_only_for_orthogonal_subspaces() -> None:
    rows = orthonormal_rows(12, 9)
    old, cur = [rows[0:3], rows[3:6]], rows[6:9]  # three mutually orthogonal rank-3 subspaces
    assert float(orthogonality_loss(cur * 2.5, old)) < 1e-5  # scale does not matter, only the subspaces
    # tilted towards one old subspace and away from the other: the signed overlaps cancel (+0.3 - 0.3), the
    # absolute ones add up to 0.6 (each old A sees a ±0.1·I block)
    tilted = cur + 0.1 * old[1] - 0.1 * old[0]
    assert float(orthogonality_loss(tilted, old)) == pytest.approx(0.6, abs=1e-5)
    assert float(orthogonality_loss(cur, [])) == 0.0
    # only the current A gets gradients: earlier tasks' A are fixed targets
    a_old, a_cur = old[0].clone().requires_grad_(), tilted.clone().requires_grad_()
    orthogonality_loss(a_cur, [a_old]).backward()
    assert a_old.grad is None and a_cur.grad is not None and a_cur.grad.abs().sum() > 0


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    return Runtime.build(tiny_config(method={"name": "pilora", "layers": [0, 1], "rank": 2}))


def test_module_orthogonality_uses_every_previous_task(runtime: Runtime) -> None:
    lora = IncrementalQVLoRA(runtime.env.backbone, 3, [0, 1], rank=2)
    d = runtime.env.backbone.embed_dim
    with torch.no_grad():
        for layer in (0, 1):
            for f, seed in (("aq", 1), ("av", 2)):
                rows = orthonormal_rows(d, 6, seed + layer)
                for t in range(3):
                    lora.factors[lora.key(f, t, layer)].copy_(rows[2 * t : 2 * t + 2])
    lora.set_task(2)
    assert float(lora.orthogonality().detach()) < 1e-5
    with torch.no_grad():  # task 2's A_v in layer 1 leans towards task 0's: the term sees it
        lora.factors[lora.key("av", 2, 1)].add_(0.2 * lora.factors[lora.key("av", 0, 1)])
    assert float(lora.orthogonality().detach()) > 0.1
    lora.set_task(0)
    assert float(lora.orthogonality().detach()) == 0.0  # the first task has nothing to be orthogonal to


def test_client_loss_adds_the_weighted_orthogonality_term() -> None:
    """The client's objective carries ort_weight × the orthogonality term (Eq. of §3.2): with task 1's A leaning
    towards task 0's, the loss at ort_weight 2 exceeds the loss at 0 by exactly twice the term."""
    losses, terms = {}, {}
    for weight in (0.0, 2.0):
        rt = Runtime.build(tiny_config(method={"name": "pilora", "layers": [0, 1], "rank": 2, "ort_weight": weight}))
        server, client = rt.programs()
        model = server.model
        model.prompt.set_task(1)
        with torch.no_grad():
            model.prompt.factors[model.prompt.key("av", 1, 0)].add_(
                0.5 * model.prompt.factors[model.prompt.key("av", 0, 0)]
            )
        x = rt.env.eval_transform(rt.dataset.train.images[:4])
        y, mask = torch.tensor([0, 1, 0, 1]), torch.ones(rt.env.label_space.num_logits, dtype=torch.bool)
        losses[weight] = float(client.loss_fn(None, None)(model, x, y, mask).detach())
        terms[weight] = float(model.prompt.orthogonality().detach())
    assert terms[0.0] == terms[2.0] > 0.01
    assert losses[2.0] - losses[0.0] == pytest.approx(2.0 * terms[0.0], rel=1e-4)


def expected_reweight(protos: list[list[float]], feats: list[list[float]], tau: float) -> list[float]:
    """The paper's equation, written out independently: s_k = 1/Σ_j ‖m_k − f_j‖, min-max, softmax(·/τ)."""
    s = [1.0 / sum(math.dist(m, f) for f in feats) for m in protos]
    lo, hi = min(s), max(s)
    z = [math.exp((v - lo) / (hi - lo) / tau) for v in s]
    return [v / sum(z) for v in z]


def test_prototype_reweighting_follows_the_equation() -> None:
    protos = [[0.0, 0.0], [1.0, 1.0], [3.0, -1.0]]
    feats = [[0.9, 1.2], [1.4, 0.8]]
    merged, w = prototype_reweight(torch.tensor(protos), torch.tensor(feats), 0.2)
    want = expected_reweight(protos, feats, 0.2)
    assert torch.allclose(w, torch.tensor(want, dtype=torch.float64), atol=1e-9)
    assert int(w.argmax()) == 1  # the prototype nearest the clients' class features dominates
    assert torch.allclose(merged, sum(wk * torch.tensor(m) for wk, m in zip(want, protos, strict=True)).float())
    _, uniform = prototype_reweight(torch.tensor(protos), torch.zeros(0, 2), 0.2)
    assert torch.allclose(uniform, torch.full((3,), 1 / 3, dtype=torch.float64))


def test_server_reweights_prototypes_and_averages_the_task_lora(runtime: Runtime) -> None:
    server, _ = runtime.programs()
    assert isinstance(server, PILoRAServer)
    server.begin_stage(1)
    names = server.model.task_tensors(1)
    state = server.model.get_state()
    logits = runtime.env.label_space.tasks[1].logits
    gen = torch.Generator().manual_seed(5)
    replies, holders = {}, {0: [logits[0]], 1: [logits[0], logits[1]], 2: [logits[1]]}
    for c, classes in holders.items():
        tensors = {k: torch.randn(state[k].shape, generator=gen) for k in names}
        d = state[names[-1]].shape[1]
        stats = ClassStatistics(torch.tensor(classes), torch.ones(len(classes), dtype=torch.long),
                                torch.randn(len(classes), d, generator=gen))  # fmt: skip
        tensors.update(stats.to_tensors())
        replies[c] = Message(tensors, {"num_samples": 4 + c, "loss": 1.0})
    server.aggregate_task(replies, 1)
    after = server.model.get_state()
    n = torch.tensor([4.0, 5.0, 6.0])
    for k in names[:-1]:  # the task's LoRA: sample-weighted FedAvg
        want = sum(w * r.tensors[k] for w, r in zip(n / n.sum(), replies.values(), strict=True))
        assert torch.allclose(after[k], want, atol=1e-6), k
    for i, logit in enumerate(logits):  # the task's prototypes: re-weighted with the holders' class means
        protos = [r.tensors["protos.1"][i].tolist() for r in replies.values()]
        feats = [
            r.tensors["stats/means"][r.tensors["stats/classes"] == logit][0].tolist()
            for r in replies.values()
            if logit in r.tensors["stats/classes"]
        ]
        w = expected_reweight(protos, feats, 0.2) if feats else [1 / 3] * 3
        want = sum(wk * torch.tensor(m) for wk, m in zip(w, protos, strict=True))
        assert torch.allclose(after["protos.1"][i], want.float(), atol=1e-5), logit
    assert torch.equal(after["protos.0"], state["protos.0"])  # earlier tasks' prototypes stay as they were


@pytest.mark.parametrize("mode", ["products", "factors"])
def test_incremental_lora_sums_the_task_modules(runtime: Runtime, mode: str) -> None:
    lora = IncrementalQVLoRA(runtime.env.backbone, 3, [1], rank=2, sum_mode=mode, train_with_old=False)
    with torch.no_grad():
        for p in lora.factors.values():
            p.normal_()
    lora.set_task(1)
    d = runtime.env.backbone.embed_dim
    f = {k: v.detach() for k, v in lora.factors.items()}
    if mode == "products":
        dq = sum(f[f"bq_{t}_1"] @ f[f"aq_{t}_1"] for t in (0, 1))
        dv = sum(f[f"bv_{t}_1"] @ f[f"av_{t}_1"] for t in (0, 1))
    else:
        dq = sum(f[f"bq_{t}_1"] for t in (0, 1)) @ sum(f[f"aq_{t}_1"] for t in (0, 1))
        dv = sum(f[f"bv_{t}_1"] for t in (0, 1)) @ sum(f[f"av_{t}_1"] for t in (0, 1))
    lora.eval()
    dense = lora().lora[1]["qkv"].dense().detach()
    assert torch.allclose(dense[:d], dq, atol=1e-5) and torch.allclose(dense[2 * d :], dv, atol=1e-5)
    assert torch.equal(dense[d : 2 * d], torch.zeros(d, d))  # keys are not adapted
    lora.train()  # the official code trains the current task's module alone
    alone = lora().lora[1]["qkv"].dense().detach()
    assert torch.allclose(alone[:d], f["bq_1_1"] @ f["aq_1_1"], atol=1e-5)
    assert [k for k, p in lora.factors.items() if p.requires_grad] == lora.task_keys(1)


def test_prototype_logits_are_scaled_distances(runtime: Runtime) -> None:
    server, _ = runtime.programs()
    model = server.model
    f = torch.randn(5, runtime.env.backbone.embed_dim)
    protos = model.prototypes()
    want = -((f.unsqueeze(1) - protos.unsqueeze(0)).pow(2).sum(-1) / f.shape[1]).sqrt()
    assert torch.allclose(-model.distances(f), want, atol=1e-5)
    assert torch.equal(protos[list(runtime.env.label_space.tasks[1].logits)], model.protos["1"].detach())
    squared = PrototypeLoRAClassifier(runtime.env, server.params.model_copy(update={"distance": "squared"}))
    squared.load_state_dict(model.state_dict())
    assert torch.allclose(-squared.distances(f), -want.pow(2), atol=1e-5)


@pytest.mark.slow
def test_run_sends_only_seen_tasks_and_uploads_only_the_current_one(tmp_path) -> None:
    from .test_hgp import recorded_run

    method = {"name": "pilora", "layers": [0], "local_epochs": 3, "batch_size": 8, "lr": 1e-3, "proto_lr": 0.05}
    exp, log = recorded_run(tiny_config(method=method), tmp_path)
    for task, _, sent, replies in log:
        msg = next(iter(sent.values()))
        tasks_down = {int(k.split("_")[1]) for k in msg.tensors if k.startswith("prompt.factors.")}
        assert tasks_down == set(range(task + 1))  # old tasks' LoRA (summed in), nothing of later tasks
        assert {k for k in msg.tensors if k.startswith("protos.")} == {f"protos.{t}" for t in range(task + 1)}
        for reply in replies.values():
            up = {int(k.split("_")[1]) for k in reply.tensors if k.startswith("prompt.factors.")}
            assert up == {task}
            assert {k for k in reply.tensors if k.startswith("protos.")} == {f"protos.{task}"}
            assert "stats/means" in reply.tensors  # the class means the re-weighting needs
    rounds = exp.state["rounds"]
    assert all(r["failures"] == [] for r in rounds)
    assert exp.state["accuracy_matrix"][0][0] > 50  # nearest-prototype accuracy above chance (33 %)


@pytest.mark.parametrize("pl_weight", [0.0, 5.0])
def test_reply_last_loss_is_the_final_epochs_dce_not_the_total(tmp_path, pl_weight: float) -> None:
    """The validity gate compares `last_loss` with ln K, so PILoRA reports its cross-entropy term (DCE): with the
    other terms off it equals the total's final-epoch mean; with the prototype term on, it is below the total."""
    from .test_hgp import recorded_run

    method = {"name": "pilora", "layers": [0], "local_epochs": 1, "batch_size": 8, "lr": 1e-3, "proto_lr": 0.05,
              "pl_weight": pl_weight, "ort_weight": 0.0, "l1_weight": 0.0}  # fmt: skip
    _exp, log = recorded_run(tiny_config(method=method), tmp_path)
    replies = [r for _t, _r, _s, rs in log for r in rs.values() if r.scalars["num_samples"] > 0]
    assert replies
    for r in replies:  # one epoch: the final epoch's mean is the mean over every step
        assert r.scalars["last_dce"] == pytest.approx(r.scalars["dce"], rel=1e-9)
        if pl_weight == 0.0:
            assert r.scalars["last_dce"] == pytest.approx(r.scalars["loss"], rel=1e-6)
        else:
            assert r.scalars["last_dce"] < r.scalars["loss"] - 0.01
        assert r.scalars["last_loss"] <= r.scalars["last_dce"] + 1e-9  # the best scale fits at least as well as T


def test_reply_last_loss_is_the_final_epochs_own_class_dce_at_its_best_scale(tmp_path, monkeypatch) -> None:
    """`last_loss` (the gate's client-loss evidence) is `own_class_loss` of the final epoch's DCE logits and labels,
    exactly those: every final-epoch step's, no earlier one; `last_loss_seen` is `scale_free_loss` of them."""
    import promptfcl.methods.pilora as pilora

    from .test_hgp import recorded_run

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def spy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
        seen.append((logits, targets))
        return -1.0, 7.0

    monkeypatch.setattr(pilora, "own_class_loss", spy)
    monkeypatch.setattr(pilora, "scale_free_loss", lambda lg, t: (-2.0, 1.0))
    method = {"name": "pilora", "layers": [0], "local_epochs": 2, "batch_size": 8, "lr": 1e-3, "proto_lr": 0.05}
    _exp, log = recorded_run(tiny_config(method=method), tmp_path)
    replies = [r for _t, _r, _s, rs in log for r in rs.values() if r.scalars["num_samples"] > 0]
    assert replies and all(r.scalars["last_loss"] == -1.0 and r.scalars["last_scale"] == 7.0 for r in replies)
    assert all(r.scalars["last_loss_seen"] == -2.0 for r in replies)
    logged = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    trained = [r for r in logged if r.get("last_loss") is not None]
    assert trained and all(r["last_loss"] == -1.0 and r["last_loss_seen"] == -2.0 for r in trained)  # in the log
    # each client's final epoch: every training image once
    assert sorted(len(t) for _l, t in seen) == sorted(int(r.scalars["num_samples"]) for r in replies)
    dce = [float(torch.nn.functional.cross_entropy(lg, t)) for lg, t in seen]
    assert all(d > 0 for d in dce)


def test_train_logits_all_lets_future_prototypes_compete(runtime: Runtime) -> None:
    """`train_logits: all` (fed-mammoth's pilora3): on task 0 the DCE runs over every task's prototypes, the future
    tasks' random ones too; `seen` (default) over task 0's only. Both equal a CE written out over those rows."""
    server, client = runtime.programs()
    model, space = server.model, runtime.env.label_space
    model.set_task(0)
    x = runtime.env.eval_transform(runtime.dataset.train.images[:4])
    y = torch.tensor(space.tasks[0].logits[:2] * 2)
    client.params = client.params.model_copy(update={"pl_weight": 0.0, "ort_weight": 0.0, "l1_weight": 0.0})
    with torch.no_grad():
        logits = -model.distances(model.features(x)) / model.temperature
    for which, rows in (("seen", list(space.tasks[0].logits)), ("all", list(range(space.num_logits)))):
        mask = space.train_mask(0, which)
        assert mask.nonzero().flatten().tolist() == rows
        with torch.no_grad():
            got = float(client.loss_fn(None, None)(model, x, y, mask))
        want = float(torch.nn.functional.cross_entropy(logits[:, rows], torch.tensor([rows.index(int(c)) for c in y])))
        assert got == pytest.approx(want, rel=1e-5), which


@pytest.mark.parametrize("which", ["seen", "all"])
def test_train_logits_all_competes_with_the_servers_later_prototypes(runtime: Runtime, monkeypatch, which) -> None:
    """With `train_logits: all` the server also sends the later tasks' prototypes (pilora3 sends its whole prototype
    dict), and the client's DCE competes with those rows, not with its own working model's random ones; with `seen`
    nothing of later tasks travels and they never enter the loss."""
    from promptfcl.data.loader import LabeledSubset
    from promptfcl.federation.message import Record
    from promptfcl.federation.protocol import ClientContext, RoundInfo

    server, client = runtime.programs()
    for program in (server, client):
        program.params = program.params.model_copy(update={"train_logits": which, "local_epochs": 1})
    server.begin_stage(0)
    message = server.downlink(RoundInfo(0, 0, (0,)))
    space, num_tasks = runtime.env.label_space, runtime.env.label_space.num_tasks
    later = {f"protos.{t}" for t in range(1, num_tasks)}
    assert later <= set(message.tensors) if which == "all" else not later & set(message.tensors)
    rows_in_loss = []
    distances = PrototypeLoRAClassifier.distances

    def spy(model, f):
        rows_in_loss.append(model.prototypes().detach().clone())
        return distances(model, f)

    monkeypatch.setattr(PrototypeLoRAClassifier, "distances", spy)
    data = LabeledSubset.of(runtime.dataset.train, runtime.scenario.client_indices(0, 0)[:8], space.class_to_logit)
    ctx = ClientContext(0, 0, 0, Record(), data, 0, torch.device("cpu"))
    client.handle_train(message, ctx)
    later_rows = [j for t in space.tasks[1:] for j in t.logits]
    server_rows = server.model.prototypes().detach()[later_rows]
    assert rows_in_loss
    assert all(torch.equal(r[later_rows], server_rows) == (which == "all") for r in rows_in_loss)


def test_train_batch_class_means_average_every_feature_the_loss_saw(runtime: Runtime) -> None:
    """`class_means: train_batches` (both official codes): a class's uploaded mean is the mean of every feature the
    training loss computed for it over the round's batches, and a class seen fewer than `class_means_min_visits`
    times is not uploaded."""
    server, client = runtime.programs()
    model, space = server.model, runtime.env.label_space
    model.set_task(0)
    client.params = client.params.model_copy(update={"class_means": "train_batches", "class_means_min_visits": 2})
    a, b, c = space.tasks[0].logits[:3]
    x = runtime.env.eval_transform(runtime.dataset.train.images[:6])
    y = torch.tensor([a, b, a, a, b, c])
    mask = space.train_mask(0, "seen")
    loss = client.loss_fn(None, None)
    loss(model, x[:3], y[:3], mask)  # two batches, as two steps of one round
    loss(model, x[3:], y[3:], mask)
    with torch.no_grad():
        f = model.features(x).double()
    stats = client.class_means(model, None)
    assert dict(zip(stats.classes.tolist(), stats.counts.tolist(), strict=True)) == {a: 3, b: 2}
    for cls, mean in zip(stats.classes.tolist(), stats.means, strict=True):
        assert torch.allclose(mean.double(), f[y == cls].mean(0), atol=1e-5)
    assert not torch.allclose(stats.means[0], stats.means[1], atol=1e-3)  # the classes' means differ


def test_no_layers_is_pilora_on_frozen_features() -> None:
    """`layers: []` (the control that ablates PILoRA's LoRA for a whole run): no LoRA parameter exists, the
    orthogonality and L1 terms are zero, the loss still trains the prototypes, and the model's features are the
    frozen backbone's."""
    runtime = Runtime.build(tiny_config(method={"name": "pilora", "layers": []}))
    server, client = runtime.programs()
    model, space = server.model, runtime.env.label_space
    model.set_task(0)
    assert not [p for p in model.prompt.parameters() if p.numel()]
    assert float(model.prompt.orthogonality()) == 0.0 and float(model.prompt.l1()) == 0.0
    x = runtime.env.eval_transform(runtime.dataset.train.images[:4])
    y = torch.tensor(space.tasks[0].logits[:2] * 2)
    with torch.no_grad():
        assert torch.allclose(model.features(x), runtime.env.backbone(x), atol=1e-6)
    model.zero_grad()
    client.loss_fn(None, None)(model, x, y, space.train_mask(0, "seen")).backward()
    assert float(model.protos["0"].grad.abs().sum()) > 0
