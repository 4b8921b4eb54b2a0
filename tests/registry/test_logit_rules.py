"""What a sequence asks done to its logits (biases, penalties, ending tokens held off),
on hand-made ones."""

from __future__ import annotations

import pytest
import torch

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import Sampling
from modelpool.registry.loaders.logit_rules import LogitRules, check_logit_bias

PROMPT = torch.tensor([[1, 1, 3]])  # the (1, n) input_ids a sequence starts from


def _rules(**fields: object) -> LogitRules:
    made = LogitRules.of(Sampling(**fields), PROMPT, set())  # type: ignore[arg-type]
    assert made is not None
    return made


@pytest.mark.parametrize("fields", [
    {}, {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}])
def test_a_sequence_that_asks_for_no_penalty_has_none(fields: dict[str, float]) -> None:
    assert LogitRules.of(Sampling(**fields), PROMPT, set()) is None  # type: ignore[arg-type]


def test_repetition_divides_a_seen_tokens_positive_logit_and_multiplies_a_negative_one(
        ) -> None:
    rules = _rules(repetition_penalty=2.0)
    logits = torch.tensor([4.0, 4.0, 4.0, -4.0, -4.0])
    assert rules.apply(logits).tolist() == [4.0, 2.0, 4.0, -8.0, -4.0]  # 1 and 3: prompt
    rules.add(4)  # output counts as seen too
    assert rules.apply(logits).tolist() == [4.0, 2.0, 4.0, -8.0, -8.0]
    assert logits.tolist() == [4.0, 4.0, 4.0, -4.0, -4.0]  # a new tensor


def test_frequency_counts_each_output_token_and_presence_only_once() -> None:
    rules = _rules(frequency_penalty=0.5, presence_penalty=1.0)
    logits = torch.zeros(4)
    assert rules.apply(logits).tolist() == [0.0] * 4  # the prompt is not output
    for token in (2, 2, 2, 0):
        rules.add(token)
    assert rules.apply(logits).tolist() == [-1.5, 0.0, -2.5, 0.0]


def test_a_negative_frequency_or_presence_penalty_favours_the_output_tokens() -> None:
    rules = _rules(frequency_penalty=-1.0, presence_penalty=-0.5)
    rules.apply(torch.zeros(3))
    rules.add(1)
    rules.add(1)
    assert rules.apply(torch.zeros(3)).tolist() == [0.0, 2.5, 0.0]


def test_repetition_comes_before_frequency_as_vllm_applies_them() -> None:
    rules = _rules(repetition_penalty=2.0, frequency_penalty=1.0)
    rules.apply(torch.zeros(3))
    rules.add(2)
    # (4 / 2) - 1, not (4 - 1) / 2
    assert rules.apply(torch.tensor([0.0, 0.0, 4.0])).tolist() == [0.0, 0.0, 1.0]


def test_ids_outside_the_vocabulary_are_not_counted() -> None:
    rules = LogitRules(torch.tensor([[0, 7, -1]]), 0.0, 1.0, 2.0)
    assert rules.apply(torch.ones(2)).tolist() == [0.5, 1.0]
    rules.add(5)
    assert rules.apply(torch.ones(2)).tolist() == [0.5, 1.0]


def test_a_logit_bias_is_added_to_its_tokens_before_the_rules() -> None:
    rules = _rules(logit_bias={0: 4.0, 2: -100.0}, repetition_penalty=2.0)
    # token 1 is in the prompt: halved; token 0 biased to 5, not in the prompt
    assert rules.apply(torch.tensor([1.0, 2.0, 1.0])).tolist() == [5.0, 1.0, -99.0]
    rules.add(0)  # (1 + 4) / 2, not 1 / 2 + 4
    assert rules.apply(torch.tensor([1.0, 2.0, 1.0])).tolist() == [2.5, 1.0, -99.0]


def test_a_logit_bias_alone_is_a_penalty_and_an_empty_one_is_none() -> None:
    assert LogitRules.of(Sampling(logit_bias={}), PROMPT, set()) is None
    assert LogitRules.of(Sampling(logit_bias={3: 1.0}), PROMPT, set()) is not None


def test_a_logit_bias_for_a_token_the_model_lacks_is_refused() -> None:
    check_logit_bias(Sampling(logit_bias={9: 1.0}), 10, "m")
    check_logit_bias(Sampling(logit_bias={10: 1.0}), None, "m")  # a model that does not say
    with pytest.raises(PoolError, match="logit_bias names token 10; model 'm' has 10") as err:
        check_logit_bias(Sampling(logit_bias={3: 1.0, 10: 1.0}), 10, "m")
    assert err.value.code is ErrorCode.BAD_REQUEST


def test_until_min_tokens_the_tokens_that_would_end_it_are_left_out() -> None:
    made = LogitRules.of(Sampling(min_tokens=2, stop_token_ids=[1]), PROMPT, {3})
    assert made is not None
    logits = torch.tensor([0.0, 5.0, 0.0, 5.0])
    for _ in range(2):
        assert made.apply(logits).tolist() == [0.0, float("-inf"), 0.0, float("-inf")]
        made.add(0)
    assert made.apply(logits).tolist() == [0.0, 5.0, 0.0, 5.0]


def test_min_tokens_leave_eos_alone_when_it_is_ignored_and_alone_are_nothing_to_do() -> None:
    made = LogitRules.of(Sampling(min_tokens=2, ignore_eos=True), PROMPT, {3})
    assert made is None  # no token would end it: nothing to leave out
    made = LogitRules.of(Sampling(min_tokens=2, ignore_eos=True, stop_token_ids=[2]), PROMPT,
                        {3})
    assert made is not None
    assert made.apply(torch.ones(4)).tolist() == [1.0, 1.0, float("-inf"), 1.0]
