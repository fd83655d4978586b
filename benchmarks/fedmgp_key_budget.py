"""Why FedMGP's local keys route test images at chance in the CPU evidence study: how far the keys move.

FedMGP (§4.2, Eq. 10) picks a client's fine local prompt at test time by cosine between the global-prompted query
V(x') and one key per class. In training the prompt is chosen by the label, so the keys get gradient only from the
pull constraint, 1 − cos(V(x'), k_y), and Adam moves every coordinate of a key by about lr per step however small λ2
is. This script replays, for one client of the evidence study (`configs/cpu/evidence/personalized.yaml`, seed 0),
exactly the keys' part of training: its 5 tasks in order, 2 rounds per task, a fresh Adam per round (as the method),
batches (`--batch`, default 16) of the task's own training images, the pull loss of the method's `ClassPrefixPool`
on the real V(x') (the hybrid ViT-Tiny with the study's fused global prompts from a finished run's checkpoint, read
out as the mean of the prompt tokens, as the method). After the last task it measures the test-time hit rate on the
client's local test images of all its tasks (top-1 among the 40 classes of its tasks, `local_select: seen`; chance
2.5 %), the keys' displacement over their U(−1, 1) init, and two ceilings: keys set to the class means of V(x') (the
pull constraint's optimum) and the nearest class mean of the unprompted CLS feature.

Grid: local epochs per round (the study's 2, then 5-100) × lr (the paper's 1e-3, the study's 5e-3) × Adam's
coupled weight decay (the paper's 0; the official code's 1e-3) × the scale of the keys' U(−1, 1) init, 3 key inits
each. The decay and init axes test why the official code's decay routes far better end to end
(results/evidence_v2_personalized_code_wd): coupled decay hands every key row a gradient, Adam normalises it into
lr-sized steps toward zero, so the keys of classes not yet met shrink away before their task arrives and the pull
then sets their direction at once; a small init at decay 0 should do the same if that is the mechanism. Measured
(results/fedmgp_key_budget_v2.json): the small init does (hit 42.3 % against the class-mean ceiling 44.9 %), the
decay does not (24.3 %: it also decays the keys of classes outside the current task to zero).

    PROMPTFCL_ASSETS=/path/to/assets python benchmarks/fedmgp_key_budget.py \\
        --out benchmarks/results/fedmgp_key_budget.json

The v2 personalized study's recipe (batch 4, 5 epochs per phase, lr 1.5e-3, λ2 0.5), on its seed-0 run:

    PROMPTFCL_ASSETS=/path/to/assets python benchmarks/fedmgp_key_budget.py \\
        --config benchmarks/results/evidence_v2_personalized/fedmgp/seed0/config.yaml \\
        --checkpoint benchmarks/results/evidence_v2_personalized/fedmgp/seed0/checkpoint.safetensors \\
        --batch 4 --epochs 5,10,25 --lrs 0.0015 --weight-decays 0,0.001 --init-scales 1,0.01 --select all \\
        --out benchmarks/results/fedmgp_key_budget_v2.json

Needs the assets and the run's final checkpoint (checkpoints are not committed: rerun the study's cell to make it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from promptfcl.config import load_config
from promptfcl.methods.fedmgp.class_prefix import ClassPrefixPool
from promptfcl.runtime import Runtime

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = "checkpoint.safetensors"


@torch.no_grad()
def features(rt: Runtime, model: torch.nn.Module, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """V(x') (the method's local query) and the unprompted CLS feature of train-split images `idx`."""
    split, tf = rt.dataset.train, rt.env.eval_transform
    vx, cls = [], []
    for i in range(0, len(idx), 64):
        x = tf(split.images[torch.as_tensor(idx[i : i + 64])])
        vx.append(model.local_query(x))
        cls.append(rt.env.backbone(x, None))
    return torch.cat(vx), torch.cat(cls)


def hit_rate(keys: torch.Tensor, q: torch.Tensor, y: torch.Tensor, allowed: torch.Tensor) -> float:
    sim = F.normalize(q, dim=1) @ F.normalize(keys, dim=1).T
    sim[:, ~allowed] = float("-inf")
    return 100.0 * float((sim.argmax(1) == y).float().mean())


@dataclass(frozen=True)
class KeyRecipe:
    """How the replay trains the keys: the method's local phase, keys' part only."""

    epochs: int
    lr: float
    weight_decay: float = 0.0  # Adam's coupled decay (torch.optim.Adam's weight_decay), as the official code
    init_scale: float = 1.0  # multiplies the method's U(-1, 1) key init
    batch: int = 16
    rounds: int = 2
    pull_coef: float = 0.5  # λ2 (Adam is scale-free in it only at decay 0)


def train_keys(
    tasks: list[tuple[torch.Tensor, torch.Tensor]], num_classes: int, dim: int, recipe: KeyRecipe, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys' training in the method's order; returns (init, final) keys."""
    torch.manual_seed(seed)
    pool = ClassPrefixPool(dim, num_classes, layers=(2,), length=1)
    with torch.no_grad():
        pool.keys.mul_(recipe.init_scale)
    init = pool.keys.detach().clone()
    g = torch.Generator().manual_seed(seed)
    for q, y in tasks:
        for _ in range(recipe.rounds):
            # fresh per phase per round, as the method; every class's key row is in it, as the method's pool
            opt = torch.optim.Adam([pool.keys], lr=recipe.lr, weight_decay=recipe.weight_decay)
            for _ in range(recipe.epochs):
                order = torch.randperm(len(y), generator=g)
                for b in range(0, len(y), recipe.batch):
                    i = order[b : b + recipe.batch]
                    loss = recipe.pull_coef * pool.pull_loss(q[i], y[i].unsqueeze(1))
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    return init, pool.keys.detach().clone()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/cpu/evidence/personalized.yaml"))
    ap.add_argument("--checkpoint", default=str(ROOT / "benchmarks/results/evidence_cpu/fedmgp/seed0" / CHECKPOINT))
    ap.add_argument("--client", type=int, default=0)
    ap.add_argument("--epochs", default="2,5,10,25,100")
    ap.add_argument("--lrs", default="0.001,0.005")
    ap.add_argument("--weight-decays", default="0", help="Adam's coupled weight decay values (comma-separated)")
    ap.add_argument("--init-scales", default="1", help="multipliers of the keys' U(-1, 1) init (comma-separated)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="rounds per task")
    ap.add_argument("--pull-coef", type=float, default=0.5, help="λ2, the pull term's weight")
    ap.add_argument("--select", choices=("seen", "all"), default="seen", help="keys competing at test (local_select)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/fedmgp_key_budget.json"))
    args = ap.parse_args()
    load_before = os.getloadavg()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t0 = time.perf_counter()
    rt = Runtime.build(load_config(args.config))
    s, k = rt.scenario, args.client
    _, client = rt.programs()
    model = client.new_model().eval()
    ckpt = load_file(args.checkpoint)
    model.load_state_dict({n[len("server/") :]: t for n, t in ckpt.items() if n.startswith("server/global_pool.")},
                          strict=False)  # fmt: skip
    targets = rt.dataset.train.targets.numpy()
    space = s.label_space
    to_logit = {c: j for t in space.tasks for c, j in zip(t.classes, t.logits, strict=True)}
    tasks, test_q, test_cls, test_y, train_cls, train_y = [], [], [], [], [], []
    for t in range(s.num_tasks):
        idx, test_idx = s.client_train[t][k], s.client_test[t][k]
        q, cls = features(rt, model, idx)
        y = torch.tensor([to_logit[int(c)] for c in targets[idx]])
        tasks.append((q, y))
        train_cls.append(cls), train_y.append(y)
        tq, tcls = features(rt, model, test_idx)
        test_q.append(tq), test_cls.append(tcls)
        test_y.append(torch.tensor([to_logit[int(c)] for c in targets[test_idx]]))
    tq, ty = torch.cat(test_q), torch.cat(test_y)
    allowed = torch.zeros(space.num_logits, dtype=torch.bool)  # every class of its tasks (`local_select: seen`)
    allowed[[to_logit[c] for t in s.client_tasks[k] for c in t]] = True
    if args.select == "all":  # every key of the pool (`local_select: all`, the official code's)
        allowed[:] = True
    dim = tq.shape[1]
    out: dict = {
        "config": os.path.relpath(args.config, ROOT),
        "client": k,
        "classes": int(allowed.sum()),
        "select": args.select,
        "chance": 100.0 / int(allowed.sum()),
        "train_images_per_task": [len(y) for _, y in tasks],
        "test_images": len(ty),
        "seconds_features": time.perf_counter() - t0,
    }
    # ceilings: keys at the class means of V(x') (the pull optimum), NCM on the unprompted CLS feature
    qs, ys = torch.cat([q for q, _ in tasks]), torch.cat([y for _, y in tasks])
    means = torch.zeros(space.num_logits, dim)
    for c in ys.unique():
        means[c] = F.normalize(qs[ys == c], dim=1).mean(0)
    out["hit_class_mean_keys"] = hit_rate(means, tq, ty, allowed)
    cls_means = torch.zeros(space.num_logits, dim)
    cs = torch.cat(train_cls)
    for c in ys.unique():
        cls_means[c] = F.normalize(cs[ys == c], dim=1).mean(0)
    out["ncm_unprompted_cls"] = hit_rate(cls_means, torch.cat(test_cls), ty, allowed)
    print(f"client {k}: {out['classes']} classes, chance {out['chance']:.1f} %, {len(ty)} test images")
    print(
        f"ceilings: class-mean keys on V(x') {out['hit_class_mean_keys']:.1f} %, "
        f"NCM on CLS {out['ncm_unprompted_cls']:.1f} %"
    )
    rows = []
    grid = itertools.product(
        [float(v) for v in args.lrs.split(",")],
        [int(v) for v in args.epochs.split(",")],
        [float(v) for v in args.weight_decays.split(",")],
        [float(v) for v in args.init_scales.split(",")],
    )
    for lr, epochs, wd, scale in grid:
        recipe = KeyRecipe(epochs, lr, wd, scale, args.batch, args.rounds, args.pull_coef)
        hits, moves, cos_mean = [], [], []
        for seed in range(args.seeds):
            init, keys = train_keys(tasks, space.num_logits, dim, recipe, seed)
            hits.append(hit_rate(keys, tq, ty, allowed))
            trained = torch.zeros_like(allowed)
            trained[ys.unique()] = True
            moves.append(float(((keys - init)[trained].norm(dim=1) / init[trained].norm(dim=1)).mean()))
            cos_mean.append(float(F.cosine_similarity(keys[trained], means[trained]).mean()))
        steps = sum(recipe.rounds * epochs * -(-len(y) // recipe.batch) for _, y in tasks) // len(tasks)
        row = {**asdict(recipe), "steps_per_task": steps, "hit": hits,
               "displacement_over_init": moves, "cos_to_class_mean": cos_mean}  # fmt: skip
        rows.append(row)
        print(
            f"lr {lr:g} epochs {epochs:>3} wd {wd:g} init x{scale:g} ({steps:>4} steps/task): "
            f"hit {statistics.mean(hits):5.1f} % "
            f"(seeds {', '.join(f'{h:.1f}' for h in hits)}), |k - k0| / |k0| {statistics.mean(moves):.3f}, "
            f"cos(k, class mean) {statistics.mean(cos_mean):.3f}",
            flush=True,
        )
    out["rows"] = rows
    out["loadavg_before"], out["loadavg_after"] = list(load_before), list(os.getloadavg())
    out["seconds"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"written to {args.out} ({out['seconds']:.0f} s, load {out['loadavg_before']} -> {out['loadavg_after']})")


if __name__ == "__main__":
    main()
