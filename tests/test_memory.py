"""Memory flat in the number of clients: one downlink copy per round, HePCo's teachers spilled to disk (the same run
as in memory), and the generator loss backpropagated one teacher at a time with the gradient of the summed loss."""

from __future__ import annotations

import copy
import json
from functools import partial
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from promptfcl.config import build_config
from promptfcl.experiment import Experiment
from promptfcl.federation.inprocess import InProcessGrid
from promptfcl.federation.message import Message
from promptfcl.federation.protocol import ClientContext, ClientProgram, RoundInfo
from promptfcl.methods.hepco.latent_generator import (
    LatentGenerator,
    Teacher,
    backward_sum,
    disagreement,
    train_generator,
)
from promptfcl.runtime import Runtime

from .conftest import tiny_config

D, C = 12, 5


def tiny_teachers(n: int, seed: int) -> tuple[list[Teacher], nn.Module, nn.Module]:
    """`n` teachers (linear head, tanh prompt map) and a student of the same form."""
    g = torch.Generator().manual_seed(seed)

    def member() -> tuple[nn.Linear, nn.Linear]:
        head, prompt = nn.Linear(D, C), nn.Linear(D, 2 * D)
        with torch.no_grad():
            for p in [*head.parameters(), *prompt.parameters()]:
                p.copy_(torch.randn(p.shape, generator=g))
        return head, prompt

    teachers = []
    for k in range(n):
        head, prompt = member()
        head.requires_grad_(False), prompt.requires_grad_(False)
        w = torch.rand(C, generator=g) + 0.1 * k
        teachers.append(Teacher(head, lambda z, p=prompt: torch.tanh(p(z)), w))
    s_head, s_prompt = member()
    return teachers, s_head, lambda z: torch.tanh(s_prompt(z))


def summed_loss(teachers, s_logits, s_prompts, z, y, allowed) -> torch.Tensor:
    """The generator loss as it was written before the change: every teacher's term in one graph."""
    cols = torch.nonzero(allowed).flatten()
    remap = torch.full((len(allowed),), -1, dtype=torch.long)
    remap[cols] = torch.arange(len(cols))
    s_logp = F.log_softmax(s_logits(z)[:, cols], dim=1)
    s_prompt = s_prompts(z)
    loss = z.new_zeros(())
    for t in teachers:
        t_logits = t.logits(z)[:, cols]
        ce = F.cross_entropy(t_logits, remap[y], reduction="none")
        t_logp = F.log_softmax(t_logits, dim=1)
        kl = (t_logp.exp() * (t_logp - s_logp)).sum(1)
        mse = (s_prompt - t.prompts(z)).pow(2).flatten(1).sum(1)
        loss = loss + (t.weight[y] * (ce - 1.0 * kl - 0.1 * mse)).sum()
    return loss


ALLOWED = torch.tensor([True, True, False, True, True])
HIST = torch.tensor([3.0, 1.0, 0.0, 2.0, 1.0])


def grads_of_one_step(per_teacher: bool) -> tuple[dict[str, torch.Tensor], float]:
    teachers, s_head, s_prompts = tiny_teachers(4, 0)
    torch.manual_seed(0)
    g = LatentGenerator(C, D).train()
    y = torch.multinomial(HIST, 32, replacement=True, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(1)
    z = g(y)
    if per_teacher:
        cols = torch.nonzero(ALLOWED).flatten()
        remap = torch.full((C,), -1, dtype=torch.long)
        remap[cols] = torch.arange(len(cols))
        outputs = [z, F.log_softmax(s_head(z)[:, cols], dim=1), s_prompts(z)]
        terms = [partial(disagreement, t, y, cols, remap, 1.0, 0.1) for t in teachers]
        loss = backward_sum(outputs, terms, list(g.parameters()))
    else:
        loss = summed_loss(teachers, s_head, s_prompts, z, y, ALLOWED)
        loss.backward()
    return {k: p.grad.clone() for k, p in g.named_parameters()}, float(loss.detach())


def test_generator_gradient_one_teacher_at_a_time_equals_the_summed_loss_gradient() -> None:
    per_teacher, loss_a = grads_of_one_step(True)
    summed, loss_b = grads_of_one_step(False)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    scale = max(float(g.abs().max()) for g in summed.values())  # biases before a BatchNorm get ~0 (noise)
    for name, a in per_teacher.items():
        b = summed[name]
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * scale), (
            f"{name}: max diff {float((a - b).abs().max())} of max {float(b.abs().max())}"
        )


