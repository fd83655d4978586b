"""Mixed precision and compilation of the frozen backbone (`engine.precision`, `engine.compile`).

- `fp32` (default): everything in float32.
- `bf16` / `fp16`: the frozen backbone's forward — and so its backward into the prompts — runs under
  `torch.autocast` with that dtype; what it returns is cast back to float32, so heads, losses, statistics and
  the server's math stay float32. Trainable tensors (prompts, heads, adapters) are never converted: they are the
  float32 master copies the optimizer updates, and autocast casts them to the low dtype where an op needs it.
  `fp16` adds dynamic loss scaling (`torch.amp.GradScaler`, `LossScaler`) wherever a loss is backpropagated
  through the backbone (the shared local loop, FedMGP's server-side fusion); bf16 has float32's exponent range
  and needs none.
- `engine.compile: true` wraps the backbone's transformer forward in `torch.compile` (the first batches of each
  new prompt layout and batch shape compile; the rest reuse the compiled code).

`precision_problem` / `compile_problem` say, before a run starts, why a combination cannot run here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
from collections.abc import Iterable

import torch
from torch import nn

from promptfcl.config import Precision

AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device_type: str, precision: Precision) -> contextlib.AbstractContextManager:
    """`torch.autocast` with the precision's dtype on `device_type`; a no-op for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=AUTOCAST_DTYPES[precision])


def precision_problem(precision: Precision, device: torch.device) -> str | None:
    """Why `precision` cannot run on `device` (a message naming the fix), or None."""
    if precision == "fp16" and device.type == "cpu":
        return (
            "engine.precision: fp16 on the CPU has no fast float16 kernels (a ViT step runs ~10× slower than fp32 "
            "here); use engine.precision: bf16 on the CPU, and fp16 on a GPU"
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "engine.precision: bf16 needs a GPU with bfloat16 support (Ampere or newer); use fp16 on this GPU"
    return None


def compile_problem(device: torch.device) -> str | None:
    """Why `torch.compile` cannot run on `device` here (a message naming the fix), or None."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return "engine.compile: torch.compile is not supported on this Python / platform; set engine.compile: false"
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "engine.compile: torch.compile on a GPU needs triton (pip install triton), or set engine.compile: false"
    if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "engine.compile: torch.compile on the CPU needs a C++ compiler (g++ or clang++) on PATH; or set it false"
    return None


def model_precision(model: nn.Module) -> Precision:
    """The precision a model's forward runs in: its own `precision`, else its frozen backbone's, else fp32."""
    own = getattr(model, "precision", None)
    if own is not None:
        return own
    return getattr(getattr(model, "backbone", None), "precision", "fp32")


class LossScaler:
    """Backward and optimizer step with fp16's dynamic loss scaling, or the plain ones (fp32, bf16).

    With fp16 the loss is multiplied by a scale before backward so small gradients survive float16; gradients
    are unscaled before clipping, and a step whose gradients overflowed is skipped while the scale shrinks
    (`torch.amp.GradScaler`). A new scaler per training call starts from torch's default scale (2^16).
    """

    def __init__(self, precision: Precision, device: torch.device) -> None:
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    @classmethod
    def for_model(cls, model: nn.Module, device: torch.device) -> LossScaler:
        return cls(model_precision(model), device)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, opt: torch.optim.Optimizer, params: Iterable[nn.Parameter], grad_clip: float | None) -> None:
        """Clip (when `grad_clip`) the true gradients, then step; fp16 skips a step with inf/NaN gradients."""
        if self.scaler is None:
            if grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            opt.step()
            return
        if grad_clip is not None:
            self.scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        self.scaler.step(opt)
        self.scaler.update()
