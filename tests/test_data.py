"""Datasets: synthetic determinism, CIFAR decoding without trusting pickle, transforms, real CIFAR-100."""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pytest
import torch

from promptfcl.data import ImageTransform
from promptfcl.data.base import DataMissingError
from promptfcl.data.cifar import CifarOptions, load_cifar100
from promptfcl.data.synthetic import SyntheticOptions, load_synthetic


def test_synthetic_is_deterministic_and_class_structured() -> None:
    o = SyntheticOptions(num_classes=5, train_per_class=20, test_per_class=10)
    a, b = load_synthetic(None, o, False), load_synthetic(None, o, False)  # type: ignore[arg-type]
    assert torch.equal(a.train.images, b.train.images) and a.train.images.dtype == torch.uint8
    assert a.train.images.shape == (100, 3, 32, 32) and a.test.images.shape == (50, 3, 32, 32)
    other = load_synthetic(None, o.model_copy(update={"seed": 9}), False)  # type: ignore[arg-type]
    assert not torch.equal(a.train.images, other.train.images)
    # nearest class mean in pixel space already beats chance by far: the classes are structured
    x = a.train.images.float().flatten(1)
    means = torch.stack([x[a.train.targets == c].mean(0) for c in range(5)])
    xt = a.test.images.float().flatten(1)
    acc = (torch.cdist(xt, means).argmin(1) == a.test.targets).float().mean()
    assert acc > 0.6


def write_fake_cifar100(root, n_train=20, n_test=10, payload=None):
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in (("train", n_train), ("test", n_test)):
        d = {"data": rng.integers(0, 255, (n, 3072), dtype=np.uint8), "fine_labels": list(range(n))}
        (folder / name).write_bytes(pickle.dumps(payload if payload is not None and name == "train" else d))
    (folder / "meta").write_bytes(pickle.dumps({"fine_label_names": [f"c{i}" for i in range(100)]}))
    return folder


def test_cifar_layout_decodes_with_md5_check_off(tmp_path) -> None:
    write_fake_cifar100(tmp_path)
    ds = load_cifar100(tmp_path, CifarOptions(verify_md5=False), False)
    assert ds.train.images.shape == (20, 3, 32, 32) and ds.num_classes == 100
    # the official md5 is checked by default: a fake release is refused with a clear message
    with pytest.raises(DataMissingError, match="md5"):
        load_cifar100(tmp_path, CifarOptions(), False)


class Exploit:
    def __reduce__(self):
        return (eval, ("__import__('os').system('echo pwned')",))


def test_malicious_pickle_is_never_executed(tmp_path) -> None:
    write_fake_cifar100(tmp_path, payload={"data": Exploit()})
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        load_cifar100(tmp_path, CifarOptions(verify_md5=False), False)


def test_missing_cifar_names_expected_files(tmp_path) -> None:
    with pytest.raises(DataMissingError, match="train, test, meta"):
        load_cifar100(tmp_path, CifarOptions(), False)


