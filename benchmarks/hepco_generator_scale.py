"""Why HePCo's generator fidelity is low: which term of the generator objective takes the labels away.

HePCo's generator (§4.2, Eq. 5) minimises Σ w·CE(φ_c(z), y) − λ_KL·Σ w·KL(φ_c(z) ‖ φ_s(z)) − λ_MSE·Σ w·‖ρ_s(z) −
ρ_c(z)‖² with φ a linear head applied to z directly and ρ the pool's prompts with z as the query. This script
measures how often a teacher classifies the generated latents as the labels they were drawn for (fidelity) on
the evidence study's setting: the hybrid ViT-Tiny's unprompted CIFAR-100 queries of 10 classes (50 images
each), a teacher whose head is fitted to them and a student whose head is not (a fresh init), both with HePCo's
weighted pool (20 components). Objectives: the paper's, CE with each disagreement term alone, CE alone; at the
paper's lr 1e-4 and at 1e-3; fresh generators (4 random streams) trained 0-300 iterations. It also reports the
latents' norm over the real queries' norm (the KL between two linear heads grows with ‖z‖).

    PROMPTFCL_ASSETS=/path/to/assets python benchmarks/hepco_generator_scale.py \
        --out benchmarks/results/hepco_generator_scale.json

Without the assets it runs on random images and a random-init hybrid (the norm growth does not depend on them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from promptfcl.backbones import build_vit
from promptfcl.config import BackboneConfig
from promptfcl.data.transforms import ImageTransform
from promptfcl.methods.hepco import prompt_output
from promptfcl.methods.hepco.latent_generator import LatentGenerator, Teacher, sample_labels, train_generator
from promptfcl.model import PromptedClassifier
from promptfcl.prompts.weighted_pool import WeightedPool

CLASSES, PER_CLASS = 10, 50


def queries() -> tuple[torch.Tensor, torch.Tensor, torch.nn.Module, str]:
    assets = Path(os.environ.get("PROMPTFCL_ASSETS", ""))
    w = assets / "models" / "vit_tiny_hybrid_lite0_112_distilled.safetensors"
    bb = build_vit(BackboneConfig(name="vit_tiny_hybrid_lite0", img_size=112, weights=str(w) if w.is_file() else None))
    if (assets / "cifar-100-python" / "train").is_file():
        from promptfcl.data.cifar import CifarOptions, load_cifar100

        split = load_cifar100(assets / "cifar-100-python", CifarOptions(), False).train
        idx = torch.cat([torch.nonzero(split.targets == c).flatten()[:PER_CLASS] for c in range(CLASSES)])
        x, y, data = split.images[idx], split.targets[idx], "CIFAR-100 classes 0-9, hybrid ViT-Tiny (distilled)"
    else:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (CLASSES * PER_CLASS, 3, 32, 32), generator=g, dtype=torch.uint8)
        y, data = torch.arange(CLASSES).repeat_interleave(PER_CLASS), "random images, random-init hybrid"
    with torch.no_grad():
        z = torch.cat([bb(ImageTransform(112)(x[i : i + 100]), None) for i in range(0, len(x), 100)])
    return z, y, bb, data


def model(bb: torch.nn.Module, seed: int) -> PromptedClassifier:
    torch.manual_seed(seed)
    m = PromptedClassifier(bb, CLASSES, WeightedPool(bb.embed_dim, [0, 1, 2, 3, 4], 20, 20)).eval()
    m.requires_grad_(False)
    return m


def fidelity(g: LatentGenerator, t: PromptedClassifier, hist: torch.Tensor) -> tuple[float, float]:
    """The teacher's accuracy on 500 latents against the labels they were drawn for, and their mean norm."""
    with torch.no_grad():
        y = sample_labels(hist, 500, torch.Generator().manual_seed(123))
        z = g.eval()(y)
        return float((t.head(z).argmax(1) == y).float().mean()), float(z.norm(dim=1).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", default="0,25,100,300")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(1)
    z, y, bb, data = queries()
    teacher, student = model(bb, 0), model(bb, 1)
    opt = torch.optim.Adam(teacher.head.parameters(), lr=1e-2)
    with torch.enable_grad():
        teacher.head.requires_grad_(True)
        for _ in range(300):
            loss = F.cross_entropy(teacher.head(z), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        teacher.head.requires_grad_(False)
    teacher_acc = float((teacher.head(z).argmax(1) == y).float().mean())
    real_norm = float(z.norm(dim=1).mean())
    hist, allowed = torch.ones(CLASSES, dtype=torch.double), torch.ones(CLASSES, dtype=torch.bool)
    t = Teacher(teacher.head, lambda q: prompt_output(teacher, q), torch.ones(CLASSES))
    rows = []
    objectives = {"paper (KL 1, MSE 0.1)": (1.0, 0.1), "CE + KL": (1.0, 0.0), "CE + MSE": (0.0, 0.1), "CE only": (0, 0)}
    for objective, (lam_kl, lam_mse) in objectives.items():
        for lr in (1e-4, 1e-3):
            for iters in [int(i) for i in a.iterations.split(",")]:
                fids, norms = [], []
                for stream in range(a.streams):
                    torch.manual_seed(stream)
                    g = LatentGenerator(CLASSES, bb.embed_dim)
                    train_generator(g, [t], student.head, lambda q: prompt_output(student, q), hist, allowed,
                                    iters, 64, lr, lam_kl, lam_mse, torch.Generator().manual_seed(stream))  # fmt: skip
                    f, n = fidelity(g, teacher, hist)
                    fids.append(f)
                    norms.append(n / real_norm)
                rows.append({"objective": objective, "lr": lr, "iterations": iters, "fidelity": fids,
                             "norm_over_real": norms})  # fmt: skip
                print(
                    f"{objective:22} lr {lr:g} it {iters:4d}: fidelity {statistics.mean(fids):.2f} "
                    f"[{min(fids):.2f}-{max(fids):.2f}], latent norm / real {statistics.mean(norms):.1f}",
                    flush=True,
                )
    result = {"data": data, "teacher_accuracy_on_real_queries": teacher_acc, "real_query_norm": real_norm,
              "chance": 1 / CLASSES, "load_average": os.getloadavg(), "rows": rows}  # fmt: skip
    if a.out:
        a.out.write_text(json.dumps(result, indent=2))
        print(f"written to {a.out}")


if __name__ == "__main__":
    main()
