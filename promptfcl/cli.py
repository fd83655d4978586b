"""Command line: `promptfcl run CONFIG [--set k=v …] [--resume RUN_DIR]`, `promptfcl study STUDY`,
`promptfcl compare RUN_DIR…`, `promptfcl report STUDY_DIR`, `promptfcl transfer RUN_DIR --direct DIRECT_RUN`,
`promptfcl probe CONFIG`, `promptfcl claims CLAIMS.yaml`, `promptfcl list`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console

from promptfcl.config import ConfigError, load_config

console = Console()
err_console = Console(stderr=True)


def _run(args: argparse.Namespace) -> int:
    from promptfcl.checkpoint import CheckpointError, has_checkpoint
    from promptfcl.experiment import Experiment

    if args.resume:
        exp = Experiment.from_run_dir(Path(args.resume), show_progress=not args.quiet, console=console)
        try:
            metrics = exp.run(resume=True)
        except CheckpointError as e:
            raise ConfigError(str(e)) from None
    else:
        if args.config is None:
            raise ConfigError("give a config file (promptfcl run configs/quickstart.yaml) or --resume RUN_DIR")
        cfg = load_config(args.config, args.set)
        if args.probe:
            from promptfcl.frozen_probe import probe_run

            if not args.run_dir:
                raise ConfigError("promptfcl run --probe needs --run-dir")
            metrics = probe_run(cfg, Path(args.run_dir))
            console.print(f"frozen-feature probe: {metrics['summary']}")
            return 0
        run_dir = (
            Path(args.run_dir)
            if args.run_dir
            else Path(cfg.output_dir) / (f"{cfg.run_name()}_{time.strftime('%Y%m%d-%H%M%S')}")
        )
        if has_checkpoint(run_dir):
            raise ConfigError(f"{run_dir} already holds a run; use --resume {run_dir} or another --run-dir")
        if args.engine == "flower-sim":
            import json

            from promptfcl.experiment import print_summary
            from promptfcl.flower.simulation import run_flower_simulation

            run_flower_simulation(cfg, run_dir)
            print_summary(console, json.loads((run_dir / "metrics.json").read_text()), run_dir)
            return 0
        exp = Experiment(cfg, run_dir, show_progress=not args.quiet, console=console)
        try:
            metrics = exp.run()
        except CheckpointError as e:
            raise ConfigError(str(e)) from None
    exp.print_summary(metrics)
    return 0


def _study(args: argparse.Namespace) -> int:
    from promptfcl.study import execute, load_study, plan, select_runs, stale_runs, summarize_study

    study, study_dir = load_study(args.study)
    out = Path(args.out) if args.out else Path("results") / "studies" / study.name
    runs = select_runs(study, plan(study, study_dir, out), args.cells, args.seeds)
    for r in stale_runs(runs, args.rerun_changed):
        console.print(f"  {r.cell} seed {r.seed}: its cell's config changed; moved aside, runs again")
    todo = [r for r in runs if not r.finished]
    random_init = sorted({r.cell for r in runs if "RANDOM_INIT" in r.config_path.read_text()})
    if random_init:
        console.print(
            f"[bold yellow]warning:[/bold yellow] backbone weights not found; {', '.join(random_init)} run on a "
            "RANDOM-INIT backbone (missing_weights: random_init); their accuracies test mechanics only"
        )
    console.print(
        f"study {study.name}: {len(runs)} runs ({len(runs) - len(todo)} already finished) in {out}, "
        f"{args.jobs} at a time"
    )

    def done(run, rc: int) -> None:  # noqa: ANN001
        status = (
            "[green]done[/green]"
            if rc == 0
            else f"[red]failed (exit {rc}), see {run.run_dir.parent}/seed{run.seed}.log[/red]"
        )
        console.print(f"  {run.cell} seed {run.seed}: {status}")

    try:
        results = execute(runs, args.jobs, done)
    except KeyboardInterrupt:
        finished = sum(r.finished for r in runs)
        err_console.print(
            f"study interrupted: {finished} of {len(runs)} runs finished, the stopped ones checkpointed; run the "
            "same command again to resume (finished runs are kept)"
        )
        return 130
    console.print(summarize_study(study, out))
    if not args.no_report and any(r.finished for r in runs):
        _write_study_report(out, study.name)
    return 1 if any(rc != 0 for _, rc in results) else 0


def _write_study_report(out: Path, name: str | None = None) -> None:
    from promptfcl.report.collect import groups_from_study
    from promptfcl.report.comparison import write_report

    groups = groups_from_study(out)
    title = f"Study {name or out.name}"
    path = write_report(groups, out, title, f"Study directory `{out}`.")
    console.print(f"report: {path} and {path.with_suffix('.html')} (self-contained)")


def _report(args: argparse.Namespace) -> int:
    import json

    out = Path(args.study_dir)
    plan = out / "study.json"
    name = json.loads(plan.read_text())["study"] if plan.is_file() else None
    _write_study_report(out, name)
    return 0


def _compare(args: argparse.Namespace) -> int:
    from promptfcl.report.collect import groups_from_runs
    from promptfcl.report.comparison import write_report

    out = Path(args.out) if args.out else Path("results") / "comparisons" / time.strftime("%Y%m%d-%H%M%S")
    groups = groups_from_runs(args.run_dirs)
    path = write_report(groups, out, args.title, "Runs: " + ", ".join(f"`{d}`" for d in args.run_dirs) + ".")
    console.print(f"report: {path} and {path.with_suffix('.html')} (self-contained)")
    return 0


def _transfer(args: argparse.Namespace) -> int:
    """Recompute a task-aware run's transfer metrics against a direct reference run; update its metrics.json."""
    import json

    from promptfcl.evaluation.regimes import load_direct_points, slot_summary
    from promptfcl.report.results import clean_json
    from promptfcl.scenario.scenario import Scenario

    run = Path(args.run_dir)
    path = run / "metrics.json"
    if not path.is_file():
        raise ConfigError(f"{run} holds no finished run (no metrics.json)")
    metrics = json.loads(path.read_text())
    if "evaluations" not in metrics:
        raise ConfigError(f"{run} is not a task-aware per-(client, task) run (asynchronous scenario)")
    scenario = Scenario.load(run / "scenario.json")
    summary = slot_summary(scenario, metrics["evaluations"], load_direct_points(args.direct))
    metrics.update(summary=summary, direct_reference=str(args.direct))
    path.write_text(json.dumps(clean_json(metrics), indent=2))
    for k, v in summary.items():
        console.print(f"{k:<26} {v:8.2f}")
    return 0