def test_transform_resizes_normalises_and_augments_deterministically() -> None:
    imgs = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    plain = ImageTransform(32)(imgs)
    assert plain.shape == (4, 3, 32, 32) and plain.min() >= -1 and plain.max() <= 1
    aug = ImageTransform(32, augment="crop_flip")
    a = aug(imgs, torch.Generator().manual_seed(0))
    b = aug(imgs, torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and not torch.allclose(a, plain)
    # a flip-only transform of a horizontally symmetric image is the identity
    sym = torch.cat([imgs[..., :8], imgs[..., :8].flip(-1)], -1)
    flipped = ImageTransform(16, augment="flip")(sym, torch.Generator().manual_seed(1))
    assert torch.allclose(flipped, ImageTransform(16)(sym), atol=1e-5)


def reference_crop_sides(tf: ImageTransform, b: int, gen: torch.Generator) -> torch.Tensor:
    """torchvision's RandomResizedCrop size rule, one image and one draw at a time (on `crop_sides`' random numbers):
    the first of 10 (area, ratio) draws whose crop fits the image, else the whole image."""
    area = tf.rrc_scale[0] + (tf.rrc_scale[1] - tf.rrc_scale[0]) * torch.rand(b, 10, generator=gen)
    lo, hi = np.log(tf.rrc_ratio[0]), np.log(tf.rrc_ratio[1])
    ratio = torch.exp(lo + (hi - lo) * torch.rand(b, 10, generator=gen))
    out = torch.ones(b, 2)
    for i in range(b):
        for j in range(10):
            w, h = float((area[i, j] * ratio[i, j]).sqrt()), float((area[i, j] / ratio[i, j]).sqrt())
            if w <= 1 and h <= 1:
                out[i] = torch.tensor([w, h])
                break
    return out


def test_random_resized_crop_draws_torchvisions_crop_sizes() -> None:
    tf = ImageTransform(32, augment="rrc_flip", rrc_scale=(0.9, 1.0))  # large areas: many draws do not fit
    sides = tf.crop_sides(4000, torch.Generator().manual_seed(0))
    assert torch.allclose(sides, reference_crop_sides(tf, 4000, torch.Generator().manual_seed(0)))
    fallback = (sides == 1).all(1).float().mean()
    assert 0.02 < fallback < 0.5  # some images find no fitting draw in 10 and take the whole image
    area, ratio = sides.prod(1), sides[:, 0] / sides[:, 1]
    assert area.min() >= 0.9 - 1e-6 and area.max() <= 1 + 1e-6
    assert ratio.min() >= 3 / 4 - 1e-6 and ratio.max() <= 4 / 3 + 1e-6


def test_random_resized_crop_crops_inside_the_image_resizes_and_flips() -> None:
    """On coordinate ramps (red = x, green = y), each output spans exactly its drawn crop: the ramp's range across
    the output is the crop side, its direction the flip, its centre the crop's position — always inside the image."""
    s = 64
    ramp = torch.arange(s, dtype=torch.float64) / (s - 1)
    img = torch.stack([ramp.expand(s, s), ramp[:, None].expand(s, s), torch.zeros(s, s)])
    imgs = (img * 255).round().to(torch.uint8).expand(500, 3, s, s)
    tf = ImageTransform(s, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), augment="rrc_flip")
    out = tf(imgs, torch.Generator().manual_seed(3)).double()
    gen = torch.Generator().manual_seed(3)
    flip = torch.rand(500, generator=gen) < 0.5  # the draws in the transform's order: flip, sizes, position
    sides = tf.crop_sides(500, gen)
    x_range = (out[:, 0, :, -1] - out[:, 0, :, 0]).mean(1)  # left-to-right change of the x ramp
    y_range = (out[:, 1, -1, :] - out[:, 1, 0, :]).mean(1)
    assert torch.allclose(x_range.abs(), sides[:, 0].double(), atol=0.02)
    assert torch.allclose(y_range, sides[:, 1].double(), atol=0.02)
    assert torch.equal(x_range < 0, flip)  # a flipped crop runs right to left
    assert out[:, :2].min() >= -1e-6 and out[:, :2].max() <= 1 + 1e-6
    centre_x = out[:, 0].mean((1, 2))  # inside the image: the crop's centre leaves room for its half side
    assert (centre_x >= sides[:, 0] / 2 - 0.02).all() and (centre_x <= 1 - sides[:, 0] / 2 + 0.02).all()
    assert float(centre_x.std()) > 0.05  # and it moves around
    again = tf(imgs, torch.Generator().manual_seed(3))
    assert torch.equal(again.double(), out)  # from the generator alone


@pytest.mark.assets
def test_real_cifar100_matches_the_official_release(assets_dir) -> None:
    folder = assets_dir / "cifar-100-python"
    assert hashlib.md5((folder / "meta").read_bytes()).hexdigest() == "7973b15100ade9c7d40fb424638fde48"
    ds = load_cifar100(folder, CifarOptions(), False)
    assert len(ds.train) == 50000 and len(ds.test) == 10000 and ds.num_classes == 100
    assert torch.equal(torch.bincount(ds.train.targets), torch.full((100,), 500))
    assert ds.class_names[:3] == ["apple", "aquarium_fish", "baby"]
