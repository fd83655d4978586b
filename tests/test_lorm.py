"""LoRM: the closed-form merges equal least-squares solutions computed independently, and what travels."""

from __future__ import annotations

import pytest
import torch

from promptfcl.adapters.lora import site_key
from promptfcl.backbones import build_vit
from promptfcl.data.loader import LabeledSubset
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext, Grid, RoundInfo
from promptfcl.methods.lorm import GRAM, LoRMClient, LoRMParams, LoRMServer
from promptfcl.methods.lorm.regmean import regmean
from promptfcl.runtime import Runtime

from .conftest import tiny_config


def lstsq_merge(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> torch.Tensor:
    """argmin_W Σ_k ‖X_k Wᵀ − X_k W_kᵀ‖², by least squares on the stacked problem (no Gram, no RegMean)."""
    x = torch.cat(xs).double()
    y = torch.cat([xk.double() @ wk.double().T for xk, wk in zip(xs, ws, strict=True)])
    return torch.linalg.lstsq(x, y).solution.T


def test_regmean_is_the_least_squares_merge() -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 6, generator=g) for n in (9, 14, 20)]
    ws = [torch.randn(4, 6, generator=g) for _ in xs]
    merged = regmean(ws, [x.T @ x for x in xs])
    assert torch.allclose(merged.double(), lstsq_merge(xs, ws), atol=1e-5)
    # a diagonal Gram (γ = 0) is the least-squares merge for inputs with that Gram: X = diag(√g)
    diag = regmean(ws, [(x * x).sum(0) for x in xs])
    roots = [torch.diag((x * x).sum(0).sqrt()) for x in xs]
    assert torch.allclose(diag.double(), lstsq_merge(roots, ws), atol=1e-5)
    assert not torch.allclose(merged, torch.stack(ws).mean(0), atol=1e-2)  # it is not a plain average


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    cfg = tiny_config(
        method={"name": "lorm", "rank": 2, "layers": [0, 1], "targets": ["qkv", "fc2"], "gram_decay_backbone": 1.0},
        scenario={"rounds_per_task": 2},
    )
    return Runtime.build(cfg)


def fake_reply(server: LoRMServer, factor: str, gen: torch.Generator, xs: dict[str, torch.Tensor], n: int) -> Message:
    """A client upload: a random trained factor and head, Grams of the given toy inputs (per site and head)."""
    state = server.model.get_state()
    tensors = {}
    for k, v in state.items():
        if k.startswith(f"prompt.{factor.lower()}.") or k.startswith("head."):
            tensors[k] = torch.randn(v.shape, generator=gen)
    for k, x in xs.items():
        tensors[GRAM + k] = (x.T @ x).float()
    return Message(tensors, {"num_samples": n, "loss": 1.0})


