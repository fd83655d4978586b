"""Claims: paired differences over seeds with a Student-t interval, statuses, and the study's frozen-probe row."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from promptfcl.claims import Control, claims_markdown, evaluate_claim, load_claims
from promptfcl.cli import main
from promptfcl.config import ConfigError
from promptfcl.statistics.paired import paired_difference

from .conftest import tiny_raw


def test_paired_difference_matches_a_hand_computed_interval() -> None:
    # d = (2, 3, 2): mean 7/3, s = sqrt(1/3), se = 1/3, t_{0.975, 2} = 4.302653 → half width 1.434218
    d = paired_difference({0: 3.0, 1: 5.0, 2: 4.0, 9: 1.0}, {0: 1.0, 1: 2.0, 2: 2.0})  # seed 9 is unpaired
    assert d.seeds == [0, 1, 2] and d.differences == [2.0, 3.0, 2.0] and d.positive == 3
    assert d.mean == pytest.approx(7 / 3)
    assert d.low == pytest.approx(7 / 3 - 1.434218, abs=1e-6) and d.high == pytest.approx(7 / 3 + 1.434218, abs=1e-6)
    five = paired_difference({s: s + 1.0 for s in range(5)}, {s: 0.0 for s in range(5)})  # d = 1..5, s = sqrt(2.5)
    assert five.high - five.mean == pytest.approx(2.7764 * 2.5**0.5 / 5**0.5, abs=1e-3)  # t_{0.975, 4} = 2.7764
    with pytest.raises(ValueError, match="at least 2"):
        paired_difference({0: 1.0}, {0: 0.0})


def run_dirs(study, cell: str, seeds, commit: str = "abc123", dirty: bool = False, helps: tuple | None = None) -> None:
    """A cell's run directories as a study leaves them: scenario, environment (git) and, with `helps` = (gained,
    lost), a metrics.json whose prompt_mechanism check has those paired counts."""
    for seed in seeds:
        d = study / cell / f"seed{seed}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "scenario.json").write_text(json.dumps({"seed": seed}))
        (d / "environment.json").write_text(json.dumps({"git": {"commit": commit, "dirty": dirty}}))
        if helps is not None:
            checks = [{"name": "prompt_mechanism", "passed": True, "verdict": "?"}]
            effect = {"gained": helps[0], "lost": helps[1]}
            (d / "metrics.json").write_text(json.dumps({"validity": {"checks": checks}, "prompt_effect": effect}))


def _summary(tmp_path, a: list[float], b: list[float], invalid: dict | None = None, **claim) -> None:
    rows = [
        {"cell": "new", "per_seed": {str(s): {"faa": v} for s, v in enumerate(a)}, "invalid": invalid or {}},
        {"cell": "old", "per_seed": {str(s): {"faa": v} for s, v in enumerate(b)}, "invalid": {}},
    ]
    (tmp_path / "study").mkdir(exist_ok=True)
    (tmp_path / "study" / "summary.json").write_text(json.dumps({"rows": rows}))
    for cell, values in (("new", a), ("old", b)):
        run_dirs(tmp_path / "study", cell, range(len(values)))
    base = {"id": "c", "paper": "P, Table 1", "study": "study", "better": "new", "worse": "old"}
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump({"claims": [{**base, **claim}]}))


@pytest.mark.parametrize(
    ("a", "b", "invalid", "claim", "status"),
    [
        ([5, 6, 7, 6, 5], [1, 2, 2, 1, 3], None, {}, "reproduced"),
        ([5, 6, 7, 6, 5], [1, 2, 2, 1, 3], None, {"paper_delta": 4.0}, "reproduced, margin within the paper's"),
        ([5, 6, 7, 6, 5], [1, 2, 2, 1, 3], None, {"paper_delta": 1.0}, "reproduced, margin above the paper's"),
        ([5, 6, 7, 6, 5], [1, 2, 2, 1, 3], None, {"paper_delta": 9.0}, "reproduced, margin below the paper's"),
        ([1, 2, 2, 1, 3], [5, 6, 7, 6, 5], None, {}, "not reproduced"),
        ([5, 1, 6, 2, 4], [3, 4, 3, 4, 3], None, {}, "inconclusive"),
        ([5, 6, 7], [1, 2, 2], None, {}, "inconclusive"),  # 3 seeds < min_seeds 5
        ([5, 6, 7, 6, 5], [1, 2, 2, 1, 3], {"2": ["client_loss"]}, {}, "invalid"),  # 4 valid seeds < 5
        ([5, 6, 7, 6, 5, 6], [1, 2, 2, 1, 3, 2], {"2": ["client_loss"]}, {}, "reproduced"),  # 5 valid seeds
        ([5, 6, 7, 6, 5, 6], [1, 2, 30, 1, 3, 2], {"2": ["client_loss"]}, {}, "inconclusive"),  # holds only without 2
    ],
)
def test_claim_status(tmp_path, a, b, invalid, claim, status) -> None:
    _summary(tmp_path, a, b, invalid, **claim)
    claims, base = load_claims(tmp_path / "claims.yaml")
    result = evaluate_claim(claims.claims[0], base, claims.min_seeds)
    assert result["status"] == status
    text = claims_markdown(claims, base, "claims.yaml")
    assert f"**{status}**" in text and "`new` vs `old`" in text
    if invalid:
        assert "seed 2 failed the validity gate: client_loss" in text
        if len(a) > 5:  # verdict on the 5 seeds both cells pass, seed 2 named and put back as a sensitivity check
            assert result["difference"].seeds == [0, 1, 3, 4, 5] and "failed the gate put back (2)" in text
        if status == "inconclusive":
            assert "holds only without the seeds that failed the gate" in result["reason"]
    for name in ("reproduced, margin within the paper's", "not reproduced", "inconclusive", "invalid"):
        assert f"- **{name}**: " in text  # the page defines its statuses


@pytest.mark.parametrize(
    ("failed", "budget_limit", "status"),
    [
        (["client_loss", "learned_tasks"], "10 rounds per task need 10 h", "inconclusive"),
        (["client_loss", "learned_tasks"], None, "invalid"),  # more rounds could still fix it: run them
        (["key_hit"], "10 rounds per task need 10 h", "invalid"),  # a mechanism inactive is not a budget question
        (["client_loss", "lcdc_mechanism"], "10 rounds per task need 10 h", "invalid"),
    ],
)
def test_a_failure_to_learn_at_the_budget_that_fits_is_inconclusive_only_when_declared(
    tmp_path, failed, budget_limit, status
) -> None:
    _summary(tmp_path, [5, 6, 7, 6, 5], [1, 2, 2, 1, 3], {"2": failed}, budget_limit=budget_limit)
    claims, base = load_claims(tmp_path / "claims.yaml")
    result = evaluate_claim(claims.claims[0], base, claims.min_seeds)
    assert result["status"] == status
    assert "4 paired seeds pass the validity gate" in result["reason"]
    assert ("largest budget that fits here" in result["reason"]) == (status == "inconclusive")


def test_paired_runs_must_come_from_one_clean_commit(tmp_path) -> None:
    _summary(tmp_path, [5, 6, 7, 6, 5], [1, 2, 2, 1, 3])
    run_dirs(tmp_path / "study", "old", [3], commit="def456", dirty=True)
    claims, base = load_claims(tmp_path / "claims.yaml")
    result = evaluate_claim(claims.claims[0], base)
    assert result["status"] == "invalid"
    assert "2 code version(s) over 2 commit(s) and 1 run(s) with uncommitted changes" in result["reason"]
    claims.claims[0].provenance_note = "seed 3 of old changed only the docs"
    assert evaluate_claim(claims.claims[0], base)["status"] == "reproduced"
    claims.claims[0].provenance_note = None  # a failed seed whose return would flip the verdict: still invalid
    _summary(tmp_path, [5, 6, 7, 6, 5, 6], [1, 2, 30, 1, 3, 2], {"2": ["client_loss"]})
    run_dirs(tmp_path / "study", "old", [3], commit="def456", dirty=True)
    assert evaluate_claim(claims.claims[0], base)["status"] == "invalid"


def test_commits_with_identical_code_are_one_provenance(tmp_path) -> None:
    """Two commits that differ only outside the code (a study's seed list) count as one code version; a commit that
    changes `promptfcl/` does not."""
    import subprocess

    def git(*args: str) -> str:
        who = {
            f"GIT_{role}_{key}": value
            for role in ("AUTHOR", "COMMITTER")
            for key, value in (("NAME", "t"), ("EMAIL", "t@t"))
        }
        run = subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True,
                             env={**os.environ, **who})  # fmt: skip
        return run.stdout.strip()

    git("init", "-q")
    for path, text in (("promptfcl/m.py", "x = 1\n"), ("configs/c.yaml", "a: 1\n"), ("study.yaml", "seeds: [0]\n")):
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text(text)
    git("add", "-A")
    git("commit", "-qm", "first")
    first = git("rev-parse", "HEAD")
    (tmp_path / "study.yaml").write_text("seeds: [0, 1]\n")
    git("commit", "-qam", "a seed more")
    same_code = git("rev-parse", "HEAD")
    (tmp_path / "promptfcl/m.py").write_text("x = 2\n")
    git("commit", "-qam", "code change")
    other_code = git("rev-parse", "HEAD")
    _summary(tmp_path, [5, 6, 7, 6, 5], [1, 2, 2, 1, 3])
    run_dirs(tmp_path / "study", "new", range(5), commit=first)
    run_dirs(tmp_path / "study", "old", range(5), commit=first)
    run_dirs(tmp_path / "study", "old", [4], commit=same_code)
    claims, base = load_claims(tmp_path / "claims.yaml")
    result = evaluate_claim(claims.claims[0], base)
    assert result["status"] == "reproduced" and len(result["provenance"]["commits"]) == 2
    run_dirs(tmp_path / "study", "old", [4], commit=other_code)
    result = evaluate_claim(claims.claims[0], base)
    assert result["status"] == "invalid" and "2 code version(s) over 2 commit(s)" in result["reason"]


def test_a_claim_is_not_reproduced_on_an_idle_mechanism_or_an_inert_peer(tmp_path) -> None:
    """The ordering holds, but the worse cell's prompt is neutral (pooled McNemar), or the worse cell does not beat
    its own head-only control: inconclusive, with the reason."""
    _summary(tmp_path, [5, 6, 7, 6, 5], [1, 2, 2, 1, 3])
    run_dirs(tmp_path / "study", "old", range(5), helps=(10, 9))  # pooled 50 vs 45: neutral
    claims, base = load_claims(tmp_path / "claims.yaml")
    result = evaluate_claim(claims.claims[0], base)
    assert result["status"] == "inconclusive" and "old's prompt_mechanism is neutral" in result["reason"]
    run_dirs(tmp_path / "study", "old", range(5), helps=(30, 5))
    assert evaluate_claim(claims.claims[0], base)["status"] == "reproduced"
    rows = json.loads((tmp_path / "study" / "summary.json").read_text())["rows"]
    rows.append({"cell": "head", "per_seed": {str(s): {"faa": v} for s, v in enumerate([1, 2, 3, 1, 2])},
                 "invalid": {}})  # fmt: skip
    (tmp_path / "study" / "summary.json").write_text(json.dumps({"rows": rows}))
    run_dirs(tmp_path / "study", "head", range(5))
    claims.claims[0].controls = [Control(study="study", cell="head", role="head_only")]
    result = evaluate_claim(claims.claims[0], base)
    assert result["status"] == "inconclusive" and "does not beat its head-only control" in result["reason"]


def test_a_run_level_ablation_decides_its_mechanisms_verdict(tmp_path) -> None:
    """A control that switches the better cell's mechanism off for the whole run (`ablates`) decides that
    mechanism's verdict from the paired run-level difference, in place of the in-run McNemar one: an in-run
    neutral mechanism whose run-level ablation loses on every seed helps; an ablation that scores as well as the
    cell leaves it neutral, so the claim is not reproduced; the ablated run's seeds count when it fails to learn
    (the mechanism's effect) but not when it did not train (`ABLATION_INTEGRITY`)."""
    _summary(tmp_path, [5, 6, 7, 6, 5], [1, 2, 2, 1, 3])
    run_dirs(tmp_path / "study", "new", range(5), helps=(10, 9))  # in-run: neutral
    rows = json.loads((tmp_path / "study" / "summary.json").read_text())["rows"]

    def ablated(values, invalid=None) -> None:
        row = {"cell": "off", "per_seed": {str(s): {"faa": v} for s, v in enumerate(values)}, "invalid": invalid or {}}
        (tmp_path / "study" / "summary.json").write_text(json.dumps({"rows": [*rows, row]}))

    ablated([2, 3, 3, 2, 3], {"1": ["learned_tasks", "prompt_mechanism"], "3": ["parameters_moved"]})
    run_dirs(tmp_path / "study", "off", range(5))
    claims, base = load_claims(tmp_path / "claims.yaml")
    assert evaluate_claim(claims.claims[0], base)["status"] == "inconclusive"  # no run-level control: neutral
    claims.claims[0].controls = [Control(study="study", cell="off", ablates="new:prompt_mechanism")]
    result = evaluate_claim(claims.claims[0], base)
    verdict = result["mechanisms"]["new"]["prompt_mechanism"]
    assert verdict["verdict"] == "helps" and verdict["in_run"] == "neutral"
    assert verdict["run_level"].seeds == [0, 1, 2, 4]  # seed 1 failed to learn without it; seed 3 did not train
    assert result["status"] == "reproduced"
    page = claims_markdown(claims, base, "claims.yaml")
    assert "`new` prompt_mechanism: **helps** at run level (− `off`: +3.00" in page
    assert "control `off` seeds 1: learned_tasks, prompt_mechanism failed, outcomes of the switched-off" in page
    ablated([5, 7, 6, 6, 5])  # the switched-off run does as well: the mechanism did not help
    result = evaluate_claim(claims.claims[0], base)
    assert result["status"] == "inconclusive" and "new's prompt_mechanism is neutral at run level" in result["reason"]
    claims.claims[0].controls = [Control(study="study", cell="off", ablates="other:prompt_mechanism")]
    with pytest.raises(ConfigError, match="neither of the claim's cells"):
        evaluate_claim(claims.claims[0], base)
    with pytest.raises(ValueError, match="list the cell twice"):  # a floor must learn; an ablation need not
        Control(study="study", cell="off", role="head_only", ablates="new:prompt_mechanism")


def test_an_ablated_mechanism_the_runs_do_not_check_takes_its_in_run_counts_from_their_measurement(tmp_path) -> None:
    """A claim may ablate a component its method declares no mechanism check for (PILoRA's LoRA): the in-run
    verdict shown beside the run-level one then pools the runs' own measurement of it (their prompt effect), and
    without that control the component is no requirement of the claim."""
    _summary(tmp_path, [5, 6, 7, 6, 5], [1, 2, 2, 1, 3])
    for seed in range(5):
        metrics = {"validity": {"checks": [{"name": "prompt_benefit", "passed": True}]},
                   "prompt_effect": {"gained": 10, "lost": 2}}  # fmt: skip
        (tmp_path / "study" / "new" / f"seed{seed}" / "metrics.json").write_text(json.dumps(metrics))
    rows = json.loads((tmp_path / "study" / "summary.json").read_text())["rows"]
    off = {"cell": "off", "per_seed": {str(s): {"faa": v} for s, v in enumerate([2, 3, 3, 2, 3])}, "invalid": {}}
    (tmp_path / "study" / "summary.json").write_text(json.dumps({"rows": [*rows, off]}))
    run_dirs(tmp_path / "study", "off", range(5))
    claims, base = load_claims(tmp_path / "claims.yaml")
    assert "prompt_mechanism" not in evaluate_claim(claims.claims[0], base)["mechanisms"]["new"]
    claims.claims[0].controls = [Control(study="study", cell="off", ablates="new:prompt_mechanism")]
    verdict = evaluate_claim(claims.claims[0], base)["mechanisms"]["new"]["prompt_mechanism"]
    assert (verdict["gained"], verdict["lost"], verdict["in_run"]) == (50, 10, "helps")
    assert verdict["verdict"] == "helps" and verdict["run_level"].seeds == [0, 1, 2, 3, 4]
    claims.claims[0].controls = [Control(study="study", cell="off", ablates="new:lcdc_mechanism")]  # nothing in-run
    page = claims_markdown(claims, base, "claims.yaml")
    assert "`new` lcdc_mechanism: **helps** at run level (− `off`: +3.20 [" in page
    assert "; no in-run ablation)." in page and "in-run not measured" not in page


def test_a_head_only_control_counts_prompt_free_seeds_and_must_have_valid_ones(tmp_path) -> None:
    """role head_only: a prompt-free seed failing only a mechanism check counts as valid; a learning failure does
    not; a failing seed whose model has prompts is refused; with fewer than two valid seeds the floor is not shown,
    so the claim is not reproduced."""
    _summary(tmp_path, [5, 6, 7, 6, 5], [2, 3, 3, 2, 4])
    run_dirs(tmp_path / "study", "old", range(5), helps=(30, 5))
    rows = json.loads((tmp_path / "study" / "summary.json").read_text())["rows"]
    invalid = {"0": ["prompt_mechanism"], "1": ["prompt_mechanism"], "2": ["client_loss", "prompt_mechanism"]}
    rows.append({"cell": "head", "per_seed": {str(s): {"faa": v} for s, v in enumerate([1, 2, 2, 1, 2])},
                 "invalid": invalid})  # fmt: skip
    (tmp_path / "study" / "summary.json").write_text(json.dumps({"rows": rows}))
    run_dirs(tmp_path / "study", "head", range(5))

    def prompts(seeds, applicable: bool) -> None:
        for seed in seeds:
            metrics = {"validity": {"checks": []}, "prompt_effect": {"applicable": applicable}}
            (tmp_path / "study" / "head" / f"seed{seed}" / "metrics.json").write_text(json.dumps(metrics))

    prompts(range(5), False)
    claims, base = load_claims(tmp_path / "claims.yaml")
    claims.claims[0].controls = [Control(study="study", cell="head", role="head_only")]
    result = evaluate_claim(claims.claims[0], base)
    (control,) = result["controls"]
    assert control["failed"] == {2: ["client_loss", "prompt_mechanism"]}
    assert control["expected"] == {0: ["prompt_mechanism"], 1: ["prompt_mechanism"]}
    assert result["status"].startswith("reproduced") and result["worse_over_head_only"].seeds == [0, 1, 3, 4]
    prompts([1], True)
    with pytest.raises(ConfigError, match="head seed 1 has prompts"):
        evaluate_claim(claims.claims[0], base)
    prompts([1], False)
    rows[-1]["invalid"] = {str(s): ["client_loss"] for s in range(4)}
    (tmp_path / "study" / "summary.json").write_text(json.dumps({"rows": rows}))
    result = evaluate_claim(claims.claims[0], base)
    assert result["status"] == "inconclusive" and "fewer than two seeds valid" in result["reason"]


def test_a_claim_that_cannot_be_evidenced_here_is_invalid_with_its_reason(tmp_path) -> None:
    (tmp_path / "claims.yaml").write_text(
        yaml.safe_dump(
            {
                "claims": [
                    {
                        "id": "capt",
                        "paper": "CAPT",
                        "better": "capt",
                        "worse": "maple",
                        "unavailable": "no pretrained CLIP text tower",
                    }
                ]
            }
        )  # fmt: skip
    )
    claims, base = load_claims(tmp_path / "claims.yaml")
    assert evaluate_claim(claims.claims[0], base)["status"] == "invalid"
    assert "Invalid because: no pretrained CLIP text tower." in claims_markdown(claims, base, "c.yaml")


def test_worse_study_pairs_across_studies_and_refuses_different_scenarios(tmp_path) -> None:
    for study, cell, values in (("head", "new", [5, 6, 7, 6, 5]), ("peers", "old", [1, 2, 2, 1, 3])):
        rows = [{"cell": cell, "per_seed": {str(s): {"faa": v} for s, v in enumerate(values)}, "invalid": {}}]
        (tmp_path / study).mkdir()
        (tmp_path / study / "summary.json").write_text(json.dumps({"rows": rows}))
        run_dirs(tmp_path / study, cell, range(5))
    claim = {"id": "c", "paper": "P", "study": "head", "worse_study": "peers", "better": "new", "worse": "old"}
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump({"claims": [claim]}))
    claims, base = load_claims(tmp_path / "claims.yaml")
    result = evaluate_claim(claims.claims[0], base)
    assert result["status"] == "reproduced" and result["difference"].differences == [4, 4, 5, 5, 2]
    assert "`old` from `peers`" in claims_markdown(claims, base, "claims.yaml")
    (tmp_path / "peers" / "old" / "seed3" / "scenario.json").write_text(json.dumps({"seed": 99}))
    with pytest.raises(ConfigError, match="seed 3 .* ran different scenarios"):
        evaluate_claim(claims.claims[0], base)


def test_controls_are_shown_beside_the_pair_with_the_better_cells_paired_lead(tmp_path) -> None:
    """A control cell from another study (same scenarios) gets its mean ± sd, valid seeds and `better` − control
    paired over seeds with its t interval; a control on another metric (the probe row) gets its mean only."""
    studies = {"head": {"new": [5, 6, 7, 6, 5], "old": [1, 2, 2, 1, 3]}, "ctl": {"head_only": [4, 4, 4, 4, 4]}}
    for study, cells in studies.items():
        rows = [{"cell": c, "per_seed": {str(s): {"faa": v} for s, v in enumerate(vals)}, "invalid": {}}
                for c, vals in cells.items()]  # fmt: skip
        if study == "ctl":
            rows[0]["invalid"] = {"2": ["client_loss"]}
            rows.append({"cell": "probe", "per_seed": {"0": {"probe_linear": 40.0}, "1": {"probe_linear": 42.0}},
                         "invalid": {}, "upper_bound": "frozen_probe"})  # fmt: skip
        (tmp_path / study).mkdir()
        (tmp_path / study / "summary.json").write_text(json.dumps({"rows": rows}))
        for c in cells:
            run_dirs(tmp_path / study, c, range(5))
    claim = {"id": "c", "paper": "P", "study": "head", "better": "new", "worse": "old",
             "controls": [{"study": "ctl", "cell": "head_only", "label": "head only"},
                          {"study": "ctl", "cell": "probe", "metric": "probe_linear"}]}  # fmt: skip
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump({"claims": [claim]}))
    claims, base = load_claims(tmp_path / "claims.yaml")
    result = evaluate_claim(claims.claims[0], base)
    head_only, probe = result["controls"]
    # seed 2 of the control failed the gate: its interval uses the valid seeds only
    assert head_only["diff"].differences == [1, 2, 2, 1] and head_only["diff"].mean == pytest.approx(1.5)
    assert probe["diff"] is None and probe["values"] == {0: 40.0, 1: 42.0}
    text = claims_markdown(claims, base, "claims.yaml")
    d = head_only["diff"]
    assert (
        f"| head only (`head_only`) | `ctl` | faa | 4.00 ± 0.00 | 4/5 | +1.50 [{d.low:+.2f}, {d.high:+.2f}] | 4/4 |"
        in text
    )
    assert "| `probe` | `ctl` | probe_linear | 41.00 ± 1.41 | 2/2 | – | – |" in text
    assert "| `old` | `head` | faa | 1.80 ± 0.84 | 5/5 | +4.00 [" in text
    (tmp_path / "ctl" / "head_only" / "seed1" / "scenario.json").write_text(json.dumps({"seed": 9}))
    with pytest.raises(ConfigError, match="seed 1 of 'new' and 'head_only' ran different scenarios"):
        evaluate_claim(claims.claims[0], base)


