"""Performance benchmark: framework overhead, server steps, memory and the query cache, in one run.

Sections (each method family: prefix = `fedavg_prompt`, `hgp`; pools = `fedl2p`, `fedcodap`, `hepco`'s weighted
pool):

1. **Client step vs bare timm.** "Ours" is the real client program (`ClientProgram.handle` on a `ClientContext`:
   uint8 images gathered from the split, resized and normalised on the fly, the method's prompt module, masked
   CE, clipping, Adam, state copied in and out, and the method's upload, e.g. HGP's class statistics). "Bare" is
   the minimum anyone would write with timm's modules alone: pre-normalised float tensors, the same prompt
   layout (prefix lengths per layer, or input tokens) as trainable tensors, for pools a no-grad query forward
   first, CE, backward, Adam. Same images and batch, interleaved; the median of `--repeats` is reported and
   the ratio ours / bare (1.0 = no overhead). Pools run with the query cache off here (section 4 measures it).
   The ratio counts method work the bare step does not do as overhead: HGP's client step also computes its
   class statistics (one more forward over the data), so its ratio is below the prefix family's by design.
2. **Server step per round**: the server's share of a round (aggregation plus its own step: HGP's head
   rebalancing on sampled features, HePCo's generator training and distillation) from a short in-process run
   on synthetic data with the method's default server schedule (`--quick`: the CPU presets' shorter one);
   HePCo with its teachers in memory and on disk (`teacher_store`), to show what spilling them costs.
3. **Peak RSS** of a whole run with 1 and with 50 simulated clients, each in its own subprocess, for every
   registered method on its own scenario family (class-incremental: 2 tasks x 1 round, 4 images per client;
   C2Prompt / the direct reference on Powder's asynchronous switching; FedMGP on its personalized split; CAPT
   and the CLIP baselines on one long-tailed task with a tiny random-init CLIP; HePCo on its CPU-preset server
   schedule, its paper-size pool). Reports the ratio 50 / 1 and the growth in MB (`--rss-methods` picks some).
4. **Query-cache speed-up** of pool client steps: images/s with q(x) cached vs recomputed (flip augmentation,
   several local epochs: the first fills the cache).
5. **On CUDA** (or with `--bf16` on the CPU): the client step with `engine.precision: bf16` (ours: the backbone's
   own autocast) and the bare step under bf16 autocast; achieved TFLOP/s (FLOPs of one bare step with the same
   prompt layout, counted by torch's FlopCounterMode, per image, × images/s), the fraction of the device's dense
   bf16 peak (table `BF16_PEAK` by device name, or `--peak-tflops` for a device it lacks) and the peak GPU memory
   of ours (`torch.cuda.max_memory_allocated`). GPU times are CUDA events after a synchronize.

On a GPU, one command gives the ViT-B/16 prompt step (`fedavg_prompt`, prefix prompts) and every family's step in
fp32 and bf16, with images/s, fraction of peak and peak memory, in a few minutes:

    python benchmarks/perf.py --sections client [--peak-tflops 989]

and everything (add the server step, peak RSS per method and the query cache; long):

    python benchmarks/perf.py [--quick] [--bf16] [--cpu] [--sections client,server,rss,cache] [--out FILE.json]

Speeds are random-init weights (speed does not depend on them): ViT-Tiny/16 at 112 px, batch 16 on CPU;
ViT-B/16 at 224 px, batch 64 on CUDA. Run it on a quiet machine: other processes change every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from promptfcl.backbones.vit import build_vit
from promptfcl.config import BackboneConfig, build_config
from promptfcl.data.loader import LabeledSubset
from promptfcl.data.synthetic import SyntheticOptions, load_synthetic
from promptfcl.data.transforms import ImageTransform
from promptfcl.environment import environment_info
from promptfcl.federation.message import Record
from promptfcl.federation.protocol import ClientContext, MethodEnv, RoundInfo
from promptfcl.methods import METHODS
from promptfcl.scenario.label_space import LabelSpace

FAMILIES = {"fedavg_prompt": "prefix", "hgp": "prefix", "fedl2p": "pool", "fedcodap": "pool", "hepco": "pool"}
# (row label, method, extra method options): HePCo twice, to show what spilling its teachers to disk costs
SERVER_METHODS = [
    ("fedavg_prompt", "fedavg_prompt", {}),
    ("hgp", "hgp", {}),
    ("hepco (teachers in memory)", "hepco", {"teacher_store": "memory"}),
    ("hepco (teachers on disk)", "hepco", {"teacher_store": "disk"}),
]
CACHE_METHODS = {"hepco": {}, "fedcodap": {}, "fedl2p": {}}
# the CPU presets' shorter HePCo server schedule (configs/cpu/hepco_cifar100.yaml): server step with --quick, and
# the RSS runs (memory does not depend on the iteration count; 50 teachers x the paper's schedule takes long)
PRESET_SERVER = {"hepco": {"generator_iterations": 20, "generator_extra_per_task": 5, "kd_iterations": 50}}
# Dense bf16 tensor-core peak in TFLOP/s (no sparsity), by a fragment of torch.cuda.get_device_name(), most specific
# first (NVIDIA data sheets: H100 SXM5 989.4, H100 PCIe 756, H100 NVL 835, H200 989, A100 312, L40S 362, L4 121,
# A10 125). A device not listed gets no fraction unless `--peak-tflops` gives its peak.
BF16_PEAK = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "H200": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10": 125.0,
}


@dataclass
class Setting:
    """Backbone, image size, batch and amounts of one benchmark run."""

    device: torch.device
    backbone: str
    img_size: int
    batch: int
    images: int
    repeats: int
    cache_epochs: int
    cache_images: int
    bf16: bool = False
    peak_tflops: float | None = None


def setting(args: argparse.Namespace) -> Setting:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    if device.type == "cuda":
        s = Setting(device, "vit_base_patch16_224", 224, 64, 1024, 3, 3, 512)
        if args.quick:
            s.images, s.repeats, s.cache_images = 256, 1, 256
    else:
        s = Setting(device, "vit_tiny_patch16_224", 112, 16, 320, 3, 3, 160)
        if args.quick:
            s.images, s.repeats, s.cache_epochs, s.cache_images = 48, 1, 2, 32
    s.bf16 = bool(getattr(args, "bf16", False))
    s.peak_tflops = getattr(args, "peak_tflops", None)
    s.images = getattr(args, "images", None) or s.images
    s.repeats = getattr(args, "repeats", None) or s.repeats
    return s


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device: torch.device, fn: Callable[[], Any]) -> float:
    """Seconds `fn` takes, all its device work included: CUDA events on the current stream on a GPU (recorded
    after a synchronize, waited for before reading), wall clock on the CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def bf16_peak_tflops(name: str, override: float | None = None) -> tuple[float | None, str]:
    """(dense bf16 peak in TFLOP/s, where it came from): `--peak-tflops` when given, else the first `BF16_PEAK`
    fragment found in the device name, else (None, "unknown device")."""
    if override is not None:
        return override, "--peak-tflops"
    for fragment, peak in BF16_PEAK.items():
        if fragment in name:
            return peak, f"table ({fragment})"
    return None, "unknown device: pass --peak-tflops"


