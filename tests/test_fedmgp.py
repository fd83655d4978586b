"""FedMGP: per-client state isolation, selective prompt fusion, what travels, ablations, baselines on the
personalized scenarios under the client_local regime, and exact resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from promptfcl.config import build_config
from promptfcl.data.loader import LabeledSubset
from promptfcl.experiment import Experiment
from promptfcl.federation.inprocess import run_client
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext
from promptfcl.methods.fedmgp.class_prefix import ClassPrefixPool
from promptfcl.methods.fedmgp.model import distill_pool, distillation_loss, key_chance, key_hits
from promptfcl.runtime import Runtime

from .conftest import RecordingGrid, interrupted_then_resumed, tiny_raw
from .test_hgp import recorded_run

FEDMGP = {
    "name": "fedmgp", "pool_size": 4, "length": 2, "top_k": 2, "local_layers": [1], "local_length": 2,
    "head_hidden": 16, "local_epochs": 1, "batch_size": 8, "lr": 0.01, "proxy_per_class": 4, "fusion_epochs": 2,
}  # fmt: skip


def personal_raw(method: dict[str, Any], mode: str = "asynchronous", rounds: int = 2) -> dict[str, Any]:
    raw = tiny_raw(
        scenario={
            "kind": "personalized", "num_tasks": 2, "num_clients": 3, "rounds_per_task": rounds,
            "class_order": "shuffled", "partition": {"min_samples": 0},
            "personalized": {"mode": mode, "private_classes": 1, "public_classes": 3},
        },
        eval={"regime": "client_local", "batch_size": 32},
    )  # fmt: skip
    if mode == "synchronous":
        raw["scenario"]["classes_per_task"] = 3
    raw["method"] = dict(method)
    return raw


def run_recorded(raw: dict[str, Any], run_dir: Path) -> tuple[dict[str, Any], RecordingGrid]:
    """Run `raw` in process: its metrics.json and the recording grid (`log`: every (task, round, sent, replies))."""
    grids: list[RecordingGrid] = []
    recorded_run(build_config(raw), run_dir, grids)
    return json.loads((run_dir / "metrics.json").read_text()), grids[0]


def test_fedmgp_end_to_end_uploads_only_the_global_pool_and_broadcasts_one_fused_pool(tmp_path: Path) -> None:
    metrics, grid = run_recorded(personal_raw(FEDMGP), tmp_path / "run")
    trains = [(t, r, m, rep) for t, r, m, rep in grid.log if next(iter(m.values())).kind == "train"]
    assert len(trains) == 4
    for _t, _r, sent, replies in trains:
        assert all(set(rep.tensors) == {"global_pool.keys", "global_pool.prompts"} for rep in replies.values())
        first = next(iter(sent.values())).tensors
        for msg in sent.values():  # every client receives the identical fused pool
            assert msg.tensors.keys() == first.keys() and all(torch.equal(msg.tensors[k], first[k]) for k in first)
    # the pool sent in round r+1 is the fusion of round r's uploads: different from each client's own pool
    prev_uploads, next_sent = trains[0][3], next(iter(trains[1][2].values())).tensors["global_pool.prompts"]
    assert all(not torch.equal(u.tensors["global_pool.prompts"], next_sent) for u in prev_uploads.values())
    evals = [m for _t, _r, m, _rep in grid.log if next(iter(m.values())).kind == "evaluate"]
    assert evals and all(set(next(iter(m.values())).tensors) == {"global_pool.keys", "global_pool.prompts"}
                         for m in evals)  # fmt: skip
    states = grid.states  # personal parts stay on the clients
    assert all(any(k.startswith("local_pool.") for k in s.tensors) for s in states.values())
    assert len(metrics["accuracy_matrix"]) == 2 and metrics["summary"]["kr_t"] is not None
    rounds = [json.loads(x) for x in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert all("kr_s" in r and "fusion_loss_first" in r and "diag/local_key_hit" in r for r in rounds)
    # the validity gate sees every trained group move: the server's fused pool, measured on the server, and what
    # the clients keep to themselves (H_g, local prompts, local heads), reported in their replies (the server's
    # copies of those never change: measured there they read 0 and the run failed `parameters_moved`)
    for r in rounds:
        assert all(r[f"move/{g}"] > 1e-3 for g in ("global_pool", "global_head", "local_pool", "local_heads")), r
    checks = {c["name"]: c for c in metrics["validity"]["checks"]}
    assert checks["parameters_moved"]["passed"], checks["parameters_moved"]
    # the clients' loss for the gate is their CE; the whole loss adds the key pulls on top of it
    assert all(r["last_total"] > r["last_loss"] for r in rounds)
    # chance of the default test-time selection (top-1 among the classes the client has seen): the mean over
    # clients of 100 / (its classes in tasks 0..t)
    client_tasks = Runtime.build(build_config(personal_raw(FEDMGP))).scenario.client_tasks
    for r in rounds:
        seen = [len({c for task in tasks[: r["task"] + 1] for c in task}) for tasks in client_tasks]
        assert r["diag/local_key_chance"] == pytest.approx(sum(100.0 / n for n in seen) / len(seen))
    assert (tmp_path / "run" / "scenario_client_tasks.png").is_file()


def test_one_clients_training_leaves_another_clients_local_prompts_and_heads_untouched() -> None:
    rt = Runtime.build(build_config(personal_raw(FEDMGP)))
    server, client = rt.programs()
    states = {0: Record(), 1: Record()}

    def send(cid: int, task: int, rnd: int, kind: str = "train") -> Message:
        msg = Message(server.shared(), {"task": task, "round": rnd, "tasks": [0], "batch_size": 32}, kind=kind)
        return run_client(client, msg, cid, states[cid], rt.scenario, rt.dataset.train, rt.cfg.seed, rt.device)

    send(1, 0, 0)
    snapshot = {k: v.clone() for k, v in states[1].tensors.items()}
    before = send(1, 0, 0, "evaluate").scalars["global"]
    for rnd in range(2):  # client 0 trains task 0 and then a new task (new local head) in between
        send(0, 0, rnd)
    send(0, 1, 0)
    assert states[1].tensors.keys() == snapshot.keys()
    assert all(torch.equal(states[1].tensors[k], snapshot[k]) for k in snapshot)
    assert send(1, 0, 0, "evaluate").scalars["global"] == before
    assert not torch.equal(states[0].tensors["local_pool.k_prompts"], states[1].tensors["local_pool.k_prompts"])
    assert not torch.equal(states[0].tensors["local_heads.1.0.weight"], states[1].tensors["local_heads.1.0.weight"])


def test_prompt_fusion_distillation_pulls_the_student_pool_towards_the_teachers() -> None:
    rt = Runtime.build(build_config(personal_raw(FEDMGP)))
    server, _ = rt.programs()
    pools = [server._pool(server.shared()) for _ in range(3)]
    with torch.no_grad():
        for i, pool in enumerate(pools):
            torch.manual_seed(i)
            pool.prompts.uniform_(-1, 1)
    proxy = server.proxy(set(range(6)))
    student, teachers = pools[0], pools[1:]
    args = (rt.env.backbone, proxy, rt.env.eval_transform)
    before = distillation_loss(student, teachers, *args, 16, rt.device)
    gen = torch.Generator().manual_seed(0)
    losses = distill_pool(student, teachers, *args, 6, 8, 0.05, 0.0, gen, rt.device)
    after = distillation_loss(student, teachers, *args, 16, rt.device)
    assert losses[-1] < losses[0] and after < 0.8 * before
    assert torch.equal(student.keys, pools[0].keys)  # keys get no gradient from the output-matching loss


def step(rt: Runtime, programs: tuple, states: dict[int, Record], cid: int, task: int, rnd: int,
         kind: str = "train") -> Message:  # fmt: skip
    """One message from the server's current shared state to client `cid`, handled as the engine would."""
    server, client = programs
    msg = Message(server.shared(), {"task": task, "round": rnd, "tasks": [0], "batch_size": 32}, kind=kind)
    return run_client(client, msg, cid, states[cid], rt.scenario, rt.dataset.train, rt.cfg.seed, rt.device)


