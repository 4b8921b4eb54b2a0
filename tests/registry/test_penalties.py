"""Biases and penalties on a sequence's logits, on hand-made ones."""

from __future__ import annotations

import pytest
import torch

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import Sampling
from modelpool.registry.loaders.penalties import Penalties, check_logit_bias

PROMPT = torch.tensor([[1, 1, 3]])  # the (1, n) input_ids a sequence starts from


def _penalties(**fields: object) -> Penalties:
    made = Penalties.of(Sampling(**fields), PROMPT)  # type: ignore[arg-type]
    assert made is not None
    return made


@pytest.mark.parametrize("fields", [
    {}, {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}])
def test_a_sequence_that_asks_for_no_penalty_has_none(fields: dict[str, float]) -> None:
    assert Penalties.of(Sampling(**fields), PROMPT) is None  # type: ignore[arg-type]


def test_repetition_divides_a_seen_tokens_positive_logit_and_multiplies_a_negative_one(
        ) -> None:
    penalties = _penalties(repetition_penalty=2.0)
    logits = torch.tensor([4.0, 4.0, 4.0, -4.0, -4.0])
    assert penalties.apply(logits).tolist() == [4.0, 2.0, 4.0, -8.0, -4.0]  # 1 and 3: prompt
    penalties.add(4)  # output counts as seen too
    assert penalties.apply(logits).tolist() == [4.0, 2.0, 4.0, -8.0, -8.0]
    assert logits.tolist() == [4.0, 4.0, 4.0, -4.0, -4.0]  # a new tensor


def test_frequency_counts_each_output_token_and_presence_only_once() -> None:
    penalties = _penalties(frequency_penalty=0.5, presence_penalty=1.0)
    logits = torch.zeros(4)
    assert penalties.apply(logits).tolist() == [0.0] * 4  # the prompt is not output
    for token in (2, 2, 2, 0):
        penalties.add(token)
    assert penalties.apply(logits).tolist() == [-1.5, 0.0, -2.5, 0.0]


def test_a_negative_frequency_or_presence_penalty_favours_the_output_tokens() -> None:
    penalties = _penalties(frequency_penalty=-1.0, presence_penalty=-0.5)
    penalties.apply(torch.zeros(3))
    penalties.add(1)
    penalties.add(1)
    assert penalties.apply(torch.zeros(3)).tolist() == [0.0, 2.5, 0.0]


def test_repetition_comes_before_frequency_as_vllm_applies_them() -> None:
    penalties = _penalties(repetition_penalty=2.0, frequency_penalty=1.0)
    penalties.apply(torch.zeros(3))
    penalties.add(2)
    # (4 / 2) - 1, not (4 - 1) / 2
    assert penalties.apply(torch.tensor([0.0, 0.0, 4.0])).tolist() == [0.0, 0.0, 1.0]


def test_ids_outside_the_vocabulary_are_not_counted() -> None:
    penalties = Penalties(torch.tensor([[0, 7, -1]]), 0.0, 1.0, 2.0)
    assert penalties.apply(torch.ones(2)).tolist() == [0.5, 1.0]
    penalties.add(5)
    assert penalties.apply(torch.ones(2)).tolist() == [0.5, 1.0]


def test_a_logit_bias_is_added_to_its_tokens_before_the_penalties() -> None:
    penalties = _penalties(logit_bias={0: 4.0, 2: -100.0}, repetition_penalty=2.0)
    # token 1 is in the prompt: halved; token 0 biased to 5, not in the prompt
    assert penalties.apply(torch.tensor([1.0, 2.0, 1.0])).tolist() == [5.0, 1.0, -99.0]
    penalties.add(0)  # (1 + 4) / 2, not 1 / 2 + 4
    assert penalties.apply(torch.tensor([1.0, 2.0, 1.0])).tolist() == [2.5, 1.0, -99.0]


def test_a_logit_bias_alone_is_a_penalty_and_an_empty_one_is_none() -> None:
    assert Penalties.of(Sampling(logit_bias={}), PROMPT) is None
    assert Penalties.of(Sampling(logit_bias={3: 1.0}), PROMPT) is not None


def test_a_logit_bias_for_a_token_the_model_lacks_is_refused() -> None:
    check_logit_bias(Sampling(logit_bias={9: 1.0}), 10, "m")
    check_logit_bias(Sampling(logit_bias={10: 1.0}), None, "m")  # a model that does not say
    with pytest.raises(PoolError, match="logit_bias names token 10; model 'm' has 10") as err:
        check_logit_bias(Sampling(logit_bias={3: 1.0, 10: 1.0}), 10, "m")
    assert err.value.code is ErrorCode.BAD_REQUEST
