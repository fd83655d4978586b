"""Crash safety: SIGKILL at random rounds and SIGTERM both resume to the uninterrupted run's metrics exactly;
damaged checkpoints are detected by their checksum and the previous good one is used."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from promptfcl.checkpoint import CHECKPOINT_NAME, PREVIOUS_NAME, CheckpointError, load_checkpoint
from promptfcl.cli import main
from promptfcl.config import build_config
from promptfcl.experiment import Experiment
from promptfcl.reliability import GracefulStop, RunInterrupted

from .conftest import tiny_raw

SCENARIO = {"num_tasks": 3, "rounds_per_task": 2}
ROUNDS = 6
KILLS = 3


def comparable(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if k != "timing"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    """(config file, finished run directory, metrics) of the uninterrupted run."""
    d = tmp_path_factory.mktemp("crash")
    raw = tiny_raw(scenario=SCENARIO)
    cfg = d / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    metrics = Experiment(build_config(raw), d / "ref", show_progress=False).run()
    return cfg, d / "ref", metrics


def start_run(cfg: Path, run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "promptfcl", "run", str(cfg), "--run-dir", str(run_dir), "--quiet"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_rounds(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    rounds = run_dir / "rounds.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if rounds.is_file() and len(rounds.read_text().splitlines()) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"the run did not reach {n} rounds (exit {proc.poll()})")


def resume(run_dir: Path) -> dict[str, Any]:
    assert main(["run", "--resume", str(run_dir), "--quiet"]) == 0
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.slow
def test_sigkill_at_random_rounds_then_resume_equals_the_uninterrupted_run(reference, tmp_path: Path) -> None:
    cfg, _, expected = reference
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    for k in range(KILLS):
        after = rng.randint(1, ROUNDS - 1)  # kill once this many rounds are logged (it may be mid-checkpoint)
        run_dir = tmp_path / f"kill{k}"
        proc = start_run(cfg, run_dir)
        wait_for_rounds(run_dir, after, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (run_dir / "metrics.json").exists(), f"run {k} (seed {seed}) finished before the kill"
        ckpt = load_checkpoint(run_dir, restore_rng=False)
        done = ckpt.next_task * SCENARIO["rounds_per_task"] + ckpt.next_round
        assert after <= done < ROUNDS, f"seed {seed}: checkpoint at {done}, killed after {after}"
        assert comparable(resume(run_dir)) == comparable(expected), f"resume {k} differs (seed {seed})"
        lines = [json.loads(x) for x in (run_dir / "rounds.jsonl").read_text().splitlines()]
        assert [(r["task"], r["round"]) for r in lines] == [(t, r) for t in range(3) for r in range(2)]


@pytest.mark.slow
def test_sigterm_finishes_the_round_checkpoints_and_resumes_exactly(reference, tmp_path: Path) -> None:
    cfg, _, expected = reference
    run_dir = tmp_path / "term"
    proc = start_run(cfg, run_dir)
    wait_for_rounds(run_dir, 1, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    err = " ".join(err.split())
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "--resume" in err and "Traceback" not in err
    ckpt = load_checkpoint(run_dir, restore_rng=False)
    logged = len((run_dir / "rounds.jsonl").read_text().splitlines())
    assert ckpt.next_task * 2 + ckpt.next_round == logged < ROUNDS  # stopped on a round boundary, checkpointed
    assert comparable(resume(run_dir)) == comparable(expected)


def test_second_signal_stops_at_once_but_never_inside_a_checkpoint_write() -> None:
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == signal.SIGTERM  # the first signal only asks for a stop after the round
        with pytest.raises(RunInterrupted) as e, stop.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
            reached_end_of_write = True
        assert reached_end_of_write and e.value.exit_code == 128 + signal.SIGTERM
        with pytest.raises(RunInterrupted, match="--resume"):
            stop.check(Path("RUN"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage", [flip_last_byte, truncate], ids=["bitflip", "truncated"])
def test_damaged_checkpoint_is_refused_and_the_previous_one_resumes_exactly(
    reference, tmp_path: Path, damage, capsys
) -> None:
    _, ref_dir, expected = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    (run_dir / "metrics.json").unlink()
    assert (run_dir / PREVIOUS_NAME).is_file()  # the last two are kept
    damage(run_dir / CHECKPOINT_NAME)
    ckpt = load_checkpoint(run_dir, restore_rng=False)
    assert (ckpt.next_task, ckpt.next_round) == (2, 1)  # the previous checkpoint: one round before the end
    reason = "fails its checksum" if damage is flip_last_byte else "unreadable"
    assert reason in ckpt.note and PREVIOUS_NAME in ckpt.note
    assert comparable(resume(run_dir)) == comparable(expected)
    assert "refused the latest checkpoint" in " ".join(capsys.readouterr().out.split())


def test_both_checkpoints_damaged_is_a_clear_error(reference, tmp_path: Path, capsys) -> None:
    _, ref_dir, _ = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    flip_last_byte(run_dir / CHECKPOINT_NAME)
    truncate(run_dir / PREVIOUS_NAME)
    with pytest.raises(CheckpointError, match="both checkpoints are unusable"):
        load_checkpoint(run_dir)
    assert main(["run", "--resume", str(run_dir), "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "fails its checksum" in err and "restart" in err and "Traceback" not in err


def test_a_crash_between_the_two_renames_leaves_the_previous_checkpoint(reference, tmp_path: Path) -> None:
    _, ref_dir, _ = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    (run_dir / CHECKPOINT_NAME).rename(run_dir / (CHECKPOINT_NAME + ".tmp"))  # new file not yet renamed in
    ckpt = load_checkpoint(run_dir, restore_rng=False)
    assert (ckpt.next_task, ckpt.next_round) == (2, 1) and "missing" in ckpt.note


def test_a_crash_between_checkpoint_and_round_log_is_repaired_on_resume(reference, tmp_path: Path) -> None:
    _, ref_dir, expected = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    (run_dir / "metrics.json").unlink()
    log = run_dir / "rounds.jsonl"
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:-1]))  # the last line never got written
    assert comparable(resume(run_dir)) == comparable(expected)
    assert len(log.read_text().splitlines()) == ROUNDS


def test_checkpoint_writer_saves_strided_tensors(tmp_path: Path) -> None:
    """A channels-last tensor (the hybrid's stem weights) is saved as its values: safetensors alone refuses it."""
    import torch
    from safetensors.torch import load_file

    from promptfcl.checkpoint import atomic_save_tensors

    w = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert not w.is_contiguous()
    atomic_save_tensors(tmp_path / "t.safetensors", {"w": w}, {})
    assert torch.equal(load_file(str(tmp_path / "t.safetensors"))["w"], w)