def context(rt: Runtime, cid: int, task: int, state: Record) -> ClientContext:
    """The context `run_client` gives client `cid` in `task` (its own label space and local test splits)."""
    space = rt.scenario.client_label_space(cid)

    def split(indices: Any, t: int) -> LabeledSubset:
        return LabeledSubset.of(rt.dataset.train, indices, space.task_class_to_logit(t))

    return ClientContext(
        cid, task, 0, state, split(rt.scenario.client_indices(task, cid), task), 0, rt.device, task, space,
        lambda t: split(rt.scenario.client_test_indices(t, cid), t),
    )  # fmt: skip


def changed_rows(before: torch.Tensor, after: torch.Tensor, dim: int) -> list[int]:
    b, a = before.movedim(dim, 0), after.movedim(dim, 0)
    return [j for j in range(b.shape[0]) if not torch.equal(a[j], b[j])]


def test_phase_2_trains_the_local_prompt_of_each_images_label_and_the_current_tasks_head_only() -> None:
    """Training picks a local prompt by the ground-truth class (§4.2.2), so exactly the rows of the classes in
    the client's data change (prompts and, through the pull constraint, keys); only this task's local head."""
    rt = Runtime.build(build_config(personal_raw(FEDMGP)))
    programs, states = rt.programs(), {0: Record()}
    step(rt, programs, states, 0, 0, 0)
    before = {k: v.clone() for k, v in states[0].tensors.items()}
    step(rt, programs, states, 0, 0, 1)
    after = states[0].tensors
    space = rt.scenario.client_label_space(0)
    labels = space.class_to_logit[rt.dataset.train.targets[rt.scenario.client_indices(0, 0)]]
    trained = sorted(set(labels.tolist()))
    assert 0 < len(trained) < space.num_logits
    for name, dim in ClassPrefixPool.CLASS_DIM.items():
        assert changed_rows(before[f"local_pool.{name}"], after[f"local_pool.{name}"], dim) == trained, name
    heads = [k for k in before if k.startswith("local_heads.")]
    assert {k.split(".")[1] for k in heads if not torch.equal(before[k], after[k])} == {"0"}


