"""Next-token choice per sequence: repetition penalty, temperature, top-k, top-p, seeded per
(seed, key, step)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from mmcli.config import SamplingParams


def step_seed(seed: int, key: str, task: str, step: int) -> int:
    """A seed that depends only on the run seed, the item, the task and the step, never on batch
    neighbours: each task of an item draws from its own stream."""
    digest = hashlib.blake2b(f"{seed}\0{key}\0{task}\0{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _filter_top_k_top_p(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        remove = cumulative <= (1 - top_p)
        remove[-1] = False  # always keep the most likely token
        scores = scores.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    return scores


def choose_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[list[int]],
    seeds: list[int],
    model_logits: torch.Tensor | None = None,
) -> tuple[list[int], list[float]]:
    """One token per row of `logits` [B, V], and its log-probability under the model
    (`model_logits`, default `logits`: unprocessed by penalties, temperature or a grammar's
    mask). Greedy rows without a penalty are chosen together on the device; the tokens and
    log-probabilities come back to the host in one copy (on CUDA, the decode loop's one
    synchronisation)."""
    logits = logits.float()
    logprobs = torch.log_softmax(
        model_logits.float() if model_logits is not None else logits, dim=-1
    )
    chosen = logits.argmax(-1)
    for i, (row, p, history, seed) in enumerate(zip(logits, params, histories, seeds)):
        if p.temperature == 0.0 and (p.repetition_penalty == 1.0 or not history):
            continue
        scores = row
        if p.repetition_penalty != 1.0 and history:
            seen = torch.tensor(sorted(set(history)), device=row.device)
            picked = scores[seen]
            scores = scores.clone()
            scores[seen] = torch.where(
                picked < 0, picked * p.repetition_penalty, picked / p.repetition_penalty
            )
        if p.temperature == 0.0:
            chosen[i] = torch.argmax(scores)
            continue
        scores = _filter_top_k_top_p(scores / p.temperature, p.top_k, p.top_p)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        probs = scores.softmax(-1).cpu()
        chosen[i] = int(torch.multinomial(probs, 1, generator=generator))
    picked = logprobs.gather(1, chosen[:, None]).squeeze(1)
    both = torch.stack([chosen.double(), picked.double()]).cpu()
    return [int(t) for t in both[0].tolist()], both[1].tolist()


@dataclass
class Choice:
    token_id: int
    logprob: float


def choose(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[list[int]],
    seeds: list[int],
    constraints: list | None = None,
) -> list[Choice]:
    """Next tokens; a row with a grammar constraint chooses among the tokens it allows (its
    log-probability is still the model's own)."""
    scores = logits
    if constraints and any(c is not None for c in constraints):
        scores = logits.float().clone()
        for row, constraint in zip(scores, constraints):
            if constraint is not None:
                constraint.mask(row)
    tokens, logprobs = choose_tokens(scores, params, histories, seeds, model_logits=logits)
    return [Choice(t, lp) for t, lp in zip(tokens, logprobs)]


def top_logprobs(logits: torch.Tensor, counts: list[int]) -> list[list[tuple[int, float]]] | None:
    """Per row, its `counts[i]` most likely tokens and their log-probabilities under the model
    (None when no row asks for any)."""
    most = max(counts, default=0)
    if most == 0:
        return None
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(most, dim=-1)
    rows = zip(ids.cpu().tolist(), values.double().cpu().tolist(), counts)
    return [list(zip(i[:n], v[:n])) for i, v, n in rows]