def test_client_merges_equal_independent_least_squares(runtime: Runtime) -> None:
    server, _ = runtime.programs()
    server.begin_stage(0)
    gen = torch.Generator().manual_seed(1)
    a0 = server.model.get_state()
    sites = [site_key(s) for s in server.adapter.sites]
    dims = {k: server.model.state_dict()[f"prompt.a.{k}"].shape[1] for k in sites}
    d = runtime.env.backbone.embed_dim
    inputs = []  # each client's inputs alone are rank-deficient; together they determine the merge uniquely
    for c in range(3):
        xs = {k: torch.randn(dims[k] // 2 + c, dims[k], generator=gen) for k in sites}
        inputs.append({**xs, "head": torch.randn(d, d, generator=gen)})
    # round 0 trains B: A is shared, B* = argmin Σ_k ‖X_k Aᵀ B*ᵀ − X_k Aᵀ B_kᵀ‖²
    replies = {c: fake_reply(server, "B", gen, inputs[c], 10 + c) for c in range(3)}
    server.merge_clients(replies, "B")
    after = server.model.get_state()
    for k in sites:
        assert torch.equal(after[f"prompt.a.{k}"], a0[f"prompt.a.{k}"])  # the frozen factor is untouched
        a = a0[f"prompt.a.{k}"]
        want = lstsq_merge([inp[k] @ a.T for inp in inputs], [r.tensors[f"prompt.b.{k}"] for r in replies.values()])
        assert torch.allclose(after[f"prompt.b.{k}"].double(), want, atol=1e-4), k
    head = lstsq_merge([inp["head"] for inp in inputs], [r.tensors["head.weight"] for r in replies.values()])
    assert torch.allclose(after["head.weight"].double(), head, atol=1e-4)
    n = torch.tensor([10.0, 11.0, 12.0])
    bias = sum(w * r.tensors["head.bias"] for w, r in zip(n / n.sum(), replies.values(), strict=True))
    assert torch.allclose(after["head.bias"], bias, atol=1e-6)
    # round 1 trains A: B is shared, A* = argmin Σ_k ‖X_k A*ᵀ Bᵀ − X_k A_kᵀ Bᵀ‖² (vec: (B ⊗ X_k)·vec(Aᵀ))
    replies = {c: fake_reply(server, "A", gen, inputs[c], 10 + c) for c in range(3)}
    server.merge_clients(replies, "A")
    final = server.model.get_state()
    for k in sites:
        b = final[f"prompt.b.{k}"].double()
        assert torch.equal(final[f"prompt.b.{k}"], after[f"prompt.b.{k}"])
        design = torch.cat([torch.kron(b, inp[k].double()) for inp in inputs])
        target = torch.cat(
            [torch.kron(b, inp[k].double()) @ r.tensors[f"prompt.a.{k}"].double().reshape(-1)
             for inp, r in zip(inputs, replies.values(), strict=True)]
        )  # fmt: skip
        vec = torch.linalg.lstsq(design, target.unsqueeze(1)).solution.flatten()
        want = vec.reshape(b.shape[1], -1)  # vec(Aᵀ) (column-major) stacks A's rows
        assert torch.allclose(final[f"prompt.a.{k}"].double(), want, atol=1e-4), k


class ScriptedGrid(Grid):
    """A grid whose clients answer with prepared replies (the server's code path, no training)."""

    def __init__(self, replies: dict[int, Message]) -> None:
        super().__init__()
        self.replies = replies

    def _deliver(self, messages: dict[int, Message]) -> dict[int, Message]:
        return {c: self.replies[c] for c in messages}


def test_task_merge_is_regmean_of_the_tasks_residual_weights(runtime: Runtime) -> None:
    server, _ = runtime.programs()
    gen = torch.Generator().manual_seed(2)
    sites = [site_key(s) for s in server.adapter.sites]
    xs_by_task, deltas = [], []
    for task in range(2):
        server.begin_stage(task)
        state = server.model.get_state()
        for k in sites:  # a trained module: B ≠ 0
            state[f"prompt.b.{k}"] = torch.randn(state[f"prompt.b.{k}"].shape, generator=gen)
        server.model.set_state(state)
        deltas.append({k: state[f"prompt.b.{k}"].double() @ state[f"prompt.a.{k}"].double() for k in sites})
        n_in = {k: state[f"prompt.a.{k}"].shape[1] for k in sites}
        xs = [{k: torch.randn(n_in[k] // 2 + c, n_in[k], generator=gen) for k in sites} for c in range(2)]
        xs_by_task.append(xs)
        d = runtime.env.backbone.embed_dim
        replies = {
            c: Message({**{GRAM + k: (x[k].T @ x[k]).float() for k in sites}, GRAM + "head": torch.eye(d)},
                       {"num_samples": 5})
            for c, x in enumerate(xs)
        }  # fmt: skip
        server.merge_task(ScriptedGrid(replies), RoundInfo(task, 1, (0, 1)))
    merged = server.merged_deltas()
    for s in server.adapter.sites:
        k = site_key(s)
        xs = [x[k] for task in xs_by_task for x in task]
        ws = [deltas[t][k] for t, task in enumerate(xs_by_task) for _ in task]
        want = lstsq_merge(xs, ws)
        assert torch.allclose(merged[s].dense().double(), want, atol=1e-4), k
        assert merged[s].a.shape[0] == 2 * 2  # kept low-rank: tasks × rank
    # the evaluated model is W0 + ΔW*: the merged deltas are what the global model applies
    spec = server.global_model().prompt()
    assert set(spec.lora) == {0, 1}
    # and the state round-trips through a checkpoint
    other, _ = runtime.programs()
    other.load_state(Record(server.state().tensors, server.state().scalars))
    for s, d in other.merged_deltas().items():
        assert torch.allclose(d.dense(), merged[s].dense())


@pytest.mark.parametrize("gram_model", ["current", "running_mean"])
def test_client_gram_is_the_adapted_layers_input_gram(runtime: Runtime, gram_model: str) -> None:
    server, client = runtime.programs()
    assert isinstance(client, LoRMClient)
    client.params = client.params.model_copy(update={"gram_model": gram_model})
    server.begin_stage(0)
    state = server.model.get_state()
    gen = torch.Generator().manual_seed(3)
    for k in [k for k in state if k.startswith("prompt.b.")]:
        state[k] = torch.randn(state[k].shape, generator=gen) * 0.3
    model = client.model
    model.set_state(state)
    message, task = Message(dict(state)), 0
    dense = {s: d.dense().detach() for s, d in model.prompt.deltas().items()}
    if gram_model == "running_mean":  # task 1, one earlier module: the code's W0 + (B0·A0 + B·A) / 2
        task = 1
        for s in dense:
            k = site_key(s)
            a0, b0 = (
                torch.randn(state[f"prompt.a.{k}"].shape, generator=gen),
                torch.randn(state[f"prompt.b.{k}"].shape, generator=gen),
            )
            message.tensors[f"old/0/a/{k}"], message.tensors[f"old/0/b/{k}"] = a0, b0 * 0.3
            dense[s] = (dense[s] + 0.3 * b0 @ a0) / 2
    data = LabeledSubset.of(runtime.dataset.train, list(range(10)), torch.arange(6))
    ctx = ClientContext(0, task, 0, Record(), data, 0, torch.device("cpu"))
    grams = client.grams(model, message, ctx)
    # independent: a copy of the ViT with the deltas merged into its weights, inputs captured by hooks on that copy
    vit = build_vit(runtime.cfg.backbone)  # a deep copy would be the shared backbone itself: build a second one
    vit.load_state_dict(runtime.env.backbone.state_dict())
    captured: dict[str, list[torch.Tensor]] = {}
    for (layer, target), delta in dense.items():
        blk = vit.vit.blocks[layer]
        lin = (blk.attn if target in ("qkv", "proj") else blk.mlp).get_submodule(target)
        with torch.no_grad():
            lin.weight += delta
        key = f"{layer}_{target}"
        lin.register_forward_hook(lambda _m, i, _o, key=key: captured.setdefault(key, []).append(i[0].detach()))
    feats = []
    with torch.no_grad():
        for x, _ in data.batches(4, runtime.env.eval_transform):
            feats.append(vit(x))
    for key, chunks in captured.items():
        x = torch.cat([c.reshape(-1, c.shape[-1]) for c in chunks]).double()
        assert torch.allclose(grams[GRAM + key].double(), x.T @ x, rtol=1e-4, atol=1e-3), key
    f = torch.cat(feats).double()
    head = f.T @ f
    want = 0.5 * head + 0.5 * torch.diag(head.diagonal())  # γ_head = 0.5 on the off-diagonals
    assert torch.allclose(grams[GRAM + "head"].double(), want, rtol=1e-4, atol=1e-3)


@pytest.mark.slow
def test_run_alternates_factors_and_sends_what_the_merge_needs(tmp_path) -> None:
    from .test_hgp import recorded_run

    cfg = tiny_config(method={"name": "lorm", "rank": 2, "local_epochs": 2, "batch_size": 8, "lr": 0.003})
    exp, log = recorded_run(cfg, tmp_path)
    kinds = [(task, rnd, next(iter(sent.values())).kind) for task, rnd, sent, _ in log]
    # per task: round 0 (train B), round 1 (train A), then the end-of-task Gram exchange in the last round
    assert kinds == [(t, r, k) for t in (0, 1) for r, k in ((0, "train"), (1, "train"), (1, "gram"))]
    for _, rnd, sent, replies in log:
        msg = next(iter(sent.values()))
        for reply in replies.values():
            names = set(reply.tensors)
            if msg.kind == "gram":
                assert all(n.startswith(GRAM) for n in names)
                continue
            factor = msg.scalars["factor"]
            assert factor == ("B" if rnd == 0 else "A")
            assert any(n.startswith(f"prompt.{factor.lower()}.") for n in names)
            assert not any(n.startswith(f"prompt.{'a' if factor == 'B' else 'b'}.") for n in names)  # frozen: not sent
            # γ_backbone = 0: each projection's Gram travels as its diagonal; the head's (γ = 0.5) in full
            assert all(reply.tensors[n].dim() == 1 for n in names if n.startswith(GRAM) and n != GRAM + "head")
            assert reply.tensors[GRAM + "head"].dim() == 2
    rounds = exp.state["rounds"]
    assert all(r["failures"] == [] for r in rounds)
    assert all(r["loss"] < 1.0 for r in rounds if r["round"] == 1)  # ln 3 ≈ 1.10: the tasks are learned
    assert exp.state["accuracy_matrix"][0][0] > 50  # above chance (33 %) on the first task


def test_head_solve_inverse_equals_pinv_and_refuses_a_singular_gram(runtime: Runtime) -> None:
    """`head_solve`: the code's `torch.inverse` head merge agrees with the pseudo-inverse on an invertible Gram sum;
    on a singular one (a feature no client's data reaches) it stops with a message, where pinv gives that column 0."""
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(30, 6, generator=gen).double() for _ in range(3)]
    ws = [torch.randn(4, 6, generator=gen) for _ in xs]
    grams = [x.T @ x for x in xs]
    assert torch.allclose(regmean(ws, grams, "inverse"), regmean(ws, grams, "pinv"), atol=1e-5)
    for x in xs:
        x[:, 2] = 0  # feature 2 never varies
    grams = [x.T @ x for x in xs]
    with pytest.raises(ValueError, match="head_solve: pinv"):
        regmean(ws, grams, "inverse")
    merged = regmean(ws, grams, "pinv")
    assert torch.isfinite(merged).all() and torch.allclose(merged[:, 2], torch.zeros(4), atol=1e-10)
    # the server's head merge follows the switch
    d = runtime.env.backbone.embed_dim
    for solve in ("pinv", "inverse"):
        server, _ = runtime.programs()
        server.params = server.params.model_copy(update={"head_solve": solve})
        server.begin_stage(0)
        sites = [site_key(s) for s in server.adapter.sites]
        dims = {k: server.model.state_dict()[f"prompt.a.{k}"].shape[1] for k in sites}
        inputs = [{**{k: torch.randn(40, dims[k], generator=gen) for k in sites}, "head": xh} for xh in
                  [torch.randn(2 * d, d, generator=gen) for _ in range(2)]]  # fmt: skip
        for inp in inputs:
            inp["head"][:, 0] = 0  # a feature dimension that never varies: the head Gram sum is singular
        replies = {c: fake_reply(server, "B", gen, inputs[c], 10) for c in range(2)}
        if solve == "inverse":
            with pytest.raises(ValueError, match="singular"):
                server.merge_clients(replies, "B")
        else:
            server.merge_clients(replies, "B")
            assert torch.isfinite(server.model.get_state()["head.weight"]).all()


def lorm_client(runtime: Runtime, **params) -> LoRMClient:
    _, client = runtime.programs()
    assert isinstance(client, LoRMClient)
    client.params = client.params.model_copy(update=params)
    return client


def client_grams(runtime: Runtime, client: LoRMClient, seed: int = 0) -> dict[str, torch.Tensor]:
    server, _ = runtime.programs()
    server.begin_stage(0)
    state = server.model.get_state()
    client.model.set_state(state)
    data = LabeledSubset.of(runtime.dataset.train, list(range(0, 40, 2)), torch.arange(6))
    ctx = ClientContext(0, 0, 0, Record(), data, seed, torch.device("cpu"))
    return client.grams(client.model, Message(dict(state)), ctx)


def test_gram_images_train_pass_the_data_through_the_training_augmentation(runtime: Runtime) -> None:
    """`gram_images: train` (the code): the Grams see the client's augmentation, drawn from its own seed; with no
    augmentation they are the eval Grams. `gram_passes` (the code's `regmean_rounds`) adds passes."""
    base = client_grams(runtime, lorm_client(runtime))
    none = client_grams(runtime, lorm_client(runtime, gram_images="train", augment="none"))
    flip = client_grams(runtime, lorm_client(runtime, gram_images="train", augment="flip"))
    flip_again = client_grams(runtime, lorm_client(runtime, gram_images="train", augment="flip"))
    flip_other = client_grams(runtime, lorm_client(runtime, gram_images="train", augment="flip"), seed=1)
    for k in base:
        assert torch.allclose(none[k], base[k], rtol=1e-6), k
        assert torch.equal(flip[k], flip_again[k]), k  # a function of the client's seed
    assert any(not torch.allclose(flip[k], base[k], rtol=1e-3) for k in base)  # flipped images: other Grams
    assert any(not torch.equal(flip[k], flip_other[k]) for k in base)  # another seed, other flips
    twice = client_grams(runtime, lorm_client(runtime, gram_passes=2))
    for k in base:  # the eval transform: a second pass adds the same Gram again
        assert torch.allclose(twice[k], 2 * base[k], rtol=1e-5), k


def test_weight_decay_default_leaves_the_old_tasks_head_rows_alone(runtime: Runtime) -> None:
    """`weight_decay` 0 (every released command): training task 1 leaves task 0's head rows (no gradient under the
    current-task CE) where they were; the code's default 0.1 shrinks them through AdamW's decoupled decay."""
    assert LoRMParams().weight_decay == 0.0
    server, _ = runtime.programs()
    server.begin_stage(1)
    state = server.model.get_state()
    state["head.weight"] = torch.randn(state["head.weight"].shape, generator=torch.Generator().manual_seed(0))
    old = torch.tensor(runtime.scenario.label_space.tasks[0].logits)
    data = LabeledSubset.of(runtime.dataset.train, runtime.scenario.client_indices(1, 0)[:16],
                            runtime.scenario.label_space.class_to_logit)  # fmt: skip
    moved = {}
    for wd in (0.0, 0.1):
        client = lorm_client(runtime, weight_decay=wd, local_epochs=1)
        ctx = ClientContext(0, 1, 0, Record(), data, 0, torch.device("cpu"), 1)
        reply = client.handle(Message(dict(state), {"factor": "B", "task": 1, "round": 0}, kind="train"), ctx)
        moved[wd] = float((reply.tensors["head.weight"][old] - state["head.weight"][old]).abs().max())
    assert moved[0.0] == 0.0 and moved[0.1] > 0


def test_lr_a_and_lr_b_give_the_rounds_factor_its_own_lr(runtime: Runtime) -> None:
    """`lr_b` / `lr_a` (the code's `--lr_B` / `--lr_A`) set the trained factor's lr and leave the head at `lr`:
    at lr_b 0 a B round leaves B where it was while the head trains; unset, B trains at `lr`."""
    server, _ = runtime.programs()
    server.begin_stage(0)
    state = server.model.get_state()
    data = LabeledSubset.of(runtime.dataset.train, runtime.scenario.client_indices(0, 0)[:16],
                            runtime.scenario.label_space.class_to_logit)  # fmt: skip
    moved = {}
    for key, lrs in (("default", {}), ("lr_b 0", {"lr_b": 0.0}), ("lr_a 0", {"lr_a": 0.0})):
        client = lorm_client(runtime, local_epochs=1, **lrs)
        ctx = ClientContext(0, 0, 0, Record(), data, 0, torch.device("cpu"), 0)
        reply = client.handle(Message(dict(state), {"factor": "B", "task": 0, "round": 0}, kind="train"), ctx)
        b = [k for k in reply.tensors if k.startswith("prompt.b.")]
        moved[key] = (
            max(float((reply.tensors[k] - state[k]).abs().max()) for k in b),
            float((reply.tensors["head.weight"] - state["head.weight"]).abs().max()),
        )
    assert moved["default"][0] > 0 and moved["default"][1] > 0
    assert moved["lr_b 0"][0] == 0.0 and moved["lr_b 0"][1] > 0  # the factor frozen by its lr, the head trained
    assert moved["lr_a 0"] == moved["default"]  # lr_a acts only in A rounds


@pytest.mark.parametrize("round_eval", ["merged", "running_mean"])
def test_round_eval_before_a_tasks_end(runtime: Runtime, round_eval: str) -> None:
    """Before task 1 ends, `merged` evaluates task 0's merge alone (the current module not yet in it) and
    `running_mean` the code's filler W0 + (B0·A0 + B1·A1) / 2; after the task's merge both evaluate the merge."""
    server, _ = runtime.programs()
    server.params = server.params.model_copy(update={"round_eval": round_eval})
    gen = torch.Generator().manual_seed(5)
    sites = [site_key(s) for s in server.adapter.sites]
    d = runtime.env.backbone.embed_dim
    modules: list[dict[str, torch.Tensor]] = []
    merged0: dict[str, torch.Tensor] = {}  # task 0's merge, set after its end
    for task in range(2):
        server.begin_stage(task)
        state = server.model.get_state()
        for k in sites:
            state[f"prompt.b.{k}"] = torch.randn(state[f"prompt.b.{k}"].shape, generator=gen) * 0.1
        server.model.set_state(state)
        modules.append({k: state[f"prompt.b.{k}"].double() @ state[f"prompt.a.{k}"].double() for k in sites})
        if task == 1:  # mid-task: what every-round evaluation sees
            evaluated = {site_key(s): dl.dense().double() for s, dl in server.global_model().prompt.fixed.items()}
            for k in sites:
                want = (modules[0][k] + modules[1][k]) / 2 if round_eval == "running_mean" else merged0[k]
                assert torch.allclose(evaluated[k], want, atol=1e-5), k
        n_in = {k: state[f"prompt.a.{k}"].shape[1] for k in sites}
        xs = {k: torch.randn(n_in[k] + 3, n_in[k], generator=gen) for k in sites}
        reply = Message({**{GRAM + k: (x.T @ x).float() for k, x in xs.items()}, GRAM + "head": torch.eye(d)},
                        {"num_samples": 5})  # fmt: skip
        server.merge_task(ScriptedGrid({0: reply}), RoundInfo(task, 1, (0,)))
        if task == 0:
            merged0 = {site_key(s): dl.dense().double() for s, dl in server.merged_deltas().items()}
    after = {site_key(s): dl.dense().double() for s, dl in server.global_model().prompt.fixed.items()}
    final = {site_key(s): dl.dense().double() for s, dl in server.merged_deltas().items()}
    assert all(torch.allclose(after[k], final[k]) for k in sites)  # at the task's end: the merge, either way
    assert not torch.allclose(after[sites[0]], (modules[0][sites[0]] + modules[1][sites[0]]) / 2, atol=1e-5)


def test_no_layers_is_lorms_head_alone() -> None:
    """`layers: []` (the control that ablates LoRM's adapters for a whole run): no LoRA parameter exists, a client
    trains and uploads only the head with its Gram, the server merges the head by RegMean, and the model has no
    prompts to drop (its prompt effect is not applicable, as a head-only control's)."""
    from promptfcl.evaluation.prompt_effect import prompt_effect_applies

    runtime = Runtime.build(tiny_config(method={"name": "lorm", "layers": []}))
    server, client = runtime.programs()
    server.begin_stage(0)
    assert not list(server.model.prompt.parameters()) and not prompt_effect_applies(server.model)
    state = server.model.get_state()
    replies = {}
    for cid in (0, 1):
        data = LabeledSubset.of(runtime.dataset.train, runtime.scenario.client_indices(0, cid)[:16],
                                runtime.scenario.label_space.class_to_logit)  # fmt: skip
        ctx = ClientContext(cid, 0, 0, Record(), data, 0, torch.device("cpu"), 0)
        replies[cid] = client.handle(Message(dict(state), {"factor": "B", "task": 0, "round": 0}, kind="train"), ctx)
        assert set(replies[cid].tensors) == {"head.weight", "head.bias", GRAM + "head"}
        assert float((replies[cid].tensors["head.weight"] - state["head.weight"]).abs().max()) > 0
    server.merge_clients(replies, "B")
    heads, grams = ([r.tensors[k] for r in replies.values()] for k in ("head.weight", GRAM + "head"))
    want = regmean(heads, grams)
    assert torch.allclose(server.model.get_state()["head.weight"], want.to(torch.float32), atol=1e-5)


def test_augmented_grams_run_the_stem_uncached_and_eval_grams_cache_it() -> None:
    """`gram_images: train` with random crops: every image is new, so the Gram pass leaves the hybrid's stem cache
    alone (the stem runs batched); the eval transform repeats its images and fills the cache."""
    cfg = tiny_config(
        method={"name": "lorm", "rank": 1, "layers": [0], "targets": ["qkv"], "augment": "rrc_flip"},
        backbone={"name": "vit_tiny_hybrid_lite0", "img_size": 32, "kwargs": {"patch_size": 1, "depth": 1}},
    )
    hybrid = Runtime.build(cfg)
    cache = hybrid.env.backbone.stem_cache
    assert cache is not None
    cache.store.clear()
    client_grams(hybrid, lorm_client(hybrid, gram_images="train"))
    assert len(cache) == 0
    client_grams(hybrid, lorm_client(hybrid, gram_images="eval"))
    assert len(cache) == 20