def test_local_key_lr_moves_only_the_local_keys_faster() -> None:
    """`local_key_lr` gives the local keys their own Adam lr: they move ~10x further at 10x the lr, and every
    other tensor ends bit-identical (in training the prompt is chosen by the label, so the keys enter no other
    gradient; clipping is off so the keys' gradient norm cannot rescale the others)."""
    base = {**FEDMGP, "grad_clip": None, "lr": 0.002}
    end: dict[str, dict[str, torch.Tensor]] = {}
    for name, key_lr in (("same", None), ("faster", 0.02)):
        rt = Runtime.build(build_config(personal_raw({**base, "local_key_lr": key_lr})))
        programs, states = rt.programs(), {0: Record()}
        step(rt, programs, states, 0, 0, 0)
        start = states[0].tensors["local_pool.keys"].clone()
        reply = step(rt, programs, states, 0, 0, 1)
        end[name] = {**states[0].tensors, **reply.tensors, "moved": (states[0].tensors["local_pool.keys"] - start)}
    ratio = float(end["faster"]["moved"].abs().max() / end["same"]["moved"].abs().max())
    assert 5 < ratio < 15, ratio
    same = [k for k in end["same"] if k not in ("moved", "local_pool.keys") and not k.startswith("optim")]
    assert same and all(torch.equal(end["same"][k], end["faster"][k]) for k in same), "keys' lr leaked elsewhere"


