"""Mixed precision (`engine.precision`) and compilation (`engine.compile`) of the frozen backbone, on the CPU."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch import nn

from promptfcl.backbones.precision import LossScaler, compile_problem
from promptfcl.backbones.prompt_spec import PromptSpec
from promptfcl.backbones.vit import build_vit
from promptfcl.config import BackboneConfig, ConfigError, build_config
from promptfcl.experiment import Experiment
from promptfcl.runtime import Runtime, check_config

from .conftest import TINY, tiny_raw

# bf16 keeps 8 mantissa bits: the tiny runs' final accuracies may move by a few test images (48 test images per
# task here, ~2 points each); 10 points is the tolerance these tests state for bf16 against fp32
ACCURACY_TOLERANCE = 10.0


def tiny_backbone(precision: str = "fp32", compile: bool = False):
    b = TINY["backbone"]
    vit = build_vit(BackboneConfig(name=b["name"], img_size=b["img_size"], kwargs=b["kwargs"]))
    vit.configure(precision, compile)
    return vit


def run(tmp_path, name: str, method: dict, precision: str) -> tuple[dict, list[dict]]:
    raw = tiny_raw(method=method, engine={"device": "cpu", "precision": precision})
    run_dir = tmp_path / name
    metrics = Experiment(build_config(raw), run_dir, show_progress=False).run()
    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    return metrics, rounds


@pytest.mark.parametrize(
    "method",
    [
        {"name": "fedavg_prompt", "layers": [0, 1], "local_epochs": 2, "batch_size": 8, "lr": 0.01},
        {"name": "hgp", "layers": [0, 1], "local_epochs": 2, "batch_size": 8, "lr": 0.01},
    ],
    ids=["fedavg_prompt", "hgp"],
)
def test_bf16_run_is_close_to_fp32_and_repeats_exactly(tmp_path, method: dict) -> None:
    fp32, fp32_rounds = run(tmp_path, "fp32", method, "fp32")
    bf16, bf16_rounds = run(tmp_path, "bf16", method, "bf16")
    again, again_rounds = run(tmp_path, "bf16_again", method, "bf16")
    assert bf16["precision"] == "bf16" and fp32["precision"] == "fp32"
    env = json.loads((tmp_path / "bf16" / "environment.json").read_text())
    assert env["engine"]["precision"] == "bf16"
    # same config and seed: the same numbers
    assert again["accuracy_matrix"] == bf16["accuracy_matrix"]
    assert [r["loss"] for r in again_rounds] == [r["loss"] for r in bf16_rounds]
    # bf16 really ran (its training losses are not fp32's) ...
    assert [r["loss"] for r in bf16_rounds] != [r["loss"] for r in fp32_rounds]
    # ... and lands within the stated tolerance of fp32
    assert abs(bf16["summary"]["faa"] - fp32["summary"]["faa"]) <= ACCURACY_TOLERANCE, (
        fp32["summary"],
        bf16["summary"],
    )
    for row32, row16 in zip(fp32["accuracy_matrix"], bf16["accuracy_matrix"], strict=True):
        for a, b in zip(row32, row16, strict=True):
            if a is not None and b is not None:
                assert abs(a - b) <= ACCURACY_TOLERANCE, (fp32["accuracy_matrix"], bf16["accuracy_matrix"])


def test_bf16_backbone_returns_float32_features_close_to_fp32_and_trains_float32_prompts() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    ref, low = tiny_backbone("fp32"), tiny_backbone("bf16")
    prompt = nn.Parameter(torch.randn(1, 4, ref.embed_dim) * 0.1)
    spec = PromptSpec(prefix={0: (prompt, prompt)})
    a, b = ref(x, spec), low(x, spec)
    assert b.dtype == torch.float32
    assert not torch.equal(a, b), "bf16 autocast did not change the computation"
    assert torch.allclose(a, b, rtol=0.1, atol=0.1), float((a - b).abs().max())
    b.sum().backward()
    assert prompt.grad is not None and prompt.grad.dtype == torch.float32 and prompt.dtype == torch.float32


def test_fp16_loss_scaler_steps_on_unscaled_clipped_gradients_and_skips_overflow() -> None:
    w = nn.Parameter(torch.tensor([1.0, -2.0]))
    plain, scaled = LossScaler("fp32", torch.device("cpu")), LossScaler("fp16", torch.device("cpu"))
    assert plain.scaler is None and scaled.scaler is not None and scaled.scaler.get_scale() > 1
    results = []
    for scaler in (plain, scaled):
        p = nn.Parameter(w.detach().clone())
        opt = torch.optim.SGD([p], lr=0.1)
        scaler.backward((p * torch.tensor([3.0, 4.0])).sum())  # gradient (3, 4), norm 5
        scaler.step(opt, [p], 1.0)  # clipped to norm 1: (0.6, 0.8)
        results.append(p.detach().clone())
    assert torch.allclose(results[0], torch.tensor([0.94, -2.08]))
    assert torch.allclose(results[1], results[0]), results  # the scale is undone before clipping and stepping
    p = nn.Parameter(w.detach().clone())  # an overflowing step is skipped and the scale shrinks
    opt, scale = torch.optim.SGD([p], lr=0.1), scaled.scaler.get_scale()
    scaled.backward((p * torch.tensor([float("inf"), 1.0])).sum())
    scaled.step(opt, [p], None)
    assert torch.equal(p.detach(), w.detach()) and scaled.scaler.get_scale() < scale


def test_fp16_on_the_cpu_and_an_unusable_compile_are_refused_with_the_fix(monkeypatch) -> None:
    with pytest.raises(ConfigError, match="engine.precision: fp16 on the CPU .* use engine.precision: bf16"):
        check_config(build_config(tiny_raw(engine={"device": "cpu", "precision": "fp16"})))
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert "C++ compiler" in compile_problem(torch.device("cpu"))
    with pytest.raises(ConfigError, match="engine.compile: torch.compile on the CPU needs a C\\+\\+ compiler"):
        check_config(build_config(tiny_raw(engine={"device": "cpu", "compile": True})))


def test_compiled_backbone_traces_prompted_forwards_and_equals_eager(monkeypatch) -> None:
    # the eager backend checks that torch.compile traces every prompt path (prefix, tokens, no prompt) and gives
    # the eager numbers and gradients, without the minutes the C++ code generation of inductor takes on a CPU
    graphs = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    torch.manual_seed(0)
    x = torch.randn(3, 3, 32, 32)
    eager, compiled = tiny_backbone("fp32"), tiny_backbone("fp32", compile=True)
    tokens = nn.Parameter(torch.randn(1, 2, eager.embed_dim) * 0.1)
    prefix = nn.Parameter(torch.randn(3, 4, eager.embed_dim) * 0.1)
    for spec in (None, PromptSpec(prefix={1: (prefix, prefix)}), PromptSpec(tokens=tokens)):
        a = eager(x, spec)
        b = compiled(x, spec)
        assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())
    compiled(x, PromptSpec(prefix={1: (prefix, prefix)})).sum().backward()
    assert prefix.grad is not None and prefix.grad.abs().sum() > 0
    assert graphs, "the forward was not compiled"
    n = len(graphs)
    eager(x, None)
    assert len(graphs) == n  # an unconfigured backbone stays eager


def test_fp16_local_training_scales_the_loss_and_keeps_float32_parameters(monkeypatch) -> None:
    from promptfcl.data.loader import LabeledSubset
    from promptfcl.data.synthetic import SyntheticOptions, load_synthetic
    from promptfcl.data.transforms import ImageTransform
    from promptfcl.model import PromptedClassifier
    from promptfcl.prompts.prefix import PrefixPrompt
    from promptfcl.training import local

    made = []

    class Spy(LossScaler):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(local, "LossScaler", Spy)
    backbone = tiny_backbone("fp16")  # the config refuses fp16 on the CPU for speed; the mechanism runs here
    model = PromptedClassifier(backbone, 4, PrefixPrompt(backbone.embed_dim, [0], 4))
    ds = load_synthetic(None, SyntheticOptions(num_classes=4, train_per_class=4, image_size=32), False)
    data = LabeledSubset.of(ds.train, torch.arange(len(ds.train)), torch.arange(4))
    p = local.LocalTrainingParams(local_epochs=1, batch_size=8, augment="none")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = local.train_local(model, data, p, torch.ones(4, dtype=torch.bool), ImageTransform(32),
                              torch.Generator().manual_seed(0), torch.device("cpu"))  # fmt: skip
    assert made and made[0].scaler is not None, "fp16 training ran without loss scaling"
    assert torch.isfinite(torch.tensor(stats["loss"]))
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # it stepped


def test_runtime_configures_the_shared_backbone_per_precision() -> None:
    a = Runtime.build(build_config(tiny_raw()))
    b = Runtime.build(build_config(tiny_raw(engine={"device": "cpu", "precision": "bf16"})))
    assert a.env.backbone is not b.env.backbone
    assert (a.env.backbone.precision, b.env.backbone.precision) == ("fp32", "bf16")


def test_bf16_clip_towers_return_float32_close_to_fp32() -> None:
    pytest.importorskip("open_clip")
    from promptfcl.backbones.clip import build_clip

    from .clip_fixtures import TINY_CLIP

    cfg = BackboneConfig(**TINY_CLIP)
    ref, low = build_clip(cfg), build_clip(cfg)
    low.configure("bf16")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    a, b = ref.encode_image(x), low.encode_image(x)
    assert b.dtype == torch.float32 and not torch.equal(a, b)
    assert torch.allclose(a, b, atol=0.05), float((a - b).abs().max())
    tokens = ref.tokenize(["a photo of a cat"])
    emb = ref.token_embeddings(tokens)
    ta, tb = ref.encode_text(emb, tokens), low.encode_text(emb, tokens)
    assert tb.dtype == torch.float32 and torch.allclose(ta, tb, atol=0.05)
