"""Command line: `promptfcl run CONFIG [--set k=v …] [--resume RUN_DIR]`, `promptfcl study STUDY`,
`promptfcl compare RUN_DIR…`, `promptfcl report STUDY_DIR`, `promptfcl transfer RUN_DIR --direct DIRECT_RUN`,
`promptfcl probe CONFIG`, `promptfcl export-scenario CONFIG OUT.npz`, `promptfcl claims CLAIMS.yaml`, `promptfcl list`,
`promptfcl show METHOD`."""

from __future__ import annotations

import argparse
import io
import sys
import time
import types
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from rich.console import Console
from rich.markup import escape

from promptfcl.assets import add_build_asset_parser
from promptfcl.config import ConfigError, EngineKind, ExperimentConfig, load_config

if TYPE_CHECKING:
    from promptfcl.federation.protocol import MethodSpec

console = Console()
err_console = Console(stderr=True)


def _run(args: argparse.Namespace) -> int:
    """`promptfcl run`: a new run from a config (its `engine.kind`, or `--engine`), or `--resume RUN_DIR` on the
    engine the run recorded in its `config.yaml`."""
    from promptfcl.checkpoint import has_checkpoint

    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"{run_dir} is not a run directory (no config.yaml); nothing to resume")
        cfg = load_config(run_dir / "config.yaml")
        if args.engine is not None and args.engine != cfg.engine.kind:
            raise ConfigError(
                f"{run_dir} ran on engine.kind: {cfg.engine.kind} (its config.yaml), and --resume continues it there; "
                f"drop --engine {args.engine}, or edit engine.kind in {run_dir / 'config.yaml'} to switch engines"
            )
    else:
        if args.config is None:
            raise ConfigError("give a config file (promptfcl run configs/quickstart.yaml) or --resume RUN_DIR")
        engine = [f"engine.kind={args.engine}"] if args.engine is not None else []  # the flag overrides the config
        cfg = load_config(args.config, [*args.set, *engine])
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
    if cfg.engine.kind == "flower-sim":
        _launch_flower_sim(cfg, run_dir, resume=bool(args.resume))
    else:
        _launch_inprocess(cfg, run_dir, resume=bool(args.resume), quiet=args.quiet)
    return 0


def _launch_inprocess(cfg: ExperimentConfig, run_dir: Path, resume: bool, quiet: bool) -> None:
    """`engine.kind: inprocess`: the run loop and its clients in this process."""
    from promptfcl.checkpoint import CheckpointError
    from promptfcl.experiment import Experiment

    exp = Experiment(cfg, run_dir, show_progress=not quiet, console=console)
    try:
        metrics = exp.run(resume=resume)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    exp.print_summary(metrics)