def _flower_app(args: argparse.Namespace) -> int:
    from promptfcl.flower.project import write_app

    path = write_app(Path(args.directory))
    console.print(f"Flower app written to {path}/ — run it with: flwr run {path} <superlink connection> --stream")
    return 0


def _flower_certs(args: argparse.Namespace) -> int:
    from promptfcl.flower.security import make_node_keys, make_tls

    tls = make_tls(Path(args.directory), args.hosts)
    keys = make_node_keys(Path(args.directory) / "keys", [f"node{k}" for k in range(args.nodes)])
    console.print(f"TLS: {tls['ca']} (give to every SuperNode and the flwr CLI), {tls['cert']}, {tls['key']}")
    for name, (private, public) in keys.items():
        console.print(f"{name}: private {private} (stays on that node), public {public} (flwr supernode register)")
    return 0


def _per_class(text: str) -> int | None:
    return None if text in ("all", "0") else int(text)


def _probe(args: argparse.Namespace) -> int:
    import json

    from rich.table import Table

    from promptfcl.frozen_probe import probe_backbone

    cfg = load_config(args.config, args.set)
    out = probe_backbone(cfg, args.train_per_class, args.test_per_class, args.first_classes)
    table = Table(title=f"frozen {cfg.backbone.name} on {cfg.data.name} (first {args.train_per_class or 'all'} "
                  "training images per class)")  # fmt: skip
    for col in ("classes", "train images", "test images", "nearest class mean (%)", "linear probe (%)", "C"):
        table.add_column(col, justify="right")
    for key, r in out.items():
        if key != "protocol":
            table.add_row(str(r["classes"]), str(r["train_images"]), str(r["test_images"]), f"{r['ncm']:.1f}",
                          f"{r['linear']:.1f}", f"{r['linear_c']:g}")  # fmt: skip
    console.print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
        console.print(f"written to {args.out}")
    return 0


def _claims(args: argparse.Namespace) -> int:
    from promptfcl.claims import write_claims

    text = write_claims(args.claims, args.out)
    console.print(text.split("\n## ")[0], markup=False, highlight=False)
    console.print(f"written to {args.out}")
    return 0


