"""What one forward pass is given: each sequence's prompt (prefill) or next token (decode)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillItem:
    """One sequence's prompt, as the runner needs it."""

    slot: int
    input_ids: list[int]
    rotary_position_ids: torch.Tensor  # [3, L]
    pixel_values: list[torch.Tensor]  # one [n_i, C*T*P*P] per image, in prompt order
    vision_grids: list[tuple[int, int, int]]
    # content hashes; equal images are encoded once
    vision_hashes: list[str] = field(default_factory=list)
    # prompt and output tokens the sequence may reach (KV cache columns to hold)
    max_tokens: int = 0
    # items of one group share their first prefix_len tokens (prefilled once)
    group: str | None = None
    prefix_len: int = 0
    start: int = 0  # the first token's position: its row already holds the tokens before it


@dataclass
class DecodeItem:
    slot: int
    token_id: int
    position: int  # sequential position of this token (= tokens already in the cache)
    rope_delta: int