def test_phase_2_keeps_the_global_prompts_keys_and_global_head_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Phase 1 trains the global pool and H_g (not the local parts); phase 2 trains the local parts on top of
    the frozen global prompts (§4.2, Algorithm 1 line 12), leaving every global tensor bit-identical."""
    import promptfcl.methods.fedmgp as fedmgp

    phases: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
    real = fedmgp.train_local

    def recording(model: torch.nn.Module, *args: Any, **kwargs: Any) -> dict[str, float]:
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        out = real(model, *args, **kwargs)
        phases.append((before, {k: v.detach().clone() for k, v in model.state_dict().items()}))
        return out

    monkeypatch.setattr(fedmgp, "train_local", recording)
    rt = Runtime.build(build_config(personal_raw(FEDMGP)))
    step(rt, rt.programs(), {0: Record()}, 0, 0, 0)

    def moved(phase: int, prefix: str) -> set[str]:
        before, after = phases[phase]
        return {k for k in before if k.startswith(prefix) and not torch.equal(before[k], after[k])}

    assert len(phases) == 2
    assert moved(0, "global_pool.") == {"global_pool.prompts", "global_pool.keys"} and moved(0, "global_head.")
    assert not moved(0, "local_")
    assert not moved(1, "global_"), "phase 2 changed the global prompts / H_g"
    assert moved(1, "local_pool.") == {"local_pool.keys", "local_pool.k_prompts", "local_pool.v_prompts"}
    assert moved(1, "local_heads.0.")


def test_evaluating_a_task_uses_that_tasks_local_head() -> None:
    """At evaluation each task's images go through the local head trained on that task (per-task heads, §4.2 /
    the official code), whatever task the client is on now."""
    rt = Runtime.build(build_config(personal_raw(FEDMGP)))
    programs, states = rt.programs(), {0: Record()}
    server, client = programs
    step(rt, programs, states, 0, 0, 0)
    step(rt, programs, states, 0, 1, 0)  # the client is now on task 1
    ctx = context(rt, 0, 1, states[0])
    model = client._model(Message(server.shared(), kind="evaluate"), ctx).eval()
    predict = client.predict(model, ctx)
    x = {t: next(iter(ctx.local_test(t).batches(16, rt.env.eval_transform)))[0] for t in (0, 1)}
    with torch.no_grad():
        ref = {t: predict(x[t], t) for t in (0, 1)}
        model.local_heads[1][-1].weight.add_(1.0)  # change task 1's head only
        assert torch.equal(predict(x[0], 0), ref[0]), "task 0 was not classified by task 0's head"
        assert not torch.equal(predict(x[1], 1), ref[1])
        model.local_heads[0][-1].weight.add_(1.0)
        assert not torch.equal(predict(x[0], 0), ref[0])


@pytest.mark.parametrize("pull", [0.5, 0.0])
def test_pull_constraints_move_the_chosen_keys_towards_their_queries(pull: float) -> None:
    """λ1 (Eq. 6) and λ2 (Eq. 10) are the only gradients the keys get: with them, the global keys selected for
    the client's images and the local keys of its classes end closer (cosine) to those images' queries; without
    them, no key moves."""
    import torch.nn.functional as F

    raw = personal_raw({**FEDMGP, "pull_coef": pull, "local_pull_coef": pull, "lr": 0.05})
    rt = Runtime.build(build_config(raw))
    programs, states = rt.programs(), {0: Record()}
    server, client = programs
    sent = server.shared()
    step(rt, programs, states, 0, 0, 0)
    local_before = states[0].tensors["local_pool.keys"].clone()
    reply = step(rt, programs, states, 0, 0, 1)
    ctx = context(rt, 0, 0, states[0])
    model = client._model(Message(reply.tensors, kind="evaluate"), ctx).eval()  # the round's global prompts
    x, y = next(iter(ctx.train_data.batches(256, rt.env.eval_transform)))
    with torch.no_grad():
        q_global, q_local = rt.env.backbone.query(x), model.local_query(x)

    def closeness(keys: torch.Tensor, q: torch.Tensor, ids: torch.Tensor) -> float:
        return float(F.cosine_similarity(q.unsqueeze(1), keys[ids], dim=-1).mean())

    g_before, g_after = sent["global_pool.keys"], reply.tensors["global_pool.keys"]
    chosen = F.normalize(q_global, dim=1) @ F.normalize(g_before, dim=1).T
    chosen = chosen.topk(FEDMGP["top_k"], dim=1).indices
    local_after = states[0].tensors["local_pool.keys"]
    if pull:
        assert closeness(g_after, q_global, chosen) > closeness(g_before, q_global, chosen) + 0.01
        labels = y.unsqueeze(1)
        assert closeness(local_after, q_local, labels) > closeness(local_before, q_local, labels) + 0.01
    else:
        assert torch.equal(g_after, g_before) and torch.equal(local_after, local_before)


def test_local_keys_trained_by_the_pull_constraint_route_separable_queries_above_chance() -> None:
    """On toy queries that are separable by class, label-indexed pull training (Eq. 10's λ2 term) makes the
    test-time key search pick the image's own class prompt far above chance — the hit rate FedMGP reports."""
    gen = torch.Generator().manual_seed(0)
    classes, dim = 8, 16
    torch.manual_seed(0)
    pool = ClassPrefixPool(dim, classes, layers=(0,), length=1)
    centers = 3 * torch.randn(classes, dim, generator=gen)

    def toy(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, classes, (n,), generator=gen)
        return centers[y] + torch.randn(n, dim, generator=gen), y

    opt = torch.optim.Adam([pool.keys], lr=0.05)
    for _ in range(150):
        q, y = toy(32)
        loss = pool.pull_loss(q, y.unsqueeze(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    q, y = toy(400)
    allowed = torch.ones(classes, dtype=torch.bool)
    hit = 100.0 * key_hits(pool.select(q, allowed, 1), y) / len(y)
    chance = key_chance(1, classes)
    assert chance == 12.5 and key_chance(2, classes) == 25.0 and key_chance(4, 3) == 100.0
    assert hit > 90.0 > chance, f"key hit {hit:.1f}% on separable queries (chance {chance}%)"


def test_without_global_prompts_the_local_prompts_are_shared_per_class_over_the_clients_that_train_them(
    tmp_path: Path,
) -> None:
    """§5.3 w/o global prompt: clients upload their local pool; the server averages each class's prompt and key
    over the clients whose current task holds it (rows nobody trained keep their value) and broadcasts it; the
    clients train from and are tested with that pool, and it is counted as communication."""
    raw = personal_raw({**FEDMGP, "global_prompt": False})
    metrics, grid = run_recorded(raw, tmp_path / "run")
    client_tasks = Runtime.build(build_config(raw)).scenario.client_tasks
    space = Runtime.build(build_config(raw)).scenario.label_space
    trains = [(t, m, rep) for t, _r, m, rep in grid.log if next(iter(m.values())).kind == "train"]
    names = {f"local_pool.{n}" for n in ClassPrefixPool.CLASS_DIM}
    assert all(set(rep.tensors) == names for _t, _m, replies in trains for rep in replies.values())
    for (t, sent, replies), (_t2, nxt, _rep2) in zip(trains, trains[1:], strict=False):
        for name, dim in ClassPrefixPool.CLASS_DIM.items():
            key = f"local_pool.{name}"
            prev = next(iter(sent.values())).tensors[key].movedim(dim, 0)
            new = next(iter(nxt.values())).tensors[key].movedim(dim, 0)
            for j in range(space.num_logits):
                c = int(space.class_order[j])
                owners = [k for k in replies if c in client_tasks[k][t]]
                expect = sum(replies[k].tensors[key].movedim(dim, 0)[j].double() for k in owners) / len(owners) \
                    if owners else prev[j].double()  # fmt: skip
                assert torch.allclose(new[j].double(), expect, atol=1e-6), (t, name, j, owners)
            for k, rep in replies.items():  # each client started from the broadcast pool: rows it did not train
                own = {int(space.class_to_logit[c]) for c in client_tasks[k][t]}
                assert all(torch.equal(rep.tensors[key].movedim(dim, 0)[j], prev[j])
                           for j in range(space.num_logits) if j not in own)  # fmt: skip
    evals = [next(iter(m.values())) for _t, _r, m, _rep in grid.log if next(iter(m.values())).kind == "evaluate"]
    assert evals and all(set(m.tensors) == names for m in evals)
    assert all(not any(k.startswith("local_pool.") for k in s.tensors) for s in grid.states.values())
    assert all(any(k.startswith("local_heads.") for k in s.tensors) for s in grid.states.values())
    sizes = sum(t.numel() * t.element_size() for t in next(iter(trains[0][2].values())).tensors.values())
    assert metrics["communication"]["bytes_up"] >= sizes * sum(len(replies) for _t, _m, replies in trains)


@pytest.mark.parametrize("global_prompt", [False, True])
def test_local_only_control_communicates_nothing(tmp_path: Path, global_prompt: bool) -> None:
    """`local_only`: no tensor travels either way (only the scalars: sample count, loss, classes, moves), every client
    keeps all its prompts, KR_s is 100 by construction (the global model is the local one)."""
    raw = personal_raw({**FEDMGP, "global_prompt": global_prompt, "local_only": True})
    metrics, grid = run_recorded(raw, tmp_path / "run")
    assert all(not m.tensors for _t, _r, sent, replies in grid.log for m in [*sent.values(), *replies.values()])
    assert metrics["communication"]["mb_per_round"] < 2e-3  # message metadata only (scalars, the moves among them)
    assert all(any(k.startswith("local_pool.") for k in s.tensors) for s in grid.states.values())
    assert all(any(k.startswith("global_pool.") for k in s.tensors) == global_prompt for s in grid.states.values())
    assert all(r["kr_s"] == pytest.approx(100.0) for r in metrics["retention"]["rounds"])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"local_only": True, "return_fused_head": True}, "local_only sends nothing"),
        ({"global_prompt": False, "filter_threshold": 0.5}, "without global prompts there is no H_g"),
        ({"global_prompt": False, "local_prompt": False}, "is FedViT"),
    ],
)
def test_contradictory_fedmgp_switches_are_refused(change: dict, match: str) -> None:
    from promptfcl.config import ConfigError
    from promptfcl.runtime import check_config

    with pytest.raises(ConfigError, match=match):
        check_config(build_config(personal_raw({"name": "fedmgp", **change})))


