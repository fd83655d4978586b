"""Tiny stand-ins for mini-CLIP's parts that the tests write themselves (no package weights, no network): a tiny
BERT text-tower folder, a random-init EfficientNet-Lite0 teacher file, and a projection built by the real builder
on synthetic images."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["a", "photo", "of", "x", ".", "class", "_"]


def write_tiny_text_model(folder: Path, seed: int = 0) -> str:
    """A 2-layer BERT (width 32) with a letter-level WordPiece vocabulary; returns its model.safetensors' sha256."""
    import transformers
    from safetensors.torch import save_file

    from promptfcl.backbones.mini_clip import file_sha256

    folder.mkdir(parents=True, exist_ok=True)
    vocab = SPECIAL + WORDS + list(string.ascii_lowercase + string.digits)
    vocab += [f"##{c}" for c in string.ascii_lowercase + string.digits + "_"]
    (folder / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    cfg = {
        "architectures": ["BertModel"], "model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": len(dict.fromkeys(vocab)),
        "max_position_embeddings": 64, "type_vocab_size": 2, "pad_token_id": 0, "hidden_act": "gelu",
        "layer_norm_eps": 1e-12,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, "tokenizer_class": "BertTokenizer",
                                                              "model_max_length": 64}))  # fmt: skip
    torch.manual_seed(seed)
    bert = transformers.BertModel(transformers.BertConfig(**cfg), add_pooling_layer=True)
    save_file({k: v.contiguous() for k, v in bert.state_dict().items()}, str(folder / "model.safetensors"))
    return file_sha256(folder / "model.safetensors")


def write_random_teacher(path: Path) -> Path:
    """A random-init timm tf_efficientnet_lite0 in safetensors (timm key names), standing in for the ImageNet one."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def tiny_recipe_args(tmp: Path, text: Path, text_sha: str, teacher: Path, **extra: Any) -> list[str]:
    """Arguments of `promptfcl build-asset mini-clip` on synthetic images with the tiny parts."""
    args = ["--out", str(tmp / "proj"), "--images", "synthetic:24", "--image-weights", "none", "--image-depth", "2",
            "--img-size", "64", "--text-model", str(text), "--text-sha256", text_sha, "--teacher", str(teacher),
            "--steps", "5", "--batch", "8", "--lr", "0.001", "--seed", "3"]  # fmt: skip
    for k, v in extra.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def mini_clip_backbone(text: Path, text_sha: str, projection: Path) -> dict[str, Any]:
    """`backbone` config of a tiny mini-CLIP: a 1-block random-init hybrid image tower at 64 px + the tiny BERT."""
    return {
        "kind": "clip",
        "name": "mini-clip",
        "img_size": 64,
        "kwargs": {
            "image_kwargs": {"depth": 2},
            "text_model": str(text),
            "text_sha256": text_sha,
            "projection": str(projection),
            "context_length": 24,
        },
    }