def test_a_controls_interval_leaves_out_the_seeds_where_the_better_cell_failed_the_gate(tmp_path) -> None:
    """`better` − control is paired only over seeds where both runs pass: a seed the better cell failed counts
    neither in the claim's pair nor beside its controls."""
    cells = {"new": [5, 6, 7, 6, 9], "old": [1, 2, 2, 1, 3], "head_only": [4, 4, 4, 4, 4]}
    rows = [{"cell": c, "per_seed": {str(s): {"faa": v} for s, v in enumerate(vals)}, "invalid": {}}
            for c, vals in cells.items()]  # fmt: skip
    rows[0]["invalid"] = {"4": ["key_hit"]}
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "summary.json").write_text(json.dumps({"rows": rows}))
    for c in cells:
        run_dirs(tmp_path / "s", c, range(5))
    claim = {"id": "c", "paper": "P", "study": "s", "better": "new", "worse": "old",
             "controls": [{"study": "s", "cell": "head_only", "role": "head_only"}]}  # fmt: skip
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump({"claims": [claim]}))
    claims, base = load_claims(tmp_path / "claims.yaml")
    result = evaluate_claim(claims.claims[0], base)
    assert result["difference"].seeds == [0, 1, 2, 3]
    (head_only,) = result["controls"]
    assert head_only["diff"].seeds == [0, 1, 2, 3] and head_only["diff"].differences == [1, 2, 3, 2]