@pytest.mark.parametrize(
    ("change", "check"),
    [
        ({"local_prompt": False}, "no_local"),
        ({"fusion": "fedavg"}, "mean"),
        ({"return_fused_head": True, "filter_threshold": 0.0, "proxy": "full_test"}, "head"),
    ],
)
def test_ablations_and_code_switches(tmp_path: Path, change: dict, check: str) -> None:
    metrics, grid = run_recorded(personal_raw({**FEDMGP, **change}, rounds=1), tmp_path / "run")
    trains = [(m, rep) for _t, _r, m, rep in grid.log if next(iter(m.values())).kind == "train"]
    assert len(metrics["accuracy_matrix"]) == 2
    if check == "no_local":
        assert all(not any(k.startswith("local_") for k in s.tensors) for s in grid.states.values())
    elif check == "mean":
        uploads = trains[0][1]
        mean = sum(r.tensors["global_pool.prompts"].double() for r in uploads.values()) / len(uploads)
        sent = next(iter(trains[1][0].values())).tensors["global_pool.prompts"]
        assert torch.allclose(sent.double(), mean, atol=1e-6)
    else:  # the fused head travels back and replaces every client's own global head
        sent = next(iter(trains[1][0].values())).tensors
        assert any(k.startswith("fused_head.") for k in sent)
        assert all("global_head.0.weight" in rep.tensors for rep in trains[0][1].values())


