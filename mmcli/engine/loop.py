"""The engine's step loop: take ready requests, let the scheduler admit them, prefill or decode one
step, hand out each finished sequence the moment it stops."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from mmcli.config import Config
from mmcli.engine.batch import DecodeItem, PrefillItem
from mmcli.engine.runner import ModelRunner
from mmcli.engine.sampling import choose, step_seed, top_logprobs
from mmcli.engine.scheduler import Scheduler
from mmcli.engine.sequence import Finished, Request, Sequence

_END = object()


class Engine:
    def __init__(self, runner: ModelRunner, config: Config):
        self.runner, self.config = runner, config
        self.on_token: Callable[[str, int], None] | None = None  # the current generate() call's
        self.input_wait = 0.0  # seconds with nothing to run while inputs were being prepared
        self.choose = choose  # the next tokens from the logits (sampling.choose)

    def generate(
        self,
        requests: Iterable[Request | None],
        on_token: Callable[[str, int], None] | None = None,
    ) -> Iterator[Finished]:
        """Finished sequences as they finish; `on_token(key, token id)` is called as each token is
        chosen. `requests` may yield None for "none ready yet" (inputs are prepared ahead)."""
        self.on_token = on_token
        scheduler = Scheduler(self.config, self.runner.cache_shape, self.runner.row_columns)
        pending, more = iter(requests), True
        while True:
            more = more and self._take(pending, scheduler)
            if scheduler.idle:
                if more:
                    continue
                return
            self.step(scheduler)
            yield from (Finished.of(seq) for seq in scheduler.finish())

    def step(self, scheduler: Scheduler) -> None:
        """Prefill what the scheduler admits; with nothing admitted, decode the running ones."""
        admitted = scheduler.admit()
        if admitted:
            self._choose(
                scheduler, admitted, self.runner.prefill([self._prefill_item(s) for s in admitted])
            )
            return
        live = scheduler.decoding()
        if live:
            rows = [
                DecodeItem(s.slot, s.token_ids[-1], s.num_tokens - 1, s.request.rope_delta)
                for s in live
            ]
            self._choose(scheduler, live, self.runner.decode(rows))

    def _take(self, pending: Iterator[Request | None], scheduler: Scheduler) -> bool:
        """Take ready requests up to the look-ahead; False once the requests are exhausted. With
        none ready, the engine goes on with what it has, or waits (counted) when it has nothing."""
        while scheduler.wants_more:
            nxt = next(pending, _END)
            if nxt is _END:
                return False
            if nxt is not None:
                scheduler.add(nxt)
                continue
            if not scheduler.idle:
                return True
            started = time.perf_counter()
            time.sleep(0.002)
            self.input_wait += time.perf_counter() - started
        return True

    def _choose(self, scheduler: Scheduler, seqs: list[Sequence], logits) -> None:
        params = [s.request.sampling for s in seqs]
        seeds = [
            step_seed(
                s.request.sampling.seed,
                s.request.seed_key or s.request.key,
                s.request.task,
                len(s.token_ids),
            )
            for s in seqs
        ]
        # Only the penalties read the history: none is built otherwise.
        histories = [
            (s.request.input_ids, s.token_ids) if s.request.sampling.penalized else None
            for s in seqs
        ]
        constraints = [s.request.constraint for s in seqs]
        tops = top_logprobs(logits, [s.request.top_logprobs for s in seqs])
        chosen = self.choose(logits, params, histories, seeds, constraints)
        for i, (seq, choice) in enumerate(zip(seqs, chosen)):
            if tops is not None:
                seq.top_logprobs.append(tops[i])
            if seq.request.constraint is not None:
                seq.request.constraint.consume(choice.token_id)
            if self.on_token is not None:
                self.on_token(seq.request.key, choice.token_id)
            scheduler.append(seq, choice.token_id, choice.logprob)

    def _prefill_item(self, seq: Sequence) -> PrefillItem:
        req = seq.request
        return PrefillItem(
            slot=seq.slot,
            input_ids=req.input_ids,
            rotary_position_ids=req.rotary_position_ids,
            pixel_values=req.pixel_values,
            vision_grids=req.vision_grids,
            vision_hashes=req.vision_hashes,
            max_tokens=req.reach(self.config.engine.max_len),
            group=req.group,
            prefix_len=req.prefix_len,
        )
