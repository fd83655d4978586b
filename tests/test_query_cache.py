"""The query cache returns exactly what the backbone computes and hits only on identical inputs."""

from __future__ import annotations

import torch

from promptfcl.backbones.vit import build_vit
from promptfcl.data.transforms import ImageTransform

from .test_backbone import CFG


def test_cached_queries_equal_computed_ones_and_hit_on_repeats() -> None:
    vit = build_vit(CFG)
    images = torch.randint(0, 256, (12, 3, 32, 32), dtype=torch.uint8)
    x = ImageTransform(32)(images)
    plain = vit.query(x)
    vit.enable_query_cache()
    first = vit.query(x[:8])
    again = vit.query(x[[3, 9, 0, 11]])  # two repeats, two new
    assert torch.allclose(first, plain[:8], atol=1e-5)
    assert torch.equal(again[0], first[3]) and torch.equal(again[2], first[0])  # served from the cache
    assert torch.allclose(again, plain[[3, 9, 0, 11]], atol=1e-5)
    cache = vit.query_cache
    assert cache is not None and (cache.hits, cache.misses, len(cache)) == (2, 10, 10)
    flipped = vit.query(x.flip(-1)[:2])  # a flipped image is another input: a miss, not a wrong hit
    assert cache.misses == 12 and not torch.allclose(flipped[0], first[0])
    vit.enable_query_cache(False)
    assert vit.query_cache is None
