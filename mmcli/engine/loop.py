"""The engine: requests, a continuous-batching scheduler and stop rules, in plain Python (no tensors).

Waiting requests are admitted as running ones finish; newly admitted prompts are prefilled together without
padding; every running sequence then advances by one token per decode step. A result is handed out the moment
its sequence stops.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mmcli.config import Config, SamplingParams
from mmcli.errors import ItemError
from mmcli.engine.packing import choose_wave
from mmcli.engine.runner import DecodeItem, ModelRunner, PrefillItem
from mmcli.engine.sampling import step_seed

_END = object()


@dataclass(eq=False)
class Request:
    key: str
    input_ids: list[int]
    rotary_position_ids: Any  # [3, L], opaque here
    rope_delta: int
    pixel_values: list[Any]
    image_grids: list[tuple[int, int, int]]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    num_image_tokens: int = 0
    image_hashes: list[str] = field(default_factory=list)  # content hash per image: one encode per run
    task: str = ""
    group: str | None = None  # requests of one group (an image's tasks) share their first prefix_len tokens
    prefix_len: int = 0
    constraint: Any = None  # a grammar.SequenceConstraint: the tokens this sequence may take, step by step


@dataclass
class Sequence:
    request: Request
    slot: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.request.input_ids) + len(self.token_ids)


@dataclass
class Finished:
    key: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (an eos id) or "length" (max_new_tokens or the context limit)
    num_input_tokens: int
    num_image_tokens: int
    task: str = ""
    constraint: Any = None


class Engine:
    def __init__(self, runner: ModelRunner, config: Config):
        self.runner = runner
        self.max_seqs, self.max_len = config.engine.max_seqs, config.engine.max_len
        self.max_prefill_tokens, self.lookahead = config.engine.max_prefill_tokens, config.vision.lookahead
        self.block_size, self.num_blocks_buckets = config.vision.block_size, list(config.vision.num_blocks_buckets)
        self.on_token: Callable[[str, int], None] | None = None  # the running generate() call's callback
        self.input_wait = 0.0  # seconds the engine had nothing to run while inputs were being prepared

    def _pick(self, waiting: deque[Request], slots: int) -> list[Request]:
        """The requests to admit now: with vision blocks, the look-ahead wave that packs with least padding; an
        image's tasks (a group) are admitted together, so that they share their prompt prefix."""
        window = list(waiting)[:self.lookahead]
        if any(r.group is not None for r in window):
            picked = self._whole_groups(window, slots, self.max_seqs)
        elif len(window) <= slots:
            picked = window[:slots]
        else:
            patches = [[t * h * w for t, h, w in r.image_grids] for r in window]
            picked = [window[i] for i in choose_wave(patches, slots, self.block_size, self.num_blocks_buckets)]
        admitted, budget = [], self.max_prefill_tokens
        for req in picked:
            if admitted and len(req.input_ids) > budget and req.group != admitted[-1].group:
                break
            admitted.append(req)
            budget -= len(req.input_ids)
        taken = {id(r) for r in admitted}
        kept = [r for r in waiting if id(r) not in taken]  # by identity: requests hold tensors
        waiting.clear()
        waiting.extend(kept)
        return admitted

    @staticmethod
    def _whole_groups(window: list[Request], slots: int, max_seqs: int) -> list[Request]:
        """Whole groups in order while they fit the free slots; a group that does not fit waits for slots to free
        up, unless it is larger than all of them (then it is split)."""
        units: dict[object, list[Request]] = {}
        for req in window:
            units.setdefault(req.group if req.group is not None else id(req), []).append(req)
        picked: list[Request] = []
        for unit in units.values():
            if len(picked) + len(unit) > slots:
                if not picked and len(unit) > max_seqs:
                    picked = unit[:slots]
                break
            picked.extend(unit)
        return picked

    def _append(self, seq: Sequence, token: int, logprob: float) -> None:
        req = seq.request
        if req.constraint is not None:
            req.constraint.consume(token)
        if self.on_token is not None:
            self.on_token(req.key, token)
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        if token in req.stop_ids:
            seq.finish_reason = "stop"
        elif len(seq.token_ids) >= req.sampling.max_new_tokens or seq.num_tokens >= self.max_len:
            seq.finish_reason = "length"

    def _step(self, seqs: list[Sequence], logits) -> None:
        params = [s.request.sampling for s in seqs]
        seeds = [step_seed(s.request.sampling.seed, s.request.key, len(s.token_ids)) for s in seqs]
        # Only the repetition penalty reads the history; skip building it on every step otherwise.
        histories = [s.request.input_ids + s.token_ids if s.request.sampling.repetition_penalty != 1.0 else []
                     for s in seqs]
        constraints = [s.request.constraint for s in seqs]
        for seq, choice in zip(seqs, self.runner.choose(logits, params, histories, seeds, constraints)):
            self._append(seq, choice.token_id, choice.logprob)

    def _prefill_item(self, seq: Sequence) -> PrefillItem:
        req = seq.request
        return PrefillItem(seq.slot, req.input_ids, req.rotary_position_ids, req.pixel_values, req.image_grids,
                           req.image_hashes, min(self.max_len, len(req.input_ids) + req.sampling.max_new_tokens),
                           group=req.group, prefix_len=req.prefix_len)

    def _refill(self, pending: Iterator[Request | None], waiting: deque[Request], busy: bool) -> bool:
        """Take ready requests up to the look-ahead; False once the requests are exhausted. None from `pending`
        means none is ready yet: with sequences to run the engine goes on, with none it waits (counted)."""
        while len(waiting) < max(self.max_seqs, self.lookahead):
            nxt = next(pending, _END)
            if nxt is _END:
                return False
            if nxt is None:
                if busy or waiting:
                    return True
                started = time.perf_counter()
                time.sleep(0.002)
                self.input_wait += time.perf_counter() - started
                continue
            if len(nxt.input_ids) >= self.max_len:
                raise ItemError(f"{nxt.key}: prompt of {len(nxt.input_ids)} tokens does not fit "
                                f"engine.max_len {self.max_len}")
            waiting.append(nxt)
        return True

    def generate(self, requests: Iterable[Request | None], on_token: Callable[[str, int], None] | None = None
                 ) -> Iterator[Finished]:
        """Finished sequences as they finish; `on_token(key, token id)` is called as each token is chosen.
        `requests` may yield None for "none ready yet" (inputs prepared ahead, see inputs.py)."""
        self.on_token = on_token
        pending = iter(requests)
        waiting: deque[Request] = deque()
        running: list[Sequence] = []
        free = list(range(self.max_seqs))
        more = True
        while True:
            more = more and self._refill(pending, waiting, busy=bool(running))
            if not waiting and not running:
                if more:
                    continue
                return
            admitted: list[Sequence] = []
            if waiting and free:
                free.sort()
                admitted = [Sequence(req, free.pop(0)) for req in self._pick(waiting, len(free))]
            if admitted:
                logits = self.runner.prefill([self._prefill_item(s) for s in admitted])
                self._step(admitted, logits)
                running.extend(admitted)
            live = [s for s in running if s.finish_reason is None]
            if live and not admitted:
                live.sort(key=lambda s: s.slot)
                logits = self.runner.decode([DecodeItem(s.slot, s.token_ids[-1], s.num_tokens - 1, s.request.rope_delta)
                                             for s in live])
                self._step(live, logits)
            for seq in [s for s in running if s.finish_reason is not None]:
                running.remove(seq)
                free.append(seq.slot)
                req = seq.request
                yield Finished(req.key, seq.token_ids, seq.logprobs, seq.finish_reason, len(req.input_ids),
                               req.num_image_tokens, req.task, req.constraint)
