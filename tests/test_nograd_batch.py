"""The batch of no-grad passes: per device by default (the CPU's measured fastest, elsewhere each pass's own),
`engine.nograd_batch` when set — and a speed setting only: evaluation accuracy is identical and statistics and
Grams agree to float rounding whatever the batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from promptfcl.data.loader import (
    CPU_NOGRAD_BATCH,
    LabeledSubset,
    cpu_nograd_batch,
    nograd_batch,
    set_nograd_batch,
)
from promptfcl.experiment import Experiment
from promptfcl.methods.lorm.gram import input_grams
from promptfcl.runtime import Runtime
from promptfcl.statistics import class_statistics

from .conftest import tiny_config

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "nograd_batch.json"


@pytest.fixture(autouse=True)
def _default_batch():
    set_nograd_batch(None)
    yield
    set_nograd_batch(None)


def test_the_batch_is_per_device_and_thread_count_unless_configured() -> None:
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 8):
            torch.set_num_threads(t)
            want = CPU_NOGRAD_BATCH[min(t, max(CPU_NOGRAD_BATCH))]  # more threads than measured: the largest count
            assert nograd_batch("cpu", 256) == want == nograd_batch(torch.device("cpu"), 128) == cpu_nograd_batch()
    finally:
        torch.set_num_threads(threads)
    assert nograd_batch(torch.device("cuda"), 256) == 256  # an accelerator keeps each pass's own size
    assert nograd_batch("cuda:0", 128) == 128
    set_nograd_batch(5)
    assert nograd_batch("cpu", 256) == 5 == nograd_batch("cuda", 128)
    with pytest.raises(ValueError):
        set_nograd_batch(0)


def test_the_runtime_sets_the_configured_batch_and_the_evaluator_uses_it(tmp_path) -> None:
    exp = Experiment(tiny_config(engine={"device": "cpu", "nograd_batch": 7}), tmp_path, show_progress=False)
    exp.setup(resume=False)
    assert nograd_batch("cpu", 256) == 7 and exp.evaluator.batch_size == 7
    Runtime.build(tiny_config())  # the next run in this process: back to the per-device default
    assert nograd_batch("cpu", 256) == cpu_nograd_batch()


def test_evaluation_accuracy_is_identical_at_any_no_grad_batch(tmp_path) -> None:
    small, large = (
        Experiment(tiny_config(engine={"device": "cpu", "nograd_batch": b}), tmp_path / str(b),
                   show_progress=False).run()
        for b in (3, 256)
    )  # fmt: skip
    assert small["accuracy_matrix"] == large["accuracy_matrix"]
    effect, other = small["prompt_effect"], large["prompt_effect"]
    assert effect.keys() == other.keys()
    for k, v in effect.items():  # counts exactly; means (feature_shift) to float rounding
        assert other[k] == (pytest.approx(v, rel=1e-5) if isinstance(v, float) else v), k


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    return Runtime.build(tiny_config(method={"name": "hgp", "length": 4, "layers": [0, 1]}))


def test_class_statistics_agree_to_float_rounding_at_any_batch(runtime: Runtime) -> None:
    server, _ = runtime.programs()
    model = server.model
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.prompt.parameters():
            p.normal_(0, 0.5)  # a prompted model, so the prompt's path through the batch is exercised
    data = LabeledSubset.of(runtime.dataset.train, list(range(0, 240, 3)), torch.arange(6))
    env = runtime.env

    def stats(batch: int):
        set_nograd_batch(batch)
        return class_statistics(model.features, data, env.eval_transform, env.device, "diag", 2)

    ref = stats(128)
    for batch in (1, 3, 17):
        st = stats(batch)
        assert torch.equal(st.classes, ref.classes) and torch.equal(st.counts, ref.counts)
        assert torch.allclose(st.means, ref.means, rtol=1e-5, atol=1e-5), batch
        assert torch.allclose(st.spread, ref.spread, rtol=1e-5, atol=1e-5), batch


def test_lorm_grams_agree_to_float_rounding_at_any_batch() -> None:
    rt = Runtime.build(tiny_config(method={"name": "lorm", "rank": 2, "layers": [0, 1], "targets": ["qkv", "fc2"]}))
    bb = rt.env.backbone
    modules = {"qkv": bb.vit.blocks[0].attn.qkv, "fc2": bb.vit.blocks[1].mlp.fc2}
    data = LabeledSubset.of(rt.dataset.train, list(range(0, 240, 4)), torch.arange(6))

    def grams(batch: int):
        set_nograd_batch(batch)
        return input_grams(lambda x: bb(x), modules, data, rt.env.eval_transform, rt.device, False)

    ref, ref_head = grams(128)
    for batch in (1, 7):
        g, head = grams(batch)
        assert head is not None and ref_head is not None
        assert torch.allclose(head, ref_head, rtol=1e-5, atol=1e-6), batch
        for k in ref:
            assert torch.allclose(g[k], ref[k], rtol=1e-5, atol=1e-6), (k, batch)


def test_the_cpu_default_is_the_measured_fastest_batch() -> None:
    """`CPU_NOGRAD_BATCH` follows benchmarks/results/nograd_batch.json: at each thread count measured, its batch runs
    the hybrid's forward, without and with prompts, within 10 % of the fastest batch, in wall-clock images/s and in
    images per process-CPU second."""
    if not RESULTS.is_file():
        pytest.skip("benchmarks/results/nograd_batch.json not found")
    measured = json.loads(RESULTS.read_text())
    for table in ("wall_images_per_second", "images_per_cpu_second"):
        rates = measured[table]
        for threads, batch in CPU_NOGRAD_BATCH.items():
            cols = {c: r for c, r in rates.items() if c.endswith(f", {threads} thread{'s' if threads > 1 else ''}")}
            assert len(cols) == 2, (threads, list(rates))
            for col, r in cols.items():
                assert r[str(batch)] >= 0.9 * max(r.values()), (table, col, batch, r)
