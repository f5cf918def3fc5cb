from typing import Literal

import pytest

from lit_losses.choices import check_choice
from lit_losses.errors import ConfigError


def test_accepts_a_choice_of_a_literal_or_a_tuple():
    assert check_choice("b", Literal["a", "b"], "x") == "b"
    assert check_choice(2, (1, 2), "x") == 2


def test_refuses_with_where_the_allowed_values_and_the_closest():
    with pytest.raises(
        ConfigError,
        match=r"^model\.loss_agg 'tokn-mean' is not one of \('token-mean', 'token-sum'\); "
        r"did you mean 'token-mean'\?$",
    ):
        check_choice("tokn-mean", Literal["token-mean", "token-sum"], "model.loss_agg")
