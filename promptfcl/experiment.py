"""The experiment runner: builds data, scenario, backbone and method from a config, then drives
tasks × rounds through the server program, evaluating, logging and checkpointing as it goes.

This is the engine-neutral server loop: it only talks to a `ServerProgram` and a `Grid`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from promptfcl.checkpoint import Checkpoint, has_checkpoint, load_checkpoint, save_checkpoint
from promptfcl.config import ConfigError, ExperimentConfig, dump_config, load_config
from promptfcl.environment import environment_info
from promptfcl.evaluation.regimes import build_regime
from promptfcl.evaluation.validity import RunEvidence, gate, parameter_moves
from promptfcl.federation.faults import FaultPlan
from promptfcl.federation.inprocess import InProcessGrid
from promptfcl.federation.message import Message
from promptfcl.federation.protocol import Grid, GridPolicy, RoundFailed, RoundInfo, ServerProgram
from promptfcl.reliability import GracefulStop, RoundSnapshot, RunStopped
from promptfcl.report.plots import plot_client_class_counts, plot_client_tasks, plot_task_timeline
from promptfcl.report.progress import RunProgress
from promptfcl.report.results import clean_json, summary_rows, write_final, write_rounds
from promptfcl.report.tracking import open_tracker
from promptfcl.runtime import Runtime, check_config, resolve_method

__all__ = ["Experiment", "RunStopped", "check_config", "resolve_method"]


class Experiment:
    """One run of one method on one scenario; `run()` trains, evaluates and writes `run_dir`."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        run_dir: Path,
        show_progress: bool = True,
        console: Console | None = None,
        grid_factory: Callable[[Runtime], Grid] | None = None,
        handle_signals: bool = True,
    ) -> None:
        self.cfg = cfg
        self.handle_signals = handle_signals
        self.grid_factory = grid_factory
        self.run_dir = Path(run_dir)
        self.show_progress = show_progress
        self.console = console or Console()

    @classmethod
    def from_run_dir(cls, run_dir: Path, **kwargs: Any) -> Experiment:
        cfg_path = Path(run_dir) / "config.yaml"
        if not cfg_path.is_file():
            raise ConfigError(f"{run_dir} is not a run directory (no config.yaml); nothing to resume")
        return cls(load_config(cfg_path), Path(run_dir), **kwargs)

    # ------------------------------------------------------------------------------------------ setup
    def setup(self, resume: bool) -> None:
        t0 = time.perf_counter()
        rt = Runtime.build(self.cfg, self.run_dir / "scenario.json" if resume else None)
        self.runtime = rt
        self.spec, self.params, self.device = rt.spec, rt.params, rt.device
        self.dataset, self.scenario, self.env = rt.dataset, rt.scenario, rt.env
        self.server, self.client = rt.programs()
        if self.grid_factory is None:
            self.grid: Grid = InProcessGrid(
                self.client,
                self.scenario,
                self.dataset.train,
                self.cfg.training_seed(),
                self.device,
                on_reply=self._on_reply,
            )
        else:
            self.grid = self.grid_factory(rt)
        e = self.cfg.engine
        self.grid.configure(
            GridPolicy(e.min_clients, e.client_timeout, FaultPlan(e.faults, e.client_timeout)), self.server.reply_schema
        )
        self.regime = build_regime(
            self.cfg.eval, self.scenario, self.dataset.test, rt.env.eval_transform, self.device, self.grid,
            e.round_retries, rt.env.backbone,
        )  # fmt: skip
        self.evaluator = self.regime.evaluator  # the server-side regimes' test-split evaluator (None: client_local)
        self.setup_seconds = time.perf_counter() - t0

    def _write_run_files(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))
        targets = self.dataset.train.targets.numpy()
        self.scenario.save(self.run_dir / "scenario.json", targets)
        plot_client_class_counts(
            self.scenario.client_class_counts(targets),
            self.run_dir / "scenario_heatmap.png",
            []
            if self.scenario.schedule is not None or self.scenario.personalized
            else [len(c) for c in self.scenario.task_classes],
        )
        if self.scenario.schedule is not None:
            plot_task_timeline(self.scenario.schedule, self.scenario.owners, self.run_dir / "scenario_timeline.png")
        if self.scenario.personalized:
            plot_client_tasks(self.scenario.client_task_matrix(), self.run_dir / "scenario_client_tasks.png")
        e = self.cfg.engine
        engine = {"device": str(self.device), "precision": e.precision, "compile": e.compile}
        (self.run_dir / "environment.json").write_text(json.dumps({**environment_info(), "engine": engine}, indent=2))

    # ------------------------------------------------------------------------------------------- run
    def run(self, resume: bool = False) -> dict[str, Any]:
        self.setup(resume)
        progress_state: dict[str, Any] = {
            "rounds": [],
            "timing": {"client_seconds": 0.0, "server_seconds": 0.0, "eval_seconds": 0.0, "train_seconds": 0.0},
        }
        self.regime.init_state(progress_state)
        start_task, start_round = 0, 0
        if resume and not has_checkpoint(self.run_dir):
            self.console.print("no checkpoint yet (the run stopped in its first round): starting from the beginning")
            resume = False
        if resume:
            ckpt = load_checkpoint(self.run_dir)
            if ckpt.note:
                self.console.print(f"[yellow]warning:[/yellow] {ckpt.note}", highlight=False)
            (self.run_dir / "stopped.json").unlink(missing_ok=True)
            self.server.load_state(ckpt.server)
            self.grid.states.update(ckpt.clients)
            progress_state = ckpt.progress
            start_task, start_round = ckpt.next_task, ckpt.next_round
            write_rounds(self.run_dir, progress_state["rounds"])  # the log as of the checkpoint
        else:
            self._write_run_files()
        self.state = progress_state
        T, R = self.scenario.num_tasks, self.scenario.rounds_per_task
        self.tracker = open_tracker(self.cfg, self.run_dir, dump_config(self.cfg), resume)
        if self.tracker is not None:  # a resumed run logs its checkpoint's rounds again (after a purge)
            for entry in progress_state["rounds"]:
                self.tracker.log_round(entry["task"] * R + entry["round"], entry)
        with RunProgress(T * R, self.show_progress) as self.progress, GracefulStop(self.handle_signals) as self.stop:
            self.progress.skip(start_task * R + start_round)
            for task in range(start_task, T):
                first = start_round if task == start_task else 0
                self.server.begin_stage(task)  # also when resuming inside the task: begin_task is idempotent
                for rnd in range(first, R):
                    self._run_round(task, rnd)
                    if (task, rnd) != (T - 1, R - 1):  # a SIGINT/SIGTERM during the round: stop here, checkpointed
                        self.stop.check(self.run_dir)
        return self._finish()

    def _on_reply(self, client: int, reply: Message) -> None:
        loss = reply.scalars.get("loss")
        self.progress.client_done(client, loss if isinstance(loss, float) else None)

    def _run_round(self, task: int, rnd: int) -> None:
        T, R = self.scenario.num_tasks, self.scenario.rounds_per_task
        info = RoundInfo(task, rnd, tuple(self.scenario.participants[task][rnd]))
        self.progress.round_started(task, T, rnd, R)
        last = rnd == R - 1
        self.grid.stamp = self.regime.round_stamp(last)  # e.g. client_local's `measure_local`
        t0, c0 = time.perf_counter(), time.process_time()
        before = trained_snapshot(self.server)
        round_metrics = self._attempt_round(info)
        round_metrics.update(parameter_moves(before, trained_snapshot(self.server)))
        if last:
            self.server.end_stage(task)
        round_seconds, round_cpu = time.perf_counter() - t0, time.process_time() - c0
        for f in self.grid.failures:
            if not f.injected:  # real failures are worth a line even with the progress display off
                self.console.print(
                    f"[yellow]task {task} round {rnd}: client {f.client} dropped ({f.kind}): {f.reason}[/yellow]",
                    highlight=False,
                )
        traffic = self.grid.traffic
        timing = self.state["timing"]
        timing["client_seconds"] += traffic.client_seconds
        timing["server_seconds"] += round_seconds - traffic.client_seconds
        # process CPU seconds (all threads; single-thread CPU with engine.threads: 1) beside the wall times; the
        # server's are the round's minus the clients' when they run in this process (in-process engine)
        server_cpu = round_cpu - (traffic.client_cpu_seconds or 0.0)
        cpu = {"server_cpu_seconds": server_cpu}
        if traffic.client_cpu_seconds is not None:  # None: the clients ran in other processes (Flower)
            cpu["client_cpu_seconds"] = traffic.client_cpu_seconds
        for key, value in cpu.items():
            timing[key] = timing.get(key, 0.0) + value  # (absent from checkpoints of earlier versions)
        entry: dict[str, Any] = {
            "task": task,
            "round": rnd,
            "participants": list(info.participants),
            **traffic.as_dict(),
            "seconds": round(round_seconds, 4),
            "server_seconds": round(round_seconds - traffic.client_seconds, 4),
            "server_cpu_seconds": round(server_cpu, 4),
            "eval_seconds": 0.0,
            "eval_cpu_seconds": 0.0,
            "failures": [f.__dict__ for f in self.grid.failures],
            **round_metrics,
        }
        if self.grid.attempt:
            entry["attempts"] = self.grid.attempt + 1
        if last or self.regime.every_round:
            self.progress.note("evaluating")
            t1, c1 = time.perf_counter(), time.process_time()
            entry.update(self.regime.evaluate(self.server, task, rnd, last, self.state))
            eval_seconds, eval_cpu = time.perf_counter() - t1, time.process_time() - c1
            timing["eval_seconds"] += eval_seconds
            timing["eval_cpu_seconds"] = timing.get("eval_cpu_seconds", 0.0) + eval_cpu
            entry.update(eval_seconds=round(eval_seconds, 4), eval_cpu_seconds=round(eval_cpu, 4))
        self.state["rounds"].append(clean_json(entry))
        nxt = (task + 1, 0) if last else (task, rnd + 1)
        with self.stop.deferred():  # a signal while the checkpoint is written waits until it is on disk
            save_checkpoint(
                self.run_dir, Checkpoint(nxt[0], nxt[1], self.server.state(), dict(self.grid.states), self.state)
            )
        write_rounds(self.run_dir, self.state["rounds"])  # after the checkpoint: the log never runs ahead of it
        if self.tracker is not None:
            self.tracker.log_round(task * R + rnd, self.state["rounds"][-1])
        self.progress.round_done()

    def _attempt_round(self, info: RoundInfo) -> dict[str, float]:
        """Run the round; if too few clients replied usably, restore the state it started from and retry
        (`engine.round_retries` times), else stop the run with the reasons — never aggregate a partial round."""
        retries = self.cfg.engine.round_retries
        snapshot = RoundSnapshot.take(self.server, self.grid) if retries else None
        for attempt in range(retries + 1):
            self.grid.start_round(info, attempt)
            try:
                return self.server.run_round(self.grid, info)
            except RoundFailed as e:
                if attempt == retries or snapshot is None:
                    raise self._stopped(e, attempt + 1) from None
                self.progress.note(f"too few usable replies; retrying ({attempt + 1}/{retries})")
                snapshot.restore(self.server, self.grid)
        raise AssertionError("unreachable")

    def _stopped(self, e: RoundFailed, attempts: int) -> RunStopped:
        (self.run_dir / "stopped.json").write_text(
            json.dumps(
                {
                    "task": e.info.stage,
                    "round": e.info.round,
                    "attempts": attempts,
                    "failures": [f.__dict__ for f in self.grid.failures],
                },
                indent=2,
            )  # fmt: skip
        )
        return RunStopped(
            f"{e} — after {attempts} attempt(s). Nothing of this round was aggregated; the checkpoint holds the "
            f"last completed round. Fix the failing clients and continue with `promptfcl run --resume "
            f"{self.run_dir}`, or raise engine.round_retries / lower engine.min_clients. "
            f"Details: {self.run_dir / 'stopped.json'}"
        )

    def _finish(self) -> dict[str, Any]:
        rounds = self.state["rounds"]
        timing = dict(self.state["timing"])
        timing["setup_seconds"] = self.setup_seconds
        timing["total_seconds"] = (
            self.setup_seconds + timing["client_seconds"] + timing["server_seconds"] + timing["eval_seconds"]
        )
        up = sum(r["bytes_up"] for r in rounds)
        down = sum(r["bytes_down"] for r in rounds)
        metrics = {
            "method": self.spec.name,
            "run": self.cfg.run_name(),
            "seed": self.cfg.seed,
            "train_seed": self.cfg.training_seed(),
            **self.regime.finish(self.state),
            "communication": {
                "bytes_up": up,
                "bytes_down": down,
                "rounds": len(rounds),
                "mb_per_round": (up + down) / max(len(rounds), 1) / 1e6,
            },
            "timing": timing,
            "precision": self.cfg.engine.precision,
        }
        if self.scenario.upper_bound is not None:  # reports label the row as an upper bound, not a method
            metrics["upper_bound"] = self.scenario.upper_bound
        metrics["prompt_effect"] = self.state.get("prompt_effect")
        if self.state.get("ablations"):
            metrics["ablations"] = self.state["ablations"]
        config = self.cfg.model_dump(mode="json")  # the method section with every default filled in
        config["method"] = {"name": self.spec.name, **self.params.model_dump(mode="json")}
        evidence = RunEvidence(
            config, rounds, self.regime.learned_tasks(self.state), metrics["prompt_effect"],
            self.state.get("ablations") or {},
        )  # fmt: skip
        metrics["validity"] = gate(evidence, self.spec.signals)
        write_final(self.run_dir, self.cfg.run_name(), metrics)
        if self.tracker is not None:
            self.tracker.log_final(self.scenario.num_tasks * self.scenario.rounds_per_task - 1, metrics)
            self.tracker.close()
        return metrics

    def print_summary(self, metrics: dict[str, Any]) -> None:
        print_summary(self.console, metrics, self.run_dir)


def print_summary(console: Console, metrics: dict[str, Any], run_dir: Path) -> None:
    """The results table of a finished run."""
    table = Table(title=f"{metrics['run']} ({metrics['method']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in summary_rows(metrics):
        table.add_row(k, v)
    console.print(table)
    console.print(f"results written to {run_dir}/")


def trained_snapshot(server: ServerProgram) -> dict[str, torch.Tensor]:
    """A copy of what the server holds of the trained tensors (`ServerProgram.trained_tensors`)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in server.trained_tensors().items() if v.is_floating_point()}