def fraction_of_peak(flops_per_image: float, images_per_s: float, peak_tflops: float | None) -> float | None:
    """Achieved FLOP/s (flops_per_image × images/s) over the peak; None without a peak."""
    return flops_per_image * images_per_s / (peak_tflops * 1e12) if peak_tflops else None


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of one call of `fn` as torch's FlopCounterMode counts them (matmuls, convolutions, attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=_cpu_attention_flops()) as counter:
        fn()
    return int(counter.get_total_flops())


def _cpu_attention_flops() -> dict[Any, Callable[..., int]]:
    """Flop formulas for the CPU flash-attention kernels that `scaled_dot_product_attention` dispatches to on CPU
    and that some torch releases' FlopCounterMode leaves uncounted (same formulas as the CUDA kernels)."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    mapping: dict[Any, Callable[..., int]] = {}
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is not None and forward not in flop_counter.flop_registry:

        def forward_flops(query, key, value, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
            return flop_counter.sdpa_flop_count(query, key, value)

        mapping[forward] = forward_flops
    if backward is not None and backward not in flop_counter.flop_registry:

        def backward_flops(grad_out, query, key, value, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
            return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)

        mapping[backward] = backward_flops
    return mapping


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


# ------------------------------------------------------------------------------------------------ client step
class ClientBench:
    """One method's real client step on synthetic images, and the bare timm step with the same prompt layout."""

    def __init__(self, method: str, s: Setting, images: int, extra: dict[str, Any] | None = None) -> None:
        self.s = s
        self.backbone = build_vit(BackboneConfig(name=s.backbone, img_size=s.img_size)).to(s.device)
        classes = 10
        ds = load_synthetic(
            None, SyntheticOptions(num_classes=classes, train_per_class=max(images // classes, 1)), False
        )
        space = LabelSpace([list(range(classes))], classes)
        self.tf = ImageTransform(s.img_size)
        spec = METHODS.get(method)
        base = {"local_epochs": 1, "batch_size": s.batch, "augment": "none", **(extra or {})}
        self.params = spec.params.model_validate(base)
        env = MethodEnv(self.backbone, space, self.tf, s.device, seed=0)
        self.server, self.client = spec.programs(env, self.params)
        self.server.begin_stage(0)
        self.msg = self.server.downlink(RoundInfo(0, 0, (0,)))
        self.data = LabeledSubset.of(ds.train, torch.arange(len(ds.train)), space.class_to_logit)
        self.x = self.tf(ds.train.images.to(s.device))
        self.y = ds.train.targets.to(s.device)
        self.classes = classes

    def ours(self, round_: int = 0) -> float:
        """Images/s of one `handle` call (one local epoch over the data)."""
        ctx = ClientContext(0, 0, round_, Record(), self.data, round_, self.s.device)
        msg = self.msg.copy()
        msg.scalars["round"] = round_
        return len(self.data) / timed(self.s.device, lambda: self.client.handle(msg, ctx))

    def prompt_layout(self) -> tuple[dict[int, tuple[int, int]], int, bool]:
        """(prefix lengths per layer, number of input tokens, needs a query) of the method's prompt."""
        model = self.server.model
        prompt = getattr(model, "prompt", None)
        if prompt is None:
            return {}, 0, False
        needs_query = bool(getattr(prompt, "needs_query", False))
        with torch.no_grad():
            x = self.x[: self.s.batch]
            spec = prompt(x.shape[0], self.backbone.query(x) if needs_query else None)
        prefix = {i: (k.shape[-2], v.shape[-2]) for i, (k, v) in spec.prefix.items()}
        return prefix, (spec.tokens.shape[-2] if spec.tokens is not None else 0), needs_query

    def bare_step(self) -> Callable[[torch.Tensor, torch.Tensor], None]:
        prefix, n_tokens, needs_query = self.prompt_layout()
        return bare_step_fn(self.backbone.vit, prefix, n_tokens, needs_query, self.classes, self.s.device)

    def bare(self, step: Callable[[torch.Tensor, torch.Tensor], None]) -> float:
        def epoch() -> None:
            for i in range(0, len(self.x), self.s.batch):
                step(self.x[i : i + self.s.batch], self.y[i : i + self.s.batch])

        return len(self.x) / timed(self.s.device, epoch)


def bare_step_fn(
    vit: torch.nn.Module,
    prefix: dict[int, tuple[int, int]],
    n_tokens: int,
    needs_query: bool,
    classes: int,
    device: torch.device,
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A hand-written prompt-tuning step on timm's modules (no framework code) with the given prompt layout."""
    d = vit.embed_dim
    pk = {i: torch.nn.Parameter(torch.zeros(lk, d, device=device)) for i, (lk, _) in prefix.items()}
    pv = {i: torch.nn.Parameter(torch.zeros(lv, d, device=device)) for i, (_, lv) in prefix.items()}
    tokens = torch.nn.Parameter(torch.zeros(n_tokens, d, device=device)) if n_tokens else None
    head = torch.nn.Linear(d, classes).to(device)
    params = [*pk.values(), *pv.values(), *head.parameters(), *([tokens] if tokens is not None else [])]
    opt = torch.optim.Adam(params, lr=1e-3)

    def attn_with_prefix(attn: torch.nn.Module, x: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = attn.qkv(x).reshape(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        pk_ = k_.expand(b, -1, -1).reshape(b, k_.shape[0], attn.num_heads, -1).transpose(1, 2)
        pv_ = v_.expand(b, -1, -1).reshape(b, v_.shape[0], attn.num_heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, torch.cat([pk_, k], 2), torch.cat([pv_, v], 2))
        return attn.proj(out.transpose(1, 2).reshape(b, n, c))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if needs_query:
            with torch.no_grad():
                vit.forward_features(x)  # the query q(x): one unprompted forward
        h = vit._pos_embed(vit.patch_embed(x))
        if tokens is not None:
            h = torch.cat([h[:, :1], tokens.expand(h.shape[0], -1, -1), h[:, 1:]], dim=1)
        for i, blk in enumerate(vit.blocks):
            if i in prefix:
                h = h + attn_with_prefix(blk.attn, blk.norm1(h), pk[i], pv[i])
                h = h + blk.mlp(blk.norm2(h))
            else:
                h = blk(h)
        loss = F.cross_entropy(head(vit.norm(h)[:, 0]), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    return step


def client_steps(s: Setting) -> list[dict[str, Any]]:
    rows = []
    for method, family in FAMILIES.items():
        bench = ClientBench(method, s, s.images)
        step = bench.bare_step()
        bench.ours(), bench.bare(step)  # warm-up
        o, b = [], []
        reset_peak_memory(s.device)
        for _ in range(s.repeats):
            o.append(bench.ours())
            b.append(bench.bare(step))
        row = {
            "method": method,
            "family": family,
            "ours_images_per_s": statistics.median(o),
            "bare_images_per_s": statistics.median(b),
            "ratio": statistics.median(o) / statistics.median(b),
            "ours_all": o,
            "bare_all": b,
            "peak_gpu_mb": peak_memory_mb(s.device),
        }
        if s.device.type == "cuda" or s.bf16:
            row.update(bf16(bench, step, s))
        rows.append(row)
        print(
            f"  client step {method:<14} ours {row['ours_images_per_s']:8.1f} img/s  bare "
            f"{row['bare_images_per_s']:8.1f} img/s  ratio {row['ratio']:.3f}"
            + (f"  bf16 ours {row['bf16_ours_images_per_s']:8.1f} img/s" if "bf16_ours_images_per_s" in row else ""),
            flush=True,
        )
    return rows


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float | None:
    """Peak GPU memory allocated by tensors since the last reset (MB); None on the CPU."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def bf16(bench: ClientBench, step: Callable, s: Setting) -> dict[str, Any]:
    """Ours with `engine.precision: bf16` (the backbone's own autocast) and the bare step under bf16 autocast:
    images/s, achieved TFLOP/s (FLOPs of one bare step with the same prompt layout, counted by FlopCounterMode,
    per image), the fraction of the device's dense bf16 peak, and ours' peak GPU memory."""
    x, y = bench.x[: s.batch], bench.y[: s.batch]
    with torch.autocast(s.device.type, dtype=torch.bfloat16):
        flops_per_image = count_flops(lambda: step(x, y)) / s.batch
    bench.backbone.configure("bf16")
    try:
        bench.ours()  # warm-up
        reset_peak_memory(s.device)
        o = statistics.median(bench.ours() for _ in range(s.repeats))
        peak_mb = peak_memory_mb(s.device)
    finally:
        bench.backbone.configure("fp32")
    with torch.autocast(s.device.type, dtype=torch.bfloat16):
        bench.bare(step)
        b = statistics.median(bench.bare(step) for _ in range(s.repeats))
    name = device_name(s.device)
    peak, source = bf16_peak_tflops(name, s.peak_tflops) if s.device.type == "cuda" else (s.peak_tflops, "cpu")
    return {
        "bf16_ours_images_per_s": o,
        "bf16_bare_images_per_s": b,
        "bf16_ratio": o / b,
        "flops_per_image": flops_per_image,
        "bf16_ours_tflops": flops_per_image * o / 1e12,
        "bf16_bare_tflops": flops_per_image * b / 1e12,
        "device_name": name,
        "bf16_peak_tflops": peak,
        "bf16_peak_source": source,
        "bf16_ours_fraction_of_peak": fraction_of_peak(flops_per_image, o, peak),
        "bf16_bare_fraction_of_peak": fraction_of_peak(flops_per_image, b, peak),
        "bf16_peak_gpu_mb": peak_mb,
    }


# ------------------------------------------------------------------------------------------ runs (server, RSS)
def tiny_run_config(
    method: str, s: Setting, clients: int, preset_server: bool, per_client: int = 8, rounds: int = 2
) -> dict[str, Any]:
    classes = 10
    method_cfg: dict[str, Any] = {"name": method, "local_epochs": 1, "batch_size": s.batch, "augment": "none"}
    if preset_server:
        method_cfg.update(PRESET_SERVER.get(method, {}))
    return {
        "name": f"perf_{method}",
        "data": {
            "name": "synthetic",
            "options": {
                "num_classes": classes,
                "train_per_class": max(per_client * clients // classes, 4),
                "test_per_class": 4,
                "image_size": 32,
            },
        },
        "scenario": {
            "num_tasks": 2,
            "num_clients": clients,
            "rounds_per_task": rounds,
            "partition": {"kind": "iid", "min_samples": 1},
        },
        "backbone": {"name": s.backbone, "img_size": s.img_size},
        "method": method_cfg,
        "engine": {"device": s.device.type},
    }


def run_experiment(raw: dict[str, Any]) -> dict[str, Any]:
    from promptfcl.experiment import Experiment

    with tempfile.TemporaryDirectory() as d:
        return Experiment(build_config(raw), Path(d) / "run", show_progress=False).run()


def server_steps(s: Setting, quick: bool, methods: list[str] | None = None) -> list[dict[str, Any]]:
    """Per-round server and client seconds of a tiny end-to-end run per method (SERVER_METHODS, or `methods`)."""
    rows = []
    todo = SERVER_METHODS if methods is None else [(m, m, {}) for m in methods]
    for label, method, extra in todo:
        # the default rows at the class-incremental setting; named methods each on their own scenario family
        raw = tiny_run_config(method, s, 5, quick) if methods is None else rss_run_config(method, s, 5)
        raw["method"].update(extra)
        try:
            m = run_experiment(raw)
        except Exception as e:  # noqa: BLE001 - a check across methods: one failure must not hide the others
            traceback.print_exc()
            rows.append({"method": label, "error": f"{type(e).__name__}: {e}"})
            print(f"  server step {label:<14} FAILED: {type(e).__name__}: {e}", flush=True)
            continue
        rounds = m["communication"]["rounds"]
        row = {
            "method": label,
            "server_seconds_per_round": m["timing"]["server_seconds"] / rounds,
            "client_seconds_per_round": m["timing"]["client_seconds"] / rounds,
            "schedule": "CPU preset" if quick and method in PRESET_SERVER else "method defaults",
            "mb_per_round": m["communication"].get("mb_per_round"),
        }
        rows.append(row)
        print(f"  server step {label:<14} {row['server_seconds_per_round']:.3f} s/round", flush=True)
    return rows


CLIP_METHODS = {"capt", "promptfl", "maple_fedavg", "cocoop_fedavg", "fedclip", "clip_zeroshot"}
# a tiny random-init CLIP (the CAPT CPU preset's shape, smaller) for the CLIP methods' RSS runs
TINY_CLIP = {
    "kind": "clip",
    "name": "ViT-B-16",
    "img_size": 32,
    "kwargs": {
        "embed_dim": 64,
        "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 96, "layers": 4, "head_width": 32},
        "text_cfg": {"context_length": 16, "width": 64, "heads": 4, "layers": 4},
    },
}


ASYNC_METHODS = ("c2prompt", "codap_direct", "powder", "fedcprompt")  # run on Powder's asynchronous switching


def rss_run_config(method: str, s: Setting, clients: int) -> dict[str, Any]:
    """One short run of `method` on its own scenario family with `clients` simulated clients, all taking part:
    class-incremental (2 tasks), Powder's asynchronous switching (ASYNC_METHODS), FedMGP's
    personalized split, or one static long-tailed task on a tiny CLIP (CAPT and the CLIP baselines)."""
    raw = tiny_run_config(method, s, clients, True, per_client=4, rounds=1)
    sc = raw["scenario"]
    if method in ASYNC_METHODS:
        slices = max(1, clients // 10)  # each client's task keeps ~8 images however many clients there are
        sc.update(kind="asynchronous", classes_per_task=2, asynchronous={"data_slices": slices})
    elif method == "fedmgp":
        sc.update(kind="personalized", class_order="shuffled")
        sc["personalized"] = {"mode": "synchronous", "local_test_fraction": 0.3}
        raw["method"].update(proxy_per_class=2, fusion_epochs=1)
        raw["data"]["options"]["train_per_class"] = max(6 * clients // 10, 6)  # 30 % held out as local test
    elif method in CLIP_METHODS:
        raw["backbone"] = TINY_CLIP
        if method in ("capt", "maple_fedavg"):
            raw["method"]["depth"] = 3  # the tiny CLIP has 4 layers per tower
        sc.update(kind="long_tailed", num_tasks=1, long_tail={"imbalance_factor": 100})
        raw["data"]["options"]["train_per_class"] = 30  # (n_max) so the head, mid and tail groups are all held
        sc["partition"] = {"kind": "iid", "min_samples": 1}
    return raw


def rss_child(method: str, clients: int, quick: bool, cpu: bool) -> None:
    """Subprocess entry: one short run with `clients` simulated clients, then print its peak RSS as JSON."""
    s = setting(argparse.Namespace(quick=quick, cpu=cpu))
    run_experiment(rss_run_config(method, s, clients))
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    gpu = torch.cuda.max_memory_allocated() / 2**20 if s.device.type == "cuda" else None
    print(json.dumps({"peak_rss_mb": peak_kb / 1024, "peak_gpu_mb": gpu}))


def peak_rss(methods: list[str], quick: bool, cpu: bool, mmap_threshold: int | None = None) -> list[dict[str, Any]]:
    """Each method's 1- and 50-client runs in fresh subprocesses. `mmap_threshold` (bytes) fixes glibc's
    M_MMAP_THRESHOLD in them (MALLOC_MMAP_THRESHOLD_): tensors at least that large are mapped and unmapped on
    their own, so the peak shows live memory without the heap fragmentation that glibc's sliding threshold lets
    same-size transient tensors cause (a diagnostic; the default measures the allocator as users run it)."""
    env = dict(os.environ)
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    rows = []
    for method in methods:
        row: dict[str, Any] = {"method": method, "load_average": list(os.getloadavg())}
        for clients in (1, 50):
            cmd = [sys.executable, __file__, "--rss-child", method, str(clients)]
            cmd += ["--quick"] if quick else []
            cmd += ["--cpu"] if cpu else []
            t0 = time.perf_counter()
            res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
            if res.returncode != 0:
                row["error"] = f"{clients} clients: {res.stderr.strip().splitlines()[-1]}"
                print(f"  peak RSS {method:<14} FAILED with {clients} clients:\n{res.stderr[-3000:]}", flush=True)
                break
            child = json.loads(res.stdout.strip().splitlines()[-1])
            row[f"peak_rss_mb_{clients}_clients"] = child["peak_rss_mb"]
            row[f"seconds_{clients}_clients"] = time.perf_counter() - t0
            if child["peak_gpu_mb"] is not None:
                row[f"peak_gpu_mb_{clients}_clients"] = child["peak_gpu_mb"]
        if "error" in row:
            rows.append(row)
            continue
        row["ratio_50_vs_1"] = row["peak_rss_mb_50_clients"] / row["peak_rss_mb_1_clients"]
        row["growth_mb"] = row["peak_rss_mb_50_clients"] - row["peak_rss_mb_1_clients"]
        rows.append(row)
        print(
            f"  peak RSS {method:<14} 1 client {row['peak_rss_mb_1_clients']:.0f} MB, 50 clients "
            f"{row['peak_rss_mb_50_clients']:.0f} MB, ratio {row['ratio_50_vs_1']:.2f}",
            flush=True,
        )
    return rows


# ------------------------------------------------------------------------------------------------- query cache
def query_cache(s: Setting) -> list[dict[str, Any]]:
    rows = []
    for method, extra in CACHE_METHODS.items():
        res = {}
        for cached in (False, True):
            bench = ClientBench(method, s, s.cache_images, {**extra, "augment": "flip", "query_cache": cached})
            times = []
            for e in range(s.cache_epochs):  # one epoch per message, so each epoch is timed on its own
                times.append(len(bench.data) / bench.ours(e))
            n = len(bench.data)
            res[cached] = (n * len(times) / sum(times), n * (len(times) - 1) / sum(times[1:]))
        row = {
            "method": method,
            "uncached_images_per_s": res[False][1],
            "cached_images_per_s_all_epochs": res[True][0],
            "ratio_all_epochs": res[True][0] / res[False][0],
            "cached_images_per_s_warm": res[True][1],
            "ratio_warm": res[True][1] / res[False][1],
        }
        rows.append(row)
        print(
            f"  query cache {method:<14} warm ratio {row['ratio_warm']:.2f}, incl. first epoch "
            f"{row['ratio_all_epochs']:.2f}",
            flush=True,
        )
    return rows


# ----------------------------------------------------------------------------------------------------- output
def tables(result: dict[str, Any]) -> str:
    out: list[str] = []
    if "client_step" in result:
        header = "| method | family | ours img/s | bare timm img/s | ratio |"
        bf16_cols = any("bf16_ours_images_per_s" in r for r in result["client_step"])
        if bf16_cols:
            header += " bf16 ours img/s | bf16 ratio | bf16 TFLOP/s | of bf16 peak | bf16 peak GPU MB |"
        out += [header, "|" + " --- |" * (header.count("|") - 1)]
        for r in result["client_step"]:
            line = (
                f"| {r['method']} | {r['family']} | {r['ours_images_per_s']:.1f} | {r['bare_images_per_s']:.1f} | "
                f"{r['ratio']:.3f} |"
            )
            if "bf16_ours_images_per_s" in r:
                frac = r["bf16_ours_fraction_of_peak"]
                mem = r.get("bf16_peak_gpu_mb")
                line += (
                    f" {r['bf16_ours_images_per_s']:.1f} | {r['bf16_ratio']:.3f} | {r['bf16_ours_tflops']:.3g} |"
                    f" {'–' if frac is None else f'{100 * frac:.1f} %'} | {'–' if mem is None else f'{mem:.0f}'} |"
                )
            out.append(line)
        out.append("")
    if "server_step" in result:
        out += [
            "| method | server s / round | client s / round | MB / round | server schedule |",
            "| --- | --- | --- | --- | --- |",
        ]
        out += [
            f"| {r['method']} | failed: {r['error']} | | | |"
            if "error" in r
            else f"| {r['method']} | {r['server_seconds_per_round']:.3f} | {r['client_seconds_per_round']:.3f} | "
            f"{r.get('mb_per_round') or 0:.2f} | {r['schedule']} |"
            for r in result["server_step"]
        ]
        out.append("")
    if "peak_rss" in result:
        out += [
            "| method | peak RSS, 1 client (MB) | peak RSS, 50 clients (MB) | ratio | growth (MB) |",
            "| --- | --- | --- | --- | --- |",
        ]
        out += [
            f"| {r['method']} | {r['peak_rss_mb_1_clients']:.0f} | {r['peak_rss_mb_50_clients']:.0f} | "
            f"{r['ratio_50_vs_1']:.2f} | {r['growth_mb']:.0f} |"
            if "error" not in r
            else f"| {r['method']} | failed: {r['error']} | | | |"
            for r in result["peak_rss"]
        ]
        out.append("")
    if "query_cache" in result:
        out += [
            "| method | recomputed img/s | cached img/s (all epochs) | ratio | cached img/s (warm) | warm ratio |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        out += [
            f"| {r['method']} | {r['uncached_images_per_s']:.1f} | {r['cached_images_per_s_all_epochs']:.1f} | "
            f"{r['ratio_all_epochs']:.2f} | {r['cached_images_per_s_warm']:.1f} | {r['ratio_warm']:.2f} |"
            for r in result["query_cache"]
        ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few images, one repeat: checks the script, not speeds")
    ap.add_argument("--cpu", action="store_true", help="measure on the CPU even when a GPU is present")
    ap.add_argument("--bf16", action="store_true", help="also the bf16-autocast section on the CPU (always on CUDA)")
    ap.add_argument("--images", type=int, help="images per client-step measurement (default 320 CPU, 1024 CUDA)")
    ap.add_argument("--repeats", type=int, help="measurements per row, median reported (default 3)")
    ap.add_argument("--out", help="JSON output (default benchmarks/results/perf[_quick][_cuda].json)")
    ap.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, when BF16_PEAK lacks it")
    ap.add_argument("--sections", default="client,server,rss,cache", help="comma-separated subset to run")
    ap.add_argument(
        "--server-methods", help="comma-separated methods (or 'all') for the server section, each on its own scenario"
    )
    ap.add_argument("--rss-methods", help="comma-separated methods for the peak-RSS section (default: every one)")
    ap.add_argument(
        "--malloc-mmap-threshold", type=int, help="RSS runs: fix glibc's mmap threshold (bytes; a diagnostic)"
    )
    ap.add_argument("--rss-child", nargs=2, metavar=("METHOD", "CLIENTS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        rss_child(args.rss_child[0], int(args.rss_child[1]), args.quick, args.cpu)
        return
    torch.manual_seed(0)
    s = setting(args)
    print(f"perf on {s.device} ({s.backbone} @ {s.img_size} px, batch {s.batch}, {torch.get_num_threads()} threads)")
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "device": s.device.type,
        "quick": args.quick,
        "backbone": s.backbone,
        "img_size": s.img_size,
        "batch": s.batch,
        "images": s.images,
        "repeats": s.repeats,
        "threads": torch.get_num_threads(),
        "load_average_at_start": list(os.getloadavg()),  # other processes change every number
        "machine": platform.processor() or platform.machine(),
        "environment": environment_info(),
    }
    sections = set(args.sections.split(","))
    result["sections"] = sorted(sections)
    if "client" in sections:
        result["client_step"] = client_steps(s)
    if "server" in sections:
        methods = args.server_methods.split(",") if args.server_methods else None
        methods = sorted(METHODS) if methods == ["all"] else methods
        result["server_step"] = server_steps(s, args.quick, methods)
    if "rss" in sections:
        result["rss_malloc_mmap_threshold"] = args.malloc_mmap_threshold
        result["peak_rss"] = peak_rss(
            args.rss_methods.split(",") if args.rss_methods else sorted(METHODS),
            args.quick,
            args.cpu,
            args.malloc_mmap_threshold,
        )
    if "cache" in sections:
        result["query_cache"] = query_cache(s)
    result["seconds"] = time.perf_counter() - t0
    print(tables(result))
    default = (
        "benchmarks/results/perf" + ("_quick" if args.quick else "") + ("_cuda" if s.device.type == "cuda" else "")
    )
    out = Path(args.out or default + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"written to {out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
