"""Vision block packing, as small pure functions over token counts.

A wave of images is packed First-Fit-Decreasing into `num_blocks` blocks of `block_size` patches;
each block is one batch row of the vision tower, and per-row bounds keep every query inside its
own image (its own temporal patch). `num_blocks` comes from a configured list of buckets, one
compiled shape each."""

from __future__ import annotations

from dataclasses import dataclass

from mmcli.compiled.buckets import choose_bucket


@dataclass(frozen=True)
class BlockLayout:
    # image indices per block, ascending; len == num_blocks (empty = padding)
    bins: tuple[tuple[int, ...], ...]
    block_size: int
    offsets: tuple[tuple[int, int], ...]  # per image: (block, start row inside the block)

    @property
    def num_blocks(self) -> int:
        return len(self.bins)


def ffd_pack(tokens: list[int], block_size: int) -> list[list[int]]:
    """First-Fit-Decreasing: image indices per block, fewest blocks FFD finds. An image over a
    block is an error."""
    too_big = [i for i, t in enumerate(tokens) if t > block_size]
    if too_big:
        raise ValueError(
            f"image {too_big[0]} has {tokens[too_big[0]]} patches, over block_size {block_size}"
        )
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        for b, free in enumerate(room):
            if free >= tokens[i]:
                bins[b].append(i)
                room[b] -= tokens[i]
                break
        else:
            bins.append([i])
            room.append(block_size - tokens[i])
    return bins


def vision_calls(bins: list[list[int]], most_blocks: int) -> list[list[list[int]]]:
    """The blocks of a wave in calls of at most `most_blocks` (the largest bucket), in order."""
    return [bins[start : start + most_blocks] for start in range(0, len(bins), most_blocks)]


def make_layout(
    tokens: list[int], bins: list[list[int]], num_blocks: int, block_size: int
) -> BlockLayout:
    """Images of a block sit in ascending index order from row 0; blocks past the packed ones are
    padding."""
    if len(bins) > num_blocks:
        raise ValueError(f"{len(bins)} packed blocks do not fit {num_blocks}")
    padded = [tuple(sorted(b)) for b in bins] + [()] * (num_blocks - len(bins))
    offsets: dict[int, tuple[int, int]] = {}
    for block, images in enumerate(padded):
        start = 0
        for i in images:
            offsets[i] = (block, start)
            start += tokens[i]
        if start > block_size:
            raise ValueError(f"block {block} holds {start} patches, over block_size {block_size}")
    return BlockLayout(tuple(padded), block_size, tuple(offsets[i] for i in range(len(tokens))))


def gather_index(tokens: list[int], layout: BlockLayout) -> list[int]:
    """For each of the num_blocks * block_size rows, the flat (image-order) row it takes, or -1
    for padding."""
    starts = [sum(tokens[:i]) for i in range(len(tokens))]
    index = [-1] * (layout.num_blocks * layout.block_size)
    for i, (block, start) in enumerate(layout.offsets):
        base = block * layout.block_size + start
        index[base : base + tokens[i]] = range(starts[i], starts[i] + tokens[i])
    return index


def block_bounds(frame_tokens: list[list[int]], layout: BlockLayout) -> tuple[list[int], list[int]]:
    """Per row, block-local [bound_min, bound_max): the row's own temporal patch. Padding rows
    get 0/0.

    frame_tokens[i] lists the patches of each temporal patch of image i (h*w repeated t times)."""
    size = layout.num_blocks * layout.block_size
    bmin, bmax = [0] * size, [0] * size
    for i, (block, start) in enumerate(layout.offsets):
        for n in frame_tokens[i]:
            base = block * layout.block_size + start
            bmin[base : base + n] = [start] * n
            bmax[base : base + n] = [start + n] * n
            start += n
    return bmin, bmax


def unpack_index(tokens: list[int], layout: BlockLayout, merge_unit: int) -> list[int]:
    """Rows of the merged packed output [num_blocks * block_size / merge_unit] in image order."""
    merged = layout.block_size // merge_unit
    out: list[int] = []
    for i, (block, start) in enumerate(layout.offsets):
        first = block * merged + start // merge_unit
        out.extend(range(first, first + tokens[i] // merge_unit))
    return out


def packed_efficiency(tokens: list[int], num_blocks: int, block_size: int) -> float:
    """Useful attention work over computed: sum t_i^2 / (num_blocks * block_size^2)."""
    return sum(t * t for t in tokens) / (num_blocks * block_size**2)


def flat_efficiency(tokens: list[int]) -> float:
    """One flat sequence with a block-diagonal mask: sum t_i^2 / (sum t_i)^2."""
    return sum(t * t for t in tokens) / sum(tokens) ** 2


def padded_efficiency(tokens: list[int]) -> float:
    """Every image padded to the largest, one per batch row: sum t_i^2 / (n * max^2)."""
    return sum(t * t for t in tokens) / (len(tokens) * max(tokens) ** 2)


def vision_work(
    tokens: list[int], block_size: int, hidden: int = 1024, intermediate: int = 4096
) -> float:
    """Estimated FLOPs per vision layer when packed in blocks of `block_size` (fewest blocks, no
    bucket): padded linear work (qkv, proj, MLP on every row) plus block attention (QK^T and AV
    over whole blocks)."""
    rows = len(ffd_pack(tokens, block_size)) * block_size
    return rows * (8 * hidden * hidden + 4 * hidden * intermediate) + rows * block_size * 4 * hidden


def recommend_block_size(tokens: list[int], align: int = 128, **dims) -> int:
    """Among multiples of `align` that hold the largest image (up to the whole wave), the least
    vision work."""
    largest, total = max(tokens), sum(tokens)
    first = -(-largest // align) * align
    # beyond 16K patches blocks only get costlier
    last = max(first, min(-(-total // align) * align, 16384))
    candidates = range(first, last + 1, align)
    return min(candidates, key=lambda bs: (vision_work(tokens, bs, **dims), bs))


def choose_wave(
    request_tokens: list[list[int]], max_items: int, block_size: int, buckets: list[int]
) -> list[int]:
    """Which waiting requests (a look-ahead window, oldest first) to encode together, at most
    `max_items`.

    The oldest always goes (no starvation); then, one at a time, the request whose addition
    leaves the fewest padding rows in the bucket the wave needs. Arrival order would take the
    next ones whatever they cost."""

    def padding(indices: list[int]) -> tuple[int, int]:
        patches = [t for i in indices for t in request_tokens[i]]
        if not patches:
            return 0, 0
        blocks = choose_bucket(len(ffd_pack(patches, block_size)), buckets)
        return blocks * block_size - sum(patches), blocks

    chosen = [0]
    rest = list(range(1, len(request_tokens)))
    while rest and len(chosen) < max_items:
        fitting = [
            i
            for i in rest
            if len(ffd_pack([t for j in chosen + [i] for t in request_tokens[j]], block_size))
            <= max(buckets)
        ]
        if not fitting:
            break
        best = min(fitting, key=lambda i: (padding(chosen + [i]), i))
        chosen.append(best)
        rest.remove(best)
    return sorted(chosen)