L2P = {"name": "fedl2p", "local_epochs": 1, "batch_size": 8, "pool_size": 4, "length": 2, "top_k": 2}


@pytest.mark.parametrize("personal_head", ["owners", "uniform"])
def test_fedl2p_on_personalized_scenarios_averages_each_head_row_over_the_clients_that_train_it(
    tmp_path: Path, personal_head: str
) -> None:
    """Round 0 of task 0: a class's head row is trained only by the clients whose task 0 holds it (a private
    class by one client); the head sent in round 1 averages that row over those clients only and keeps the rows
    nobody trained. `personal_head: uniform` (FedMGP's official fed_avg_head) averages over every client."""
    raw = personal_raw({**L2P, "personal_head": personal_head}, rounds=2)
    _metrics, grid = run_recorded(raw, tmp_path / "run")
    rt = Runtime.build(build_config(raw))
    space, client_tasks = rt.scenario.label_space, rt.scenario.client_tasks
    (_t, _r, sent0, replies0), (_t1, _r1, sent1, _rep1) = [e for e in grid.log if e[0] == 0 and
                                                           next(iter(e[2].values())).kind == "train"]  # fmt: skip
    for name in ("head.weight", "head.bias"):
        before, after = next(iter(sent0.values())).tensors[name], next(iter(sent1.values())).tensors[name]
        rows = {int(space.class_to_logit[c]): [k for k in replies0 if c in client_tasks[k][0]]
                for k in replies0 for c in client_tasks[k][0]}  # fmt: skip
        private = [j for j, owners in rows.items() if len(owners) == 1]
        assert private and len(replies0) == 3
        for j in range(space.num_logits):
            owners = rows.get(j, []) if personal_head == "owners" else list(replies0)
            if not rows.get(j):  # nobody trained row j: unchanged either way
                assert torch.equal(after[j], before[j])
                continue
            mean = sum(replies0[k].tensors[name][j].double() for k in owners) / len(owners)
            assert torch.allclose(after[j].double(), mean, atol=1e-6), (name, j, owners)
        j = private[0]  # the one owner's trained row arrives whole (owners) or shrunk to 1/3 of its update
        owner_row = replies0[rows[j][0]].tensors[name][j]
        assert torch.allclose(after[j], owner_row, atol=1e-6) == (personal_head == "owners")
    assert not torch.equal(
        next(iter(sent1.values())).tensors["prompt.prompts"], next(iter(sent0.values())).tensors["prompt.prompts"]
    )


