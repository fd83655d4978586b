"""Per-client image domains: a fixed, deterministic transform of every image a client trains and is tested on.

`scenario.domains` (asynchronous scenarios) gives each client one domain, drawn once from (run seed, client id) and
saved in `scenario.json`. A domain is a set of steps, applied in the fixed order colour → blur → noise to uint8
(B, 3, h, w) images at their stored resolution, before the shared `ImageTransform` (resize, augmentation,
normalisation), returning uint8 images — a domain-shifted image is just another image. `LabeledSubset.batches`
applies the subset's domain, so a client's training data (`ClientContext.train_data`) and the test images of its own
(client, task) evaluations carry it, and methods need no change.

- `colour`: a rotation of RGB space by `hue_degrees` about the grey axis u = (1, 1, 1)/√3 (Rodrigues:
  M = cos θ·I + sin θ·[u]ₓ + (1 − cos θ)·u uᵀ) — a hue rotation that keeps grey pixels grey — clamped to [0, 255].
- `blur`: a separable Gaussian blur of σ = `blur_sigma` × the image side (pixels; so the same visual strength at
  any stored size), kernel radius ⌈3σ⌉, reflection padding.
- `noise`: additive Gaussian noise of std `noise_std` × 255 whose pattern is a deterministic function of the
  image's content, the pixel position and the client's `noise_seed`: a counter-based hash (Wellons' lowbias32 on
  int64 tensors) gives two uniforms per value, Box–Muller turns them into N(0, 1). The same image of the same client
  always gets the same noise, so the content-addressed query and stem caches still hit across epochs and
  evaluations and a resumed run is exact, while two images or two clients get unrelated patterns. (Fresh noise per
  draw would act as augmentation and defeat the caches without making the domain any more of a domain.)

Cost: one 3×3 matrix product, two 1-D convolutions and a few integer ops per pixel, batched; nothing per image in
Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from promptfcl.config import DomainsConfig, client_domain_steps
from promptfcl.seeding import numpy_rng

STEP_ORDER = ("colour", "blur", "noise")
_M32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 on an int64 tensor of values in [0, 2³²): a bijective 32-bit integer hash."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def content_keys(images: torch.Tensor) -> torch.Tensor:
    """(B,) int64 in [0, 2³²): a hash of each uint8 image's content (exact integer arithmetic, device-independent)."""
    flat = images.reshape(images.shape[0], -1).long() + 1
    weights = hash32(torch.arange(flat.shape[1], device=images.device)) >> 1  # fixed 31-bit weights
    total = (flat * weights).sum(dim=1)  # < 2^39 · values: exact in int64 up to ~16 M values per image
    return hash32((total & _M32) ^ hash32((total >> 32) & _M32))


def keyed_normal(images: torch.Tensor, seed: int) -> torch.Tensor:
    """Standard normal noise of `images`' shape, a deterministic function of (each image's content, position, seed)."""
    b, n = images.shape[0], images[0].numel()
    key = hash32(content_keys(images) ^ (seed & _M32)).view(b, 1)
    counter = hash32(torch.arange(2 * n, device=images.device)).view(1, 2, n)
    u = (hash32(counter ^ key.view(b, 1, 1)).double() + 0.5) / 2.0**32  # (B, 2, n) uniforms in (0, 1)
    z = torch.sqrt(-2.0 * torch.log(u[:, 0])) * torch.cos(2.0 * math.pi * u[:, 1])
    return z.float().view(images.shape)


def hue_rotation(degrees: float) -> torch.Tensor:
    """(3, 3) rotation of RGB space by `degrees` about the grey axis."""
    t = math.radians(degrees)
    u = torch.full((3,), 1.0 / math.sqrt(3.0), dtype=torch.float64)
    cross = torch.tensor([[0.0, -u[2], u[1]], [u[2], 0.0, -u[0]], [-u[1], u[0], 0.0]], dtype=torch.float64)
    m = math.cos(t) * torch.eye(3, dtype=torch.float64) + math.sin(t) * cross + (1 - math.cos(t)) * torch.outer(u, u)
    return m.float()


def gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of float (B, C, h, w) with σ in pixels, reflection padding."""
    c, side = x.shape[1], min(x.shape[-2:])
    r = max(1, min(math.ceil(3 * sigma), side - 1))
    t = torch.arange(-r, r + 1, dtype=torch.float64, device=x.device)
    k = torch.exp(-(t**2) / (2 * sigma**2))
    k = (k / k.sum()).float()
    x = F.conv2d(F.pad(x, (r, r, 0, 0), mode="reflect"), k.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
    return F.conv2d(F.pad(x, (0, 0, r, r), mode="reflect"), k.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)


@dataclass(frozen=True)
class ImageDomain:
    """One client's fixed image transform: uint8 (B, 3, h, w) → uint8 (B, 3, h, w). No steps: the identity."""

    steps: tuple[str, ...] = ()
    hue_degrees: float = 0.0
    blur_sigma: float = 0.0  # fraction of the image side
    noise_std: float = 0.0  # fraction of 255
    noise_seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.steps) - set(STEP_ORDER)
        if unknown:
            raise ValueError(f"unknown image domain steps {sorted(unknown)}; use {', '.join(STEP_ORDER)}")

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if not self.steps:
            return images
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            shape = tuple(images.shape)
            raise ValueError(f"an image domain takes uint8 (B, 3, h, w) images, got {images.dtype} {shape}")
        x = images.float()
        if "colour" in self.steps:
            x = torch.einsum("ij,bjhw->bihw", hue_rotation(self.hue_degrees).to(x.device), x)
        if "blur" in self.steps:
            x = gaussian_blur(x, self.blur_sigma * min(images.shape[-2:]))
        if "noise" in self.steps:
            x = x + (255.0 * self.noise_std) * keyed_normal(images, self.noise_seed)
        return x.round_().clamp_(0, 255).to(torch.uint8)

    @property
    def name(self) -> str:
        """Its steps joined by '+', or 'none'."""
        return "+".join(self.steps) or "none"

    def describe(self) -> str:
        """The steps with their parameters, e.g. 'colour 143° + blur σ=0.041·side'."""
        parts = {
            "colour": f"colour {self.hue_degrees:.0f}°",
            "blur": f"blur σ={self.blur_sigma:.3f}·side",
            "noise": f"noise std={self.noise_std:.3f}",
        }
        return " + ".join(parts[s] for s in self.steps) or "none"

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": list(self.steps),
            "hue_degrees": self.hue_degrees,
            "blur_sigma": self.blur_sigma,
            "noise_std": self.noise_std,
            "noise_seed": self.noise_seed,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ImageDomain:
        return cls(
            tuple(d["steps"]), float(d["hue_degrees"]), float(d["blur_sigma"]), float(d["noise_std"]),
            int(d["noise_seed"]),
        )  # fmt: skip


def draw_domains(cfg: DomainsConfig, num_clients: int, seed: int) -> list[ImageDomain]:
    """[client] → its domain: the configured steps, parameters drawn uniformly in the configured ranges from
    `numpy_rng(seed, "domain", client)` (every parameter is drawn whatever the steps, so listing another step for a
    client does not change the others)."""
    out = []
    for k, steps in enumerate(client_domain_steps(cfg.clients, num_clients)):
        rng = numpy_rng(seed, "domain", k)
        hue, sigma, std = (float(rng.uniform(*r)) for r in (cfg.hue_degrees, cfg.blur_sigma, cfg.noise_std))
        noise_seed = int(rng.integers(2**31))
        out.append(ImageDomain(tuple(s for s in STEP_ORDER if s in steps), hue, sigma, std, noise_seed))
    return out
