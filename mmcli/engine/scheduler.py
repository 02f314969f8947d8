"""The scheduler: waiting and running sequences, free slots and admission, in plain Python.

Waiting requests are admitted as running ones finish. With vision inputs, a look-ahead window
picks the wave that packs into vision blocks with least padding; an input's tasks (a group) are
admitted together so that they share their prompt prefix; newly admitted prompts share a token
budget, and the KV cache they grow one of its own."""

from __future__ import annotations

from collections import deque

from mmcli.config import Config
from mmcli.engine.packing import choose_wave
from mmcli.engine.sequence import Request, Sequence, cache_columns


class Scheduler:
    def __init__(
        self,
        config: Config,
        cache_shape: tuple[int, int] | None = (0, 0),
        row_columns: int = 0,
    ):
        """`config` as a run resolved it: its engine's limits set (config.engine_for).
        `cache_shape`: the KV cache's rows and columns as earlier jobs grew it (it never
        shrinks), or None where it is fixed (held whole from the start: no budget to keep).
        `row_columns`: what each row holds whatever its length (a hybrid decoder's linear
        layers' states), as the K/V columns of as many bytes (runner.row_columns)."""
        engine = config.engine
        if engine.max_seqs < 1 or engine.max_cache_tokens < 1:
            raise ValueError(f"the scheduler takes a run's engine settings, not {engine}")
        self.max_seqs, self.max_len = engine.max_seqs, engine.max_len
        self.max_prefill_tokens = engine.max_prefill_tokens
        # max_cache_tokens / max_len rows of max_len, each with its fixed part
        self.row_columns = row_columns
        self.cache_budget = engine.max_cache_tokens * (self.max_len + row_columns) // self.max_len
        self.cache_shape = cache_shape  # grown by the sequences admitted
        self.lookahead = config.vision.lookahead
        self.block_size = config.vision.block_size
        self.num_blocks_buckets = list(config.vision.num_blocks_buckets)
        self.waiting: deque[Request] = deque()
        self.running: list[Sequence] = []
        self.free = list(range(self.max_seqs))

    @property
    def wants_more(self) -> bool:
        """Room to look further ahead in the inputs."""
        return len(self.waiting) < max(self.max_seqs, self.lookahead)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def admit(self) -> list[Sequence]:
        """Sequences admitted now, each in the lowest free slot, to be prefilled together."""
        if not self.waiting or not self.free:
            return []
        self.free.sort()
        admitted = [Sequence(req, self.free.pop(0)) for req in self._pick(len(self.free))]
        self.running.extend(admitted)
        return admitted

    def decoding(self) -> list[Sequence]:
        """The running sequences that go on, in slot order."""
        return sorted((s for s in self.running if not s.finished), key=lambda s: s.slot)

    def finish(self) -> list[Sequence]:
        """Sequences that stopped (or were cancelled), out of the running set, their slots
        freed; cancelled requests that still wait are dropped."""
        for seq in self.running:
            if seq.request.cancelled and not seq.finished:
                seq.finish_reason = "cancelled"
        if any(r.cancelled for r in self.waiting):
            kept = [r for r in self.waiting if not r.cancelled]
            self.waiting.clear()
            self.waiting.extend(kept)
        done = [s for s in self.running if s.finished]
        for seq in done:
            self.running.remove(seq)
            self.free.append(seq.slot)
        return done

    def append(self, seq: Sequence, token: int, logprob: float) -> None:
        """A chosen token, and whether it stops the sequence (an eos id, or a length limit)."""
        req = seq.request
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        if token in req.stop_ids:
            seq.finish_reason = "stop"
        elif len(seq.token_ids) >= req.sampling.max_new_tokens or seq.num_tokens >= self.max_len:
            seq.finish_reason = "length"

    def _pick(self, slots: int) -> list[Request]:
        window = list(self.waiting)[: self.lookahead]
        if any(r.group is not None for r in window):
            picked = whole_groups(window, slots, self.max_seqs)
        elif len(window) <= slots:
            picked = window
        else:
            patches = [r.vision_patches for r in window]
            wave = choose_wave(patches, slots, self.block_size, self.num_blocks_buckets)
            picked = [window[i] for i in wave]
        admitted = self._within_cache(within_budget(picked, self.max_prefill_tokens))
        taken = {id(r) for r in admitted}  # by identity: requests hold tensors
        kept = [r for r in self.waiting if id(r) not in taken]
        self.waiting.clear()
        self.waiting.extend(kept)
        return admitted

    def _within_cache(self, picked: list[Request]) -> list[Request]:
        """The first of `picked` whose rows keep the cache within its budget (rows x columns: to
        the highest slot, and the longest reach, with each row's fixed part), each in the next
        free slot; always one where none runs, and a group is not cut. All of them where the
        cache is fixed."""
        if self.cache_shape is None:
            return picked
        (rows, columns), admitted = self.cache_shape, []
        for req, slot in zip(picked, self.free):
            reach = cache_columns(req.reach(self.max_len), self.max_len)
            grown = max(rows, slot + 1), max(columns, reach)
            fits = grown[0] * (grown[1] + self.row_columns) <= self.cache_budget
            alone = not self.running and not admitted
            in_group = bool(admitted) and req.group is not None and req.group == admitted[-1].group
            if not (fits or alone or in_group):
                break
            admitted.append(req)
            rows, columns = grown
        self.cache_shape = (rows, columns)
        return admitted


def whole_groups(window: list[Request], slots: int, max_seqs: int) -> list[Request]:
    """Whole groups in order while they fit the free slots; a group that does not fit waits for
    slots to free up, unless it is larger than all of them (then it is split)."""
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


def within_budget(picked: list[Request], budget: int) -> list[Request]:
    """The first of `picked` whose prompts fit `budget` tokens (always one; a group is not cut)."""
    admitted: list[Request] = []
    for req in picked:
        same_group = req.group is not None and req.group == admitted[-1].group if admitted else True
        if len(req.input_ids) > budget and not same_group:
            break
        admitted.append(req)
        budget -= len(req.input_ids)
    return admitted