def _launch_flower_sim(cfg: ExperimentConfig, run_dir: Path, resume: bool) -> None:
    """`engine.kind: flower-sim`: the run on Flower's simulation runtime (`promptfcl.flower.simulation`)."""
    import json

    from promptfcl.runtime import check_config

    check_config(cfg)  # here, before Flower starts: flwr installed, data present, parameters valid
    from promptfcl.experiment import print_summary
    from promptfcl.flower.simulation import run_flower_simulation

    run_flower_simulation(cfg, run_dir, resume=resume)
    print_summary(console, json.loads((run_dir / "metrics.json").read_text()), run_dir)


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
        summarize_study(study, out)  # the summary always lists the finished runs, as the run directories hold them
        err_console.print(
            f"study interrupted: {finished} of {len(runs)} runs finished (summary.md lists them), the stopped ones "
            "checkpointed; run the same command again to resume (finished runs are kept)"
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
        if key != "protocol" and not key.startswith("zero_shot"):
            table.add_row(str(r["classes"]), str(r["train_images"]), str(r["test_images"]), f"{r['ncm']:.1f}",
                          f"{r['linear']:.1f}", f"{r['linear_c']:g}")  # fmt: skip
    console.print(table)
    for key, r in out.items():  # CLIP backbones: zero-shot top-1 on the same test images
        if key.startswith("zero_shot"):
            console.print(f"zero-shot top-1 ({r['classes']} classes, {r['test_images']} test images, "
                          f"\"{r['template']}\"): {r['top1']:.2f} % (chance {r['chance']:.2f} %)")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
        console.print(f"written to {args.out}")
    return 0


def _export_scenario(args: argparse.Namespace) -> int:
    """`promptfcl export-scenario CONFIG OUT.npz`: the run's images, labels and scenario for an external code."""
    from promptfcl.export import export_scenario

    meta = export_scenario(load_config(args.config, args.set), Path(args.out))
    console.print(
        f"written {args.out} and {Path(args.out).with_suffix('.json')}: {meta['dataset']['train_images']} train / "
        f"{meta['dataset']['test_images']} test images at {meta['images']['size']} px, "
        f"{meta['scenario']['stages']} stages x {meta['scenario']['rounds_per_task']} rounds, "
        f"{meta['scenario']['num_clients']} clients; config sha256 {meta['config_sha256'][:16]}…",
        highlight=False,
    )
    return 0


def _claims(args: argparse.Namespace) -> int:
    from promptfcl.claims import write_claims

    text = write_claims(args.claims, args.out)
    console.print(text.split("\n## ")[0], markup=False, highlight=False)
    console.print(f"written to {args.out}")
    return 0


def _kinds(spec: MethodSpec) -> str:
    """The scenario kinds a method accepts, as `promptfcl list` / `show` print them ("any": every kind)."""
    return "any" if spec.scenario_kinds is None else ", ".join(spec.scenario_kinds)


def _list(args: argparse.Namespace) -> int:
    import timm

    from promptfcl.data import DATASETS
    from promptfcl.methods import METHODS

    one_line = not console.is_terminal  # piped: a method per line
    console.print("[bold]methods[/bold] (promptfcl show METHOD: its hyper-parameters)")
    console.print(f"[dim]  {'name':<20} {'scenario kinds':<31} summary[/dim]")
    for name, spec in METHODS.items():
        paper = f"  [dim]({escape(spec.paper)})[/dim]" if spec.paper else ""
        console.print(f"  {name:<20} {_kinds(spec):<31} {escape(spec.summary)}{paper}", soft_wrap=one_line)
    console.print("[bold]datasets[/bold]")
    for name, spec in DATASETS.items():
        where = "generated, no files" if not spec.needs_root else f"folder {spec.folder}/"
        console.print(f"  {name:<16} {where}")
    console.print("[bold]backbones[/bold] (any timm ViT; e.g.)")
    for name in ["vit_tiny_hybrid_lite0", *timm.list_models("vit_*patch16_224*")[:12]]:
        console.print(f"  {name}")
    return 0


_REQUIRED = object()  # a parameter without a default


def type_label(tp: Any) -> str:
    """A parameter's type as a config writer reads it: `float`, `list[int]`, `a | b | c` for a Literal, `| None`
    for an optional value."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    if tp is Ellipsis:
        return "..."
    if origin is Literal:
        return " | ".join(default_label(a) for a in args)
    if origin is Annotated:
        return type_label(args[0])
    if origin in (Union, types.UnionType):
        parts = [type_label(a) for a in args if a is not type(None)]
        return " | ".join(parts + ["None"] * (type(None) in args))
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_label(a) for a in args)}]" if args else name
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def default_label(value: Any) -> str:
    """A default as it would be written in a YAML config (`null`, `true`, `0.003`, `[0, 1]`)."""
    import json

    from pydantic import TypeAdapter

    if value is _REQUIRED:
        return "required"
    if isinstance(value, str):
        return value if value else '""'
    plain = TypeAdapter(Any).dump_python(value, mode="json")
    return repr(plain) if isinstance(plain, float) else json.dumps(plain)


def _bounds(field: FieldInfo) -> str:
    """`(> 0, <= 1)` from a field's numeric constraints; "" when it has none."""
    ops = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    out = [f"{sym} {getattr(m, op)}" for m in field.metadata for op, sym in ops.items() if hasattr(m, op)]
    return f" ({', '.join(out)})" if out else ""


def _section_model(tp: Any) -> type[BaseModel] | None:
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def param_rows(
    model: type[BaseModel], prefix: str = "method.", values: BaseModel | None = None
) -> list[tuple[str, str, str, str]]:
    """(config key, type, default, description) for every field of a parameter model, nested models flattened
    with dots (`method.aggregation.rule`); a nested section with a description gets a row of its own. `values`:
    the section's default instance, whose values win over the nested model's own defaults."""
    rows = []
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        if values is not None:
            value = getattr(values, name)
        elif field.is_required():
            value = _REQUIRED
        else:
            value = field.get_default(call_default_factory=True, validated_data={})
        section = _section_model(field.annotation)
        if section is not None:
            if field.description:
                rows.append((key, "section", "", field.description))
            rows += param_rows(section, key + ".", value if isinstance(value, BaseModel) else None)
            continue
        rows.append((key, type_label(field.annotation) + _bounds(field), default_label(value), field.description or ""))
    return rows


def method_sources(spec: MethodSpec) -> dict[str, list[str]]:
    """file → what of the method it defines (registration — its folder, whose docstring lists the paper-vs-code
    switches — then parameters, server program, client program); paths relative to the checkout when inside it."""
    import importlib

    import promptfcl

    root = Path(promptfcl.__file__).resolve().parents[1]
    out: dict[str, list[str]] = {}
    roles = [("method", spec.module), *((r, o.__module__) for r, o in (
        ("parameters", spec.params), ("server program", spec.server), ("client program", spec.client)))]  # fmt: skip
    for role, module in roles:
        if not module:
            continue
        file = Path(importlib.import_module(module).__file__ or module).resolve()
        out.setdefault(str(file.relative_to(root)) if file.is_relative_to(root) else str(file), []).append(role)
    return out


def _show(args: argparse.Namespace) -> int:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from promptfcl.methods import METHODS

    if args.method not in METHODS:
        raise ConfigError(f"{METHODS.unknown_message(args.method)} (promptfcl list shows them with their summaries)")
    spec = METHODS.get(args.method)
    sources = method_sources(spec)
    source = next(iter(sources))  # the method's own module: the paper, its defaults and the switches
    tty = console.is_terminal  # not a terminal (a pipe, a file): nothing wrapped, one line per parameter
    for label, text in (
        ("method", f"{spec.name}: {spec.summary}"),
        ("paper", spec.paper or "(none given)"),
        ("scenario kinds", _kinds(spec)),
        ("source", "; ".join(f"{file} ({', '.join(roles)})" for file, roles in sources.items())),
    ):
        console.print(Text.assemble((f"{label}: ", "bold"), text), soft_wrap=not tty)
    console.print(
        f"Defaults are the paper's hyper-parameters; the module docstring of {source} lists each paper-vs-code "
        "switch (and every deviation). Set a parameter in the config's method section or with --set "
        "method.<key>=VALUE.",
        highlight=False,
        markup=False,
        soft_wrap=not tty,
    )
    table = Table(box=box.SIMPLE_HEAD if tty else None, show_edge=tty, pad_edge=tty)
    for column, widest in (("key", None), ("type", 28), ("default", 20), ("description", None)):
        table.add_column(column, no_wrap=column == "key" or not tty, max_width=widest if tty else None)
    for row in param_rows(spec.params):
        table.add_row(*(Text(cell) for cell in row))
    if tty:
        console.print(table)
    else:  # rendered at any width, trailing padding dropped
        buf = io.StringIO()
        Console(file=buf, width=100_000, color_system=None, highlight=False).print(table)
        console.out("\n".join(line.rstrip() for line in buf.getvalue().splitlines()), highlight=False)
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
        choices=get_args(EngineKind),
        default=None,
        help="override the config's engine.kind: inprocess (the default) or flower-sim, Flower's simulation "
        "runtime (needs promptfcl[flower]); the run's config.yaml records it and --resume uses it",
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
        "probe", help="nearest-class-mean and linear-probe accuracy of the configured frozen backbone's features "
        "(CLIP backbones: also zero-shot top-1)"
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
    ex = sub.add_parser(
        "export-scenario",
        help="write a run's images (at the backbone's input size), labels and scenario (class order, client indices "
        "per task and round, test indices, seed, config hash) to OUT.npz + OUT.json for an external code",
    )
    ex.add_argument("config", help="YAML config (the run whose data is exported)")
    ex.add_argument("out", help="output .npz (the JSON sidecar is written beside it)")
    ex.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    ex.set_defaults(func=_export_scenario)
    add_build_asset_parser(sub)
    cl = sub.add_parser("claims", help="paired tests of the papers' claims from study summaries → Markdown")
    cl.add_argument("claims", help="claims YAML (studies, cells, metric per claim)")
    cl.add_argument("--out", default="docs/claims.md", help="Markdown output (default docs/claims.md)")
    cl.set_defaults(func=_claims)
    ls = sub.add_parser("list", help="list methods (with the scenario kinds each accepts), datasets and backbones")
    ls.set_defaults(func=_list)
    sh = sub.add_parser(
        "show", help="a method's summary, paper, scenario kinds, source file and every hyper-parameter with its default"
    )
    sh.add_argument("method", help="a registered method name (promptfcl list)")
    sh.set_defaults(func=_show)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from promptfcl.reliability import RunInterrupted, RunStopped

    try:
        return args.func(args)
    except ConfigError as e:
        err_console.print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False)  # [flower] is text
        return 2
    except RunStopped as e:
        err_console.print(f"[bold red]run stopped:[/bold red] {escape(str(e))}", highlight=False)
        return 3
    except RunInterrupted as e:
        err_console.print(str(e), highlight=False, markup=False)
        return e.exit_code
    except KeyboardInterrupt:
        err_console.print("interrupted; the last completed round is checkpointed — continue with --resume RUN_DIR")
        return 130


if __name__ == "__main__":
    sys.exit(main())