@pytest.mark.parametrize("local_only", [True, False])
def test_a_local_only_control_counts_seeds_whose_prompts_hurt_on_the_global_test(tmp_path, local_only) -> None:
    """role local_only: seeds failing only prompt_benefit / *_mechanism count as valid (named on the page); a seed
    that failed a learning check does not; a control whose runs are not local-only runs is refused."""
    rows = [
        {"cell": "new", "per_seed": {str(s): {"faa": v} for s, v in enumerate([5, 6, 7, 6, 5])}, "invalid": {}},
        {"cell": "old", "per_seed": {str(s): {"faa": v} for s, v in enumerate([1, 2, 2, 1, 3])}, "invalid": {}},
        {"cell": "local", "per_seed": {str(s): {"faa": v} for s, v in enumerate([1, 1, 2, 2, 1])},
         "invalid": {"0": ["prompt_benefit", "prompt_mechanism"], "1": ["prompt_benefit"],
                     "3": ["client_loss", "prompt_benefit"]}},
    ]  # fmt: skip
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "summary.json").write_text(json.dumps({"rows": rows}))
    for cell in ("new", "old", "local"):
        run_dirs(tmp_path / "s", cell, range(5))
    for seed in range(5):
        cfg = {"method": {"name": "maple_fedavg", "local_only": local_only}}
        (tmp_path / "s" / "local" / f"seed{seed}" / "config.yaml").write_text(yaml.safe_dump(cfg))
    claim = {"id": "c", "paper": "P", "study": "s", "better": "new", "worse": "old",
             "controls": [{"study": "s", "cell": "local", "role": "local_only"}]}  # fmt: skip
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump({"claims": [claim]}))
    claims, base = load_claims(tmp_path / "claims.yaml")
    if not local_only:
        with pytest.raises(ConfigError, match="local seed 0 is not a local-only run"):
            evaluate_claim(claims.claims[0], base)
        return
    (control,) = evaluate_claim(claims.claims[0], base)["controls"]
    assert control["failed"] == {3: ["client_loss", "prompt_benefit"]}
    assert control["diff"].seeds == [0, 1, 2, 4] and control["diff"].differences == [4, 5, 5, 4]
    text = claims_markdown(claims, base, "claims.yaml")
    assert "control `local` seeds 0, 1: prompt_benefit, prompt_mechanism failed" in text
    assert "| `local` | `s` | faa | 1.40 ± 0.55 | 4/5 |" in text