@pytest.mark.parametrize("method", ["fedvit", "feddualprompt"])
def test_baselines_client_local_accuracy_is_the_global_model_on_each_clients_own_test_split(
    tmp_path: Path, method: str
) -> None:
    """The accuracy the client_local regime reports for (client, task) equals the final global model recomputed
    here on that client's local test split of its task, with only that task's classes competing."""
    from promptfcl.methods.base.fedavg import set_task
    from promptfcl.scenario.label_space import masked_logits

    extra = {"feddualprompt": {"g_layers": [0], "e_layers": [1], "pool_size": 4, "g_length": 2, "e_length": 2}}
    raw = personal_raw({"name": method, "local_epochs": 1, "batch_size": 8, **extra.get(method, {})}, rounds=1)
    _metrics, grid = run_recorded(raw, tmp_path / "run")
    last_eval = [m for _t, _r, m, _rep in grid.log if next(iter(m.values())).kind == "evaluate"][-1]
    rt = Runtime.build(build_config(raw))
    server, _ = rt.programs()
    model = server.global_model()
    model.set_state({k: v for k, v in next(iter(last_eval.values())).tensors.items()})
    model.eval()
    set_task(model, 1)  # the model as it stands after the last task (its pool selects among every seen task's keys)
    rounds = [json.loads(x) for x in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    reported = rounds[-1]["client_accuracy"]
    checked = 0
    for k in range(rt.scenario.num_clients):
        space = rt.scenario.client_label_space(k)
        for t in range(2):
            data = LabeledSubset.of(rt.dataset.train, rt.scenario.client_test[t][k], space.task_class_to_logit(t))
            mask = space.mask(space.tasks[t].logits)
            correct = 0
            with torch.no_grad():
                for x, y in data.batches(32, rt.env.eval_transform):
                    correct += int((masked_logits(model(x), mask).argmax(1) == y).sum())
            assert reported[str(k)][str(t)] == pytest.approx(100.0 * correct / len(data))
            checked += 1
    assert checked == 6


def test_fedmgp_resume_equals_an_uninterrupted_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = personal_raw(FEDMGP)
    reference = Experiment(build_config(raw), tmp_path / "ref", show_progress=False).run()
    resumed = interrupted_then_resumed(build_config(raw), tmp_path / "cut", rounds=3)
    strip = ("timing",)
    assert {k: v for k, v in resumed.items() if k not in strip} == {
        k: v for k, v in reference.items() if k not in strip
    }


@pytest.mark.flower
@pytest.mark.slow
def test_client_local_regime_runs_through_flower_like_in_process(tmp_path: Path) -> None:
    """The evaluate messages, per-client personal state and KR bookkeeping give the same numbers on Flower's
    simulation runtime as in-process."""
    pytest.importorskip("flwr", reason="flwr not installed: pip install 'promptfcl[flower]'")
    import yaml

    from promptfcl.cli import main

    raw = personal_raw({**FEDMGP, "fusion_epochs": 1}, rounds=1)
    raw["scenario"]["num_clients"] = 2
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["run", str(cfg), "--quiet", "--run-dir", str(tmp_path / "inproc")]) == 0
    assert main(["run", str(cfg), "--engine", "flower-sim", "--run-dir", str(tmp_path / "sim")]) == 0
    ours = json.loads((tmp_path / "sim" / "metrics.json").read_text())
    ref = json.loads((tmp_path / "inproc" / "metrics.json").read_text())
    assert ours["accuracy_matrix"] == ref["accuracy_matrix"] and ours["retention"] == ref["retention"]
    assert ours["summary"] == ref["summary"]
    assert ours["communication"] == ref["communication"]