def test_train_generator_follows_the_summed_loss_training() -> None:
    teachers, s_head, s_prompts = tiny_teachers(4, 0)
    torch.manual_seed(0)
    g = LatentGenerator(C, D)
    ref, start = copy.deepcopy(g), copy.deepcopy(g)
    torch.manual_seed(1)
    train_generator(
        g, teachers, s_head, s_prompts, HIST, ALLOWED, 3, 16, 1e-3, 1.0, 0.1, torch.Generator().manual_seed(2)
    )
    torch.manual_seed(1)  # the same noise draws
    opt, gen = torch.optim.Adam(ref.parameters(), lr=1e-3), torch.Generator().manual_seed(2)
    ref.train()
    for _ in range(3):
        y = torch.multinomial(HIST.double(), 16, replacement=True, generator=gen)
        loss = summed_loss(teachers, s_head, s_prompts, ref(y), y, ALLOWED)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    # the biases right before a BatchNorm (and the running means that track them) get a zero gradient up to
    # rounding, which Adam turns into ±lr steps; they do not change the train-mode output, so they are left out
    noise = {"net.0.bias", "net.3.bias", "net.1.running_mean", "net.4.running_mean"}
    for (name, a), b, a0 in zip(
        g.state_dict().items(), ref.state_dict().values(), start.state_dict().values(), strict=True
    ):
        if name in noise:
            continue
        if name.endswith("weight"):
            assert float((a - a0).abs().max()) > 1e-3, name  # it trained
        assert torch.allclose(a.float(), b.float(), atol=2e-5), f"{name}: max diff {float((a - b).abs().max())}"


def test_backward_sum_gives_the_summed_loss_gradient_including_the_shared_path() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(6, 4, requires_grad=True), torch.randn(4, 3)
    targets = [torch.randn(6, 3) for _ in range(3)]

    def shared() -> tuple[torch.Tensor, torch.Tensor]:  # the graph every term shares (generator and student)
        a = torch.tanh(x @ w)
        return a, a.pow(2).sum(1)

    def term(t: torch.Tensor):
        return lambda a, b: ((a - t).pow(2).sum(1) * b).sum()

    total = backward_sum(list(shared()), [term(t) for t in targets], [x])
    got, x.grad = x.grad.clone(), None
    a, b = shared()
    expect = sum(term(t)(a, b) for t in targets)
    expect.backward()
    assert torch.allclose(got, x.grad, rtol=1e-5, atol=1e-6), float((got - x.grad).abs().max())
    assert torch.allclose(total, expect.detach())


class AddOne(ClientProgram):
    """Adds one, in place, to the tensor it receives and sends it back (a client that mutates its message)."""

    message_kinds: ClassVar[tuple[str, ...]] = ("train",)

    def handle(self, message: Message, ctx: ClientContext) -> Message:
        message.tensors["w"].add_(1)
        return Message({"w": message.tensors["w"]}, {"num_samples": 1, "loss": 0.0}, kind="train_reply")


class PeekingGrid(InProcessGrid):
    def _deliver(self, messages: dict[int, Message]) -> dict[int, Message]:
        self.delivered = dict(messages)
        return super()._deliver(messages)


def test_a_broadcast_is_not_copied_per_client_and_every_client_still_gets_its_own_copy() -> None:
    rt = Runtime.build(tiny_config())
    grid = PeekingGrid(AddOne(rt.env, None, None), rt.scenario, rt.dataset.train, 0, rt.device)
    grid.start_round(RoundInfo(0, 0, (0, 1, 2)))
    sent = Message({"w": torch.zeros(3)}, kind="train")
    replies = grid.broadcast([0, 1, 2], sent)
    ptrs = {m.tensors["w"].data_ptr() for m in grid.delivered.values()}
    assert ptrs == {sent.tensors["w"].data_ptr()}, "stamping a broadcast should not copy its tensors per client"
    for c, r in replies.items():  # each client mutated its own private copy: no client saw another's change
        assert torch.equal(r.tensors["w"], torch.ones(3)), (c, r.tensors["w"])
    assert torch.equal(sent.tensors["w"], torch.zeros(3))