@pytest.mark.slow
def test_study_probe_row_and_claims_from_its_summary(tmp_path) -> None:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(tiny_raw(scenario={"num_tasks": 2, "rounds_per_task": 1})))
    study = {"name": "mini", "base": "base.yaml", "seeds": [0, 1], "cells": {"run": {}, "probe": {"probe": True}}}
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    out = tmp_path / "out"
    assert main(["study", str(tmp_path / "study.yaml"), "--out", str(out), "--no-report"]) == 0
    rows = {r["cell"]: r for r in json.loads((out / "summary.json").read_text())["rows"]}
    probe = rows["probe"]
    assert probe["upper_bound"] == "frozen_probe" and probe["invalid"] == {} and probe["valid_seeds"] == 2
    metrics = json.loads((out / "probe" / "seed0" / "metrics.json").read_text())
    assert metrics["probe"]["classes"] == 6 and 0 <= metrics["summary"]["probe_linear"] <= 100
    (tmp_path / "claims.yaml").write_text(
        yaml.safe_dump(
            {"min_seeds": 2, "claims": [{"id": "x", "paper": "p", "study": "out", "better": "probe", "worse": "run"}]}
        )  # fmt: skip
    )
    assert main(["claims", str(tmp_path / "claims.yaml"), "--out", str(tmp_path / "claims.md")]) == 0
    assert "**invalid**" in (tmp_path / "claims.md").read_text()  # the tiny runs use a random-init ViT