def test_fedmgp_on_a_non_personalized_scenario_is_refused_up_front() -> None:
    from promptfcl.config import ConfigError
    from promptfcl.runtime import check_config

    with pytest.raises(ConfigError, match="scenario.kind personalized, not 'class_incremental'"):
        check_config(build_config(tiny_raw(method={"name": "fedmgp"})))
    check_config(build_config(personal_raw({"name": "fedmgp"})))  # the personalized scenario passes


@pytest.mark.parametrize("retries", [0, 1])
def test_a_client_silent_at_evaluation_is_asked_again_or_listed_as_missing(tmp_path: Path, retries: int) -> None:
    import warnings

    raw = personal_raw({"name": "fedvit", "local_epochs": 1, "batch_size": 8}, mode="synchronous", rounds=1)
    # client 1 loses task 1's messages of attempt 0: its training and the evaluate message that follows in the
    # same attempt; a retry (attempt 1) reaches it
    fault = {"kind": "no_reply", "client": 1, "tasks": [1]}
    raw["engine"] = {"device": "cpu", "round_retries": retries, "faults": [fault]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Experiment(build_config(raw), tmp_path / "r", show_progress=False).run()
    warned = [str(w.message) for w in caught if "did not answer the evaluation" in str(w.message)]
    rounds = [json.loads(x) for x in (tmp_path / "r" / "rounds.jsonl").read_text().splitlines()]
    assert [f["client"] for f in rounds[1]["failures"]] == [1]  # dropped from training either way
    if retries:
        assert not warned and "eval_missing" not in rounds[1]
        assert set(rounds[1]["client_accuracy"]) == {"0", "1", "2"}
    else:
        assert warned == ["clients [1] did not answer the evaluation; their accuracies are left out"]
        assert rounds[1]["eval_missing"] == [1] and set(rounds[1]["client_accuracy"]) == {"0", "2"}