def hepco_round(store: str, tmp_path) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """A 2-task HePCo run (3 clients, a short server schedule) with its teachers kept in `store`."""
    method = {"name": "hepco", "pool_size": 4, "length": 2, "layers": [0], "augment": "flip", "local_epochs": 1,
              "generator_iterations": 5, "kd_iterations": 5, "teacher_store": store}  # fmt: skip
    exp = Experiment(tiny_config(method=method), tmp_path / store, show_progress=False)
    exp.run()
    rounds = [json.loads(line) for line in (tmp_path / store / "rounds.jsonl").read_text().splitlines()]
    return exp.server.model.get_state(), rounds


def test_hepco_teachers_on_disk_give_the_same_run_as_in_memory(tmp_path, monkeypatch) -> None:
    """`teacher_store: disk` writes each client's state as its reply arrives and loads one teacher at a time into
    one shared model: same generator, distillation and final model as keeping every teacher in memory, with one
    teacher model built per server instead of one per client and round, and the files gone after each round."""
    from promptfcl.methods.hepco import teacher_store

    built = {"memory": 0, "disk": 0}
    folders: list[str] = []
    original_frozen, original_add = teacher_store.TeacherStore._frozen, teacher_store.TeacherStore.add

    def counting_frozen(self):
        built[self.kind] += 1
        return original_frozen(self)

    def recording_add(self, client, state):
        original_add(self, client, state)
        if self._folder is not None and self._folder.name not in folders:
            folders.append(self._folder.name)

    monkeypatch.setattr(teacher_store.TeacherStore, "_frozen", counting_frozen)
    monkeypatch.setattr(teacher_store.TeacherStore, "add", recording_add)
    mem_state, mem_rounds = hepco_round("memory", tmp_path)
    disk_state, disk_rounds = hepco_round("disk", tmp_path)
    for k in mem_state:
        assert torch.equal(mem_state[k], disk_state[k]), k
    keys = ("generator_loss", "generator_fidelity", "head_kd_loss", "stage_a_shift")
    assert [[r[k] for k in keys] for r in mem_rounds] == [[r[k] for k in keys] for r in disk_rounds]
    assert built["memory"] == 3 * len(mem_rounds) and built["disk"] == 1, built  # 3 clients per round
    assert folders and not any(Path(f).exists() for f in folders), folders


# ------------------------------------------------------------------------------ FedMGP phase 2: V(x') cached
def fedmgp_client_model():
    from .test_fedmgp import FEDMGP, personal_raw

    rt = Runtime.build(build_config(personal_raw({**FEDMGP, "query_cache": True, "augment": "flip"})))
    server, client = rt.programs()
    model = server.new_model().eval()
    return rt, client, model


def test_fedmgp_vx_is_cached_per_input_and_global_prompt_state() -> None:
    rt, client, model = fedmgp_client_model()
    assert client.vx_cache is not None
    torch.manual_seed(0)
    x = torch.randn(5, 3, 32, 32)
    fresh = model.local_query(x)  # no cache yet: the plain computation
    model.vx_cache = client.vx_cache
    first = model.local_query(x)
    assert torch.allclose(first, fresh, atol=1e-5) and client.vx_cache.misses == 5
    again = model.local_query(torch.cat([x[:2], x.flip(-1)[:1]]))  # two repeats and one new (flipped) image
    assert client.vx_cache.hits == 2 and client.vx_cache.misses == 6
    assert torch.equal(again[:2], first[:2])
    with torch.no_grad():  # the next round's global prompts: a different function, so no stale entry is served
        model.global_pool.prompts.add_(torch.randn_like(model.global_pool.prompts))
    model.vx_cache = None
    expected = model.local_query(x)
    model.vx_cache = client.vx_cache
    assert not torch.allclose(expected, first, atol=1e-3)
    assert torch.allclose(model.local_query(x), expected, atol=1e-5)
    assert client.vx_cache.misses == 11 and len(client.vx_cache) == 5  # the old version's entries were dropped


def test_fedmgp_with_cached_vx_gives_the_same_run(tmp_path) -> None:
    from .test_fedmgp import FEDMGP, personal_raw

    results, caches = {}, {}
    for cached in (False, True):
        raw = personal_raw({**FEDMGP, "local_epochs": 3, "augment": "flip", "query_cache": cached})
        exp = Experiment(build_config(raw), tmp_path / str(cached), show_progress=False)
        results[cached] = exp.run()
        caches[cached] = exp.client.vx_cache
    assert caches[False] is None
    assert caches[True].hits > 0  # phase 2's later epochs reuse V(x')
    assert results[True]["accuracy_matrix"] == results[False]["accuracy_matrix"]


