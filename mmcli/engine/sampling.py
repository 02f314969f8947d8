"""Next-token choice per sequence: the repetition, presence and frequency penalties, temperature,
top-k, top-p, min-p, seeded per (seed, key, step)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from mmcli.config import SamplingParams


def step_seed(seed: int, key: str, task: str, step: int) -> int:
    """A seed that depends only on the run seed, the item, the task and the step, never on batch
    neighbours: each task of an item draws from its own stream."""
    digest = hashlib.blake2b(f"{seed}\0{key}\0{task}\0{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


# A sequence's (prompt ids, generated ids): what the penalties read
History = tuple[list[int], list[int]]


def _filter(scores: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The scores (temperature applied) with the tokens top-k, top-p and min-p rule out at
    -inf; the most likely token always stays."""
    if p.top_k > 0 and p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        remove = cumulative <= (1 - p.top_p)
        remove[-1] = False  # always keep the most likely token
        scores = scores.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    if p.min_p > 0.0:  # p(token) < min_p * p(top)  <=>  score < top + log(min_p)
        scores = scores.masked_fill(scores < scores.max() + math.log(p.min_p), float("-inf"))
    return scores


def penalized(scores: torch.Tensor, p: SamplingParams, history: History) -> torch.Tensor:
    """A row's scores with its penalties: repetition over the prompt and the tokens generated
    (CTRL's, as transformers applies it), presence and frequency over the tokens generated
    (OpenAI's, as vLLM applies them)."""
    prompt, generated = history
    scores = scores.clone()
    if p.repetition_penalty != 1.0 and (prompt or generated):
        seen = torch.tensor(sorted(set(prompt) | set(generated)), device=scores.device)
        picked = scores[seen]
        scores[seen] = torch.where(
            picked < 0, picked * p.repetition_penalty, picked / p.repetition_penalty
        )
    if (p.presence_penalty or p.frequency_penalty) and generated:
        ids, counts = torch.tensor(generated, device=scores.device).unique(return_counts=True)
        scores[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(scores.dtype)
    return scores


def choose_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[History | None],
    seeds: list[int],
    model_logits: torch.Tensor | None = None,
) -> tuple[list[int], list[float]]:
    """One token per row of `logits` [B, V], and its log-probability under the model
    (`model_logits`, default `logits`: unprocessed by penalties, temperature or a grammar's
    mask). Greedy rows without a penalty are chosen together on the device; the tokens and
    log-probabilities come back to the host in one copy (on CUDA, the decode loop's one
    synchronisation). A row's history is needed only where its sampling is `penalized`."""
    logits = logits.float()
    logprobs = torch.log_softmax(
        model_logits.float() if model_logits is not None else logits, dim=-1
    )
    chosen = logits.argmax(-1)
    for i, (row, p, history, seed) in enumerate(zip(logits, params, histories, seeds)):
        if p.temperature == 0.0 and not p.penalized:
            continue
        scores = penalized(row, p, history) if p.penalized else row
        if p.temperature == 0.0:
            chosen[i] = torch.argmax(scores)
            continue
        scores = _filter(scores / p.temperature, p)
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
    histories: list[History | None],
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
