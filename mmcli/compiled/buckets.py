"""Buckets: the fixed shapes calls are padded to, one compiled graph each (torch-free).

vision (num_blocks x block_size), prefill (padded prompt tokens, one prompt per call) and decode
(batch x context columns), all from the settings' `vision` and `compile` sections.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmcli.errors import ConfigError


@dataclass(frozen=True, order=True)
class Bucket:
    component: str  # vision, prefill or decode
    shape: tuple[int, ...]  # (num_blocks, block_size), (tokens,) or (batch, context)

    @property
    def label(self) -> str:
        return f"{self.component} {'x'.join(map(str, self.shape))}"


def configured_buckets(
    vision_buckets, block_size, prefill_buckets, decode_batch_buckets, decode_context_buckets
) -> list[Bucket]:
    return (
        [Bucket("vision", (n, block_size)) for n in sorted(set(vision_buckets))]
        + [Bucket("prefill", (t,)) for t in sorted(set(prefill_buckets))]
        + [
            Bucket("decode", (b, c))
            for b in sorted(set(decode_batch_buckets))
            for c in sorted(set(decode_context_buckets))
        ]
    )


def parse_buckets(text: str, configured: list[Bucket]) -> list[Bucket]:
    """'decode 8x1024, prefill 512' (or 'decode:8x1024') -> those configured buckets; anything
    else is refused."""
    known = {b.label: b for b in configured}
    picked = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        label = " ".join(item.replace(":", " ").split())
        if label not in known:
            raise ConfigError(
                f"--buckets {item!r}: not a configured bucket (configured: {', '.join(known)})"
            )
        picked.append(known[label])
    return picked


def choose_bucket(num_blocks: int, buckets: list[int]) -> int:
    """The smallest of `buckets` that holds `num_blocks` (blocks, tokens, rows or columns)."""
    fitting = [b for b in sorted(buckets) if b >= num_blocks]
    if not fitting:
        raise ValueError(f"{num_blocks} blocks needed, over the largest bucket {max(buckets)}")
    return fitting[0]
