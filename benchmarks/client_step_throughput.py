"""Client-step throughput of `fedavg_prompt` versus a bare timm forward+backward with the same prompt and batch.

"Ours" is the real client program: `SupervisedClient.handle` on a `ClientContext` (uint8 images gathered
from the shared split, resized/augmented/normalised on the fly, prompt spec built, masked CE, clipping,
Adam, state copied in and out). "Bare" is the minimum anyone would write: pre-normalised float tensors,
timm's own modules with the prefix concatenated inside attention, CE, backward, Adam step.
Both run the same number of images, interleaved, and the median of several repeats is reported.

    python benchmarks/client_step_throughput.py [--img-size 112] [--batch 16] [--images 320] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from promptfcl.backbones.vit import build_vit
from promptfcl.config import BackboneConfig
from promptfcl.data.loader import LabeledSubset
from promptfcl.data.synthetic import SyntheticOptions, load_synthetic
from promptfcl.data.transforms import ImageTransform
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext, MethodEnv
from promptfcl.methods import METHODS
from promptfcl.scenario.label_space import LabelSpace


def bare_step_fn(vit: torch.nn.Module, prompts: torch.nn.Parameter, head: torch.nn.Linear, layers: list[int]):
    """A minimal hand-written prefix-tuning step on timm's modules (no framework code)."""
    opt = torch.optim.Adam([prompts, *head.parameters()], lr=3e-3)

    def attn_with_prefix(attn, x, p):
        b, n, c = x.shape
        q, k, v = attn.qkv(x).reshape(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        half = p.shape[0] // 2
        pk = p[:half].expand(b, -1, -1).reshape(b, half, attn.num_heads, -1).transpose(1, 2)
        pv = p[half:].expand(b, -1, -1).reshape(b, half, attn.num_heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, torch.cat([pk, k], 2), torch.cat([pv, v], 2))
        return attn.proj(out.transpose(1, 2).reshape(b, n, c))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        h = vit._pos_embed(vit.patch_embed(x))
        for i, blk in enumerate(vit.blocks):
            if i in layers:
                h = h + attn_with_prefix(blk.attn, blk.norm1(h), prompts[layers.index(i)])
                h = h + blk.mlp(blk.norm2(h))
            else:
                h = blk(h)
        loss = F.cross_entropy(head(vit.norm(h)[:, 0]), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([prompts, *head.parameters()], 1.0)
        opt.step()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--img-size", type=int, default=112)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--images", type=int, default=320)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/client_step_throughput.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    backbone = build_vit(BackboneConfig(name="vit_tiny_patch16_224", img_size=args.img_size)).to(device)
    classes = 10
    ds = load_synthetic(
        None,
        SyntheticOptions(
            num_classes=classes,
            train_per_class=args.images // classes,  # type: ignore[arg-type]
            test_per_class=1,
        ),
        False,
    )
    space = LabelSpace([list(range(classes))], classes)
    tf = ImageTransform(args.img_size)
    spec = METHODS.get("fedavg_prompt")
    params = spec.params.model_validate({"local_epochs": 1, "batch_size": args.batch, "augment": "none"})
    env = MethodEnv(backbone, space, tf, device, seed=0)
    server, client = spec.programs(env, params)
    data = LabeledSubset.of(ds.train, torch.arange(len(ds.train)), space.class_to_logit)
    msg = Message(server.model.get_state(), {"task": 0, "round": 0}, kind="train")

    def ours() -> float:
        ctx = ClientContext(0, 0, 0, Record(), data, 0, device)
        t0 = time.perf_counter()
        client.handle(msg.copy(), ctx)
        _sync(device)
        return len(data) / (time.perf_counter() - t0)

    vit = backbone.vit
    prompts = torch.nn.Parameter(torch.zeros(len(params.layers), params.length, backbone.embed_dim, device=device))
    head = torch.nn.Linear(backbone.embed_dim, classes).to(device)
    step = bare_step_fn(vit, prompts, head, params.layers)
    x_all = tf(ds.train.images.to(device))
    y_all = ds.train.targets.to(device)

    def bare() -> float:
        t0 = time.perf_counter()
        for s in range(0, len(x_all), args.batch):
            step(x_all[s : s + args.batch], y_all[s : s + args.batch])
        _sync(device)
        return len(x_all) / (time.perf_counter() - t0)

    ours(), bare()  # warm-up
    o, b = [], []
    for _ in range(args.repeats):
        o.append(ours())
        b.append(bare())
    result = {
        "device": str(device),
        "threads": torch.get_num_threads(),
        "img_size": args.img_size,
        "batch": args.batch,
        "images": len(data),
        "prefix_length": params.length,
        "layers": params.layers,
        "ours_images_per_s": statistics.median(o),
        "bare_images_per_s": statistics.median(b),
        "ratio": statistics.median(o) / statistics.median(b),
        "ours_all": o,
        "bare_all": b,
    }
    print(
        f"| step | images/s |\n| --- | --- |\n| fedavg_prompt client step | {result['ours_images_per_s']:.1f} |\n"
        f"| bare timm forward+backward, same prompt and batch | {result['bare_images_per_s']:.1f} |\n"
        f"| ratio (target >= 0.9) | {result['ratio']:.3f} |"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
