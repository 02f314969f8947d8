"""The next-token choice: each penalty as its definition states it, min-p's cut, and the choice
depending only on its row (batch-invariant) and seed."""

import pytest
import torch

from mmcli.config import SamplingParams
from mmcli.engine.sampling import choose_tokens, penalized


def test_presence_and_frequency_penalties_are_openais_over_the_generated_tokens():
    scores = torch.zeros(6)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = penalized(scores, p, ([4, 4, 5], [1, 1, 1, 2]))  # the prompt's tokens are not counted
    assert out.tolist() == [0.0, -(0.5 + 3 * 0.25), -(0.5 + 0.25), 0.0, 0.0, 0.0]
    assert scores.tolist() == [0.0] * 6  # the row itself is left alone


def test_the_repetition_penalty_reads_the_prompt_and_the_generated_tokens():
    scores = torch.tensor([2.0, -2.0, 2.0, 1.0])
    out = penalized(scores, SamplingParams(repetition_penalty=2.0), ([0], [1]))
    assert out.tolist() == [1.0, -4.0, 2.0, 1.0]


def test_a_presence_penalty_turns_a_greedy_choice_away_from_a_repeated_token():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    greedy = SamplingParams()
    assert choose_tokens(logits, [greedy], [None], [0])[0] == [0]
    pushed = SamplingParams(presence_penalty=1.0)
    tokens, logprobs = choose_tokens(logits, [pushed], [([], [0])], [0])
    # the log-probability is still the model's own
    assert tokens == [1] and logprobs[0] == pytest.approx(logits.log_softmax(-1)[0, 1].item())


def test_min_p_keeps_only_tokens_near_the_most_likely_one():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(200, 1)
    p = SamplingParams(temperature=1.0, min_p=0.25)  # keeps p >= 0.125: tokens 0, 1, 2
    tokens, _ = choose_tokens(logits, [p] * 200, [None] * 200, list(range(200)))
    assert set(tokens) == {0, 1, 2}


def test_a_penalized_sampled_choice_depends_on_its_row_and_seed_alone():
    torch.manual_seed(0)
    row = torch.randn(1, 50)
    p = SamplingParams(temperature=0.8, presence_penalty=1.5, frequency_penalty=0.5)
    history = ([1, 2], [3, 3, 7])
    alone = choose_tokens(row, [p], [history], [42])[0]
    others = torch.randn(3, 50)
    batch = torch.cat([others[:1], row, others[1:]])
    mixed = choose_tokens(batch, [SamplingParams(), p, p, p], [None, history, ([], []), ([], [5])],
                          [1, 42, 2, 3])[0]  # fmt: skip
    assert mixed[1] == alone[0]


def test_out_of_range_penalties_are_refused_naming_the_key():
    from mmcli.errors import ConfigError

    with pytest.raises(ConfigError, match="presence_penalty"):
        SamplingParams(presence_penalty=3.0)
    with pytest.raises(ConfigError, match="min_p"):
        SamplingParams(min_p=1.5)
    assert "min_p" not in SamplingParams().as_dict()  # records before these existed stay current
    assert SamplingParams(min_p=0.1).as_dict()["min_p"] == 0.1
