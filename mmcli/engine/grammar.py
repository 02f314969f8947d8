"""JSON answers under a schema: llguidance's matcher masks, per sequence, every token the schema
does not allow.

llguidance (the Rust library behind Guidance; no dependencies of its own) compiles a JSON Schema
once per task and gives each sequence a matcher; at every step the runner masks that sequence's
logits row, so a constrained row never changes another row's result. Whitespace between JSON
tokens is not allowed (`whitespace_flexible` off): a model cannot spend its tokens on blanks."""

from __future__ import annotations

from mmcli.errors import ConfigError

INSTALL_HINT = "output json needs llguidance: pip install llguidance"


class JsonGrammar:
    """A task's schema compiled against the checkpoint's tokenizer. With `reasoning_end` (thinking
    mode), each sequence reasons freely and the schema constrains what follows that token."""

    def __init__(
        self,
        task_name: str,
        schema: dict,
        tokenizer_json: str,
        eos_token: int,
        reasoning_end: int | None = None,
        where: str | None = None,
    ):
        """`where`: the setting errors name (default: the task's schema in the config)."""
        self.reasoning_end = reasoning_end
        try:
            import llguidance

            # noqa: F401 - imported here, once (its first import takes seconds)
            import llguidance.torch
        except ImportError:
            raise ConfigError(f"task {task_name}: {INSTALL_HINT}") from None
        self.llguidance = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos_token)
        try:
            self.grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema, overrides={"whitespace_flexible": False}
            )
            error = llguidance.LLMatcher.validate_grammar(self.grammar, self.tokenizer)
        except (ValueError, TypeError, RuntimeError) as e:
            error = str(e)
        if error:
            where = where or f"config tasks.{task_name}.schema"
            raise ConfigError(f"{where}: cannot be compiled to a grammar ({error[:200]})")

    def start(self) -> SequenceConstraint | AfterReasoning:
        constraint = SequenceConstraint(
            self.llguidance.LLMatcher(self.tokenizer, self.grammar), self.tokenizer.vocab_size
        )
        if self.reasoning_end is None:
            return constraint
        return AfterReasoning(constraint, self.reasoning_end)


class SequenceConstraint:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        import llguidance.torch as lt

        self.matcher, self.vocab_size = matcher, vocab_size
        self.bitmask = lt.allocate_token_bitmask(1, vocab_size)

    def mask(self, row) -> None:
        """Set the logits of the tokens the grammar does not allow next to -inf, in place (row
        [V] of a batch)."""
        import llguidance.torch as lt
        import torch

        bitmask = self.bitmask
        lt.fill_next_token_bitmask(self.matcher, bitmask, 0)
        head = row[: self.vocab_size].unsqueeze(0)
        lt.apply_token_bitmask_inplace(head, bitmask.to(row.device))
        row[: self.vocab_size] = head[0]
        # ids past the tokenizer's (the model's padded vocabulary)
        row[self.vocab_size :] = -torch.inf

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


class AfterReasoning:
    """A constraint that holds once the reasoning has ended (thinking mode): until
    `reasoning_end` is chosen nothing is masked; after it, the grammar's."""

    def __init__(self, constraint: SequenceConstraint, reasoning_end: int):
        self.constraint, self.reasoning_end, self.answering = constraint, reasoning_end, False

    def mask(self, row) -> None:
        if self.answering:
            self.constraint.mask(row)

    def consume(self, token: int) -> None:
        if self.answering:
            self.constraint.consume(token)
        else:
            self.answering = token == self.reasoning_end

    @property
    def accepting(self) -> bool:
        return self.answering and self.constraint.accepting


def compile_grammars(
    tasks, tokenizer_json: str, stop_ids: frozenset[int], reasoning_end: int | None = None
) -> dict[str, JsonGrammar]:
    """Each json task's schema compiled once (one that cannot compile is a ConfigError naming
    it)."""
    eos = min(stop_ids) if stop_ids else 0
    return {
        t.name: JsonGrammar(t.name, t.schema, tokenizer_json, eos, reasoning_end)
        for t in tasks
        if t.output == "json"
    }