# ------------------------------------------------------------------ FedAvg replies folded as they arrive
POOL_METHOD = {"name": "fedavg_prompt_pool", "pool_size": 4, "length": 2, "layers": [0], "local_epochs": 1,
               "batch_size": 8, "augment": "none"}  # fmt: skip


def one_round(faults: list[dict], weighting: str = "samples"):
    from promptfcl.federation.faults import FaultPlan
    from promptfcl.federation.protocol import GridPolicy

    cfg = tiny_config(method={**POOL_METHOD, "weighting": weighting}, engine={"device": "cpu", "faults": faults})
    rt = Runtime.build(cfg)
    server, client = rt.programs()
    full: dict[int, Message] = {}
    grid = InProcessGrid(
        client, rt.scenario, rt.dataset.train, 0, rt.device, on_reply=lambda c, r: full.update({c: r.copy()})
    )
    grid.configure(GridPolicy(1, None, FaultPlan(cfg.engine.faults)), server.reply_schema)
    server.begin_stage(0)
    info = RoundInfo(0, 0, tuple(rt.scenario.participants[0][0]))
    grid.start_round(info)
    assert server.folds_replies()
    sent_back = {}
    original = grid._deliver

    def deliver(messages):
        sent_back.update(original(messages))
        return sent_back

    grid._deliver = deliver
    server.run_round(grid, info)
    return server, full, sent_back, grid


def test_fedavg_folds_each_validated_reply_into_the_mean_and_keeps_no_client_model() -> None:
    from promptfcl.federation.aggregation import weighted_mean

    server, full, kept, grid = one_round([{"kind": "nonfinite", "client": 1}])
    names = set(server.model.state_dict())
    assert [f.client for f in grid.failures] == [1]  # the non-finite reply was refused, so never folded
    assert kept and all(not names & set(r.tensors) for r in kept.values()), "full client models were kept"
    good = [c for c in sorted(full) if c != 1]
    expect = weighted_mean(
        [{k: full[c].tensors[k] for k in names} for c in good], [full[c].scalars["num_samples"] for c in good]
    )
    for k, v in server.model.state_dict().items():
        assert torch.equal(v, expect[k]), k


def test_a_folded_run_equals_the_run_that_keeps_every_reply(tmp_path, monkeypatch) -> None:
    from promptfcl.methods.base.fedavg import FedAvgServer

    folded = Experiment(tiny_config(method=POOL_METHOD), tmp_path / "folded", show_progress=False)
    a = folded.run()
    monkeypatch.setattr(FedAvgServer, "folds_replies", lambda self: False)
    kept = Experiment(tiny_config(method=POOL_METHOD), tmp_path / "kept", show_progress=False)
    b = kept.run()
    assert a["accuracy_matrix"] == b["accuracy_matrix"]
    for k, v in folded.server.model.state_dict().items():
        assert torch.equal(v, kept.server.model.state_dict()[k]), k


def test_copying_a_model_shares_its_frozen_backbone_and_copies_its_prompts() -> None:
    rt = Runtime.build(tiny_config())
    model = rt.programs()[0].model
    twin = copy.deepcopy(model)
    assert twin.backbone is model.backbone  # not a second ViT (nor a second query / stem cache)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(twin.parameters(), model.parameters(), strict=True))


def test_hepco_stage_a_one_teacher_at_a_time_has_the_summed_loss_gradient() -> None:
    from promptfcl.methods.hepco import prompt_gap, prompt_output

    from .test_hepco import clients_and_server

    rt, server, clients, replies = clients_and_server()
    counts = torch.stack([r.tensors["label_counts"] for r in replies.values()])
    teachers = server.teachers(replies, counts)
    z = torch.randn(32, rt.env.backbone.embed_dim, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(4))
    student = server.model
    grads = []
    for per_teacher in (True, False):
        student.zero_grad(set_to_none=True)
        if per_teacher:
            loss = backward_sum([prompt_output(student, z)], [partial(prompt_gap, t, y, z) for t in teachers])
        else:  # as it was written: every teacher's term in one graph
            s = prompt_output(student, z)
            loss = sum((t.weight[y] * (s - t.prompts(z)).pow(2).flatten(1).sum(1)).sum() for t in teachers)
            loss.backward()
        grads.append(({k: p.grad.clone() for k, p in student.prompt.named_parameters()}, float(loss.detach())))
    (a, la), (b, lb) = grads
    assert la == pytest.approx(lb, rel=1e-6)
    for k in a:
        assert float(b[k].abs().max()) > 0
        assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6 * float(b[k].abs().max())), k