def _list(args: argparse.Namespace) -> int:
    import timm

    from promptfcl.data import DATASETS
    from promptfcl.methods import METHODS

    console.print("[bold]methods[/bold]")
    for name, spec in METHODS.items():
        console.print(f"  {name:<16} {spec.summary}" + (f"  [dim]({spec.paper})[/dim]" if spec.paper else ""))
    console.print("[bold]datasets[/bold]")
    for name, spec in DATASETS.items():
        where = "generated, no files" if not spec.needs_root else f"folder {spec.folder}/"
        console.print(f"  {name:<16} {where}")
    console.print("[bold]backbones[/bold] (any timm ViT; e.g.)")
    for name in ["vit_tiny_hybrid_lite0", *timm.list_models("vit_*patch16_224*")[:12]]:
        console.print(f"  {name}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="promptfcl", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one experiment from a YAML config")
    run.add_argument("config", nargs="?", help="YAML config file")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set scenario.num_tasks=5 (repeatable)",
    )
    run.add_argument("--run-dir", help="write results here (default: OUTPUT_DIR/NAME_TIMESTAMP)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its last checkpoint")
    run.add_argument("--quiet", action="store_true", help="no live progress display")
    run.add_argument(
        "--probe", action="store_true", help="train nothing: the frozen-feature probe of the scenario's data (a row)"
    )
    run.add_argument(
        "--engine",
        choices=["inprocess", "flower-sim"],
        default="inprocess",
        help="inprocess (default) or Flower's simulation runtime (needs promptfcl[flower])",
    )
    run.set_defaults(func=_run)
    st = sub.add_parser("study", help="run every cell x seed of a study file and write the comparison table")
    st.add_argument("study", help="study YAML (base config, seeds, cells)")
    st.add_argument("--out", help="study directory (default: results/studies/NAME)")
    st.add_argument("--jobs", type=int, default=1, help="runs at once (CPU threads are split between them)")
    st.add_argument("--no-report", action="store_true", help="write only summary.md/csv/json, not report.md/html")
    st.add_argument("--rerun-changed", action="store_true", help="runs started under another config than their "
                    "cell's now are moved aside (seed<k>.replaced-<n>/) and run again (default: refuse)")  # fmt: skip
    st.add_argument("--cells", help="run only these cells (comma-separated; a swept cell's name selects all its "
                    "points); the summary still lists every finished run")  # fmt: skip
    st.add_argument("--seeds", help="run only these of the study's seeds (comma-separated)")
    st.set_defaults(func=_study)
    cp = sub.add_parser("compare", help="compare finished runs: report.md + self-contained report.html")
    cp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="finished run directories (seeds of one config "
                    "are averaged)")  # fmt: skip
    cp.add_argument("--out", help="report folder (default: results/comparisons/TIMESTAMP)")
    cp.add_argument("--title", default="Comparison", help="report title")
    cp.set_defaults(func=_compare)
    rp = sub.add_parser("report", help="(re)write a study directory's report.md + report.html")
    rp.add_argument("study_dir", help="the --out folder of promptfcl study")
    rp.set_defaults(func=_report)
    tr = sub.add_parser(
        "transfer",
        help="transfer metrics (Acc, AIA, forgetting, BWT, FWT, total) of a task-aware run against a direct run",
    )
    tr.add_argument("run_dir", help="finished run on an asynchronous scenario")
    tr.add_argument(
        "--direct",
        required=True,
        help="finished direct reference run of the same scenario and seed (promptfcl run CONFIG --set "
        "method.name=codap_direct)",
    )
    tr.set_defaults(func=_transfer)
    fa = sub.add_parser("flower-app", help="write the Flower app project that `flwr run` deploys")
    fa.add_argument("directory", nargs="?", default="flower-app")
    fa.set_defaults(func=_flower_app)
    fc = sub.add_parser("flower-certs", help="make a test CA, a SuperLink certificate and SuperNode key pairs")
    fc.add_argument("directory")
    fc.add_argument("--hosts", nargs="+", default=["127.0.0.1", "localhost"], help="SuperLink IPs / DNS names")
    fc.add_argument("--nodes", type=int, default=2, help="SuperNode key pairs to make")
    fc.set_defaults(func=_flower_certs)
    pb = sub.add_parser(
        "probe", help="nearest-class-mean and linear-probe accuracy of the configured frozen backbone's features"
    )
    pb.add_argument("config", help="YAML config (its backbone and dataset are probed)")
    pb.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    pb.add_argument("--train-per-class", type=_per_class, default=100,
                    help="the first N training images of each class (default 100; 'all')")  # fmt: skip
    pb.add_argument("--test-per-class", type=_per_class, default=None,
                    help="the first N test images of each class (default: all)")  # fmt: skip
    pb.add_argument("--first-classes", type=int, default=20, help="also probe the first K class ids (default 20)")
    pb.add_argument("--out", help="write the results as JSON here")
    pb.set_defaults(func=_probe)
    cl = sub.add_parser("claims", help="paired tests of the papers' claims from study summaries → Markdown")
    cl.add_argument("claims", help="claims YAML (studies, cells, metric per claim)")
    cl.add_argument("--out", default="docs/claims.md", help="Markdown output (default docs/claims.md)")
    cl.set_defaults(func=_claims)
    ls = sub.add_parser("list", help="list methods, datasets and backbones")
    ls.set_defaults(func=_list)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from promptfcl.reliability import RunInterrupted, RunStopped

    try:
        return args.func(args)
    except ConfigError as e:
        err_console.print(f"[bold red]error:[/bold red] {e}", highlight=False)
        return 2
    except RunStopped as e:
        err_console.print(f"[bold red]run stopped:[/bold red] {e}", highlight=False)
        return 3
    except RunInterrupted as e:
        err_console.print(str(e), highlight=False)
        return e.exit_code
    except KeyboardInterrupt:
        err_console.print("interrupted; the last completed round is checkpointed — continue with --resume RUN_DIR")
        return 130


if __name__ == "__main__":
    sys.exit(main())
