"""FedMGP: per-client state isolation, selective prompt fusion, what travels, ablations, baselines on the
personalized scenarios under the client_local regime, and exact resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from promptfcl.config import build_config
from promptfcl.experiment import Experiment
from promptfcl.federation.inprocess import InProcessGrid, run_client
from promptfcl.federation.message import Message, Record
from promptfcl.methods.fedmgp_model import distill_pool, distillation_loss
from promptfcl.runtime import Runtime

from .conftest import tiny_raw

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


class RecordingGrid(InProcessGrid):
    """The in-process engine, keeping every delivered message and reply per (task, round)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[int, int, dict[int, Message], dict[int, Message]]] = []

    def _deliver(self, messages: dict[int, Message]) -> dict[int, Message]:
        replies = super()._deliver(messages)
        self.log.append((self.round.task, self.round.round, messages, replies))
        return replies


def run_recorded(raw: dict[str, Any], run_dir: Path) -> tuple[dict[str, Any], RecordingGrid]:
    grids: list[RecordingGrid] = []

    def factory(rt: Runtime) -> RecordingGrid:
        grids.append(RecordingGrid(rt.programs()[1], rt.scenario, rt.dataset.train, rt.cfg.seed, rt.device))
        return grids[0]

    metrics = Experiment(build_config(raw), run_dir, show_progress=False, grid_factory=factory).run()
    return metrics, grids[0]


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
    assert all("kr_s" in r and "fusion_loss_first" in r and 0 <= r["diag/local_key_hit"] <= 100 for r in rounds)
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


@pytest.mark.parametrize(
    ("change", "check"),
    [
        ({"global_prompt": False}, "no_upload"),
        ({"local_prompt": False}, "no_local"),
        ({"fusion": "fedavg"}, "mean"),
        ({"return_fused_head": True, "filter_threshold": 0.0, "proxy": "full_test"}, "head"),
    ],
)
def test_ablations_and_code_switches(tmp_path: Path, change: dict, check: str) -> None:
    metrics, grid = run_recorded(personal_raw({**FEDMGP, **change}, rounds=1), tmp_path / "run")
    trains = [(m, rep) for _t, _r, m, rep in grid.log if next(iter(m.values())).kind == "train"]
    assert len(metrics["accuracy_matrix"]) == 2
    if check == "no_upload":
        assert all(not rep.tensors for _m, replies in trains for rep in replies.values())
    elif check == "no_local":
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
    from promptfcl.data.loader import LabeledSubset
    from promptfcl.methods.fedavg import set_task
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
    original = Experiment._run_round
    done: list[int] = []

    def interrupted(self: Experiment, task: int, rnd: int) -> None:
        if len(done) == 3:
            raise KeyboardInterrupt
        done.append(1)
        original(self, task, rnd)

    monkeypatch.setattr(Experiment, "_run_round", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Experiment(build_config(raw), tmp_path / "cut", show_progress=False).run()
    monkeypatch.setattr(Experiment, "_run_round", original)
    resumed = Experiment.from_run_dir(tmp_path / "cut", show_progress=False).run(resume=True)
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
