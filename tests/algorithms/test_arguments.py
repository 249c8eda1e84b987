"""The shared checks of counts and numbers: one range rule, one message, for every parameter that uses them."""

import math

import numpy as np
import pytest

from lightning_dist.algorithms.arguments import check_count, check_number


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3)])
def test_a_count_in_range_comes_back_as_a_python_int(value):
    result = check_count("k", value, 1, 5)
    assert result == 3 and type(result) is int


@pytest.mark.parametrize(("value", "message"), [
    (0, r"k must be an integer in \[1, 5\] \(peers\); got 0"),
    (6, r"k must be an integer in \[1, 5\] \(peers\); got 6"),
    (True, r"k must be an integer in \[1, 5\] \(peers\); got True"),
    (2.0, r"k must be an integer in \[1, 5\] \(peers\); got 2.0"),
    ("2", r"k must be an integer in \[1, 5\] \(peers\); got '2'"),
])
def test_a_bad_count_names_the_parameter_the_range_and_the_value(value, message):
    with pytest.raises(ValueError, match=message):
        check_count("k", value, 1, 5, meaning=" (peers)")


def test_a_count_without_upper_bound_says_so():
    with pytest.raises(ValueError, match=r"seed must be an integer >= 0; got -1"):
        check_count("seed", -1, 0)


@pytest.mark.parametrize("value", [0.5, 1, np.float32(0.5), np.int64(2)])
def test_a_number_above_the_bound_comes_back_as_a_float(value):
    result = check_number("alpha", value, 0.0, strict=True)
    assert result == float(value) and type(result) is float


@pytest.mark.parametrize(("value", "strict", "message"), [
    (0.0, True, r"alpha must be a finite number > 0; got 0.0"),
    (-0.1, False, r"alpha must be a finite number >= 0; got -0.1"),
    (math.nan, False, r"alpha must be a finite number >= 0; got nan"),
    (math.inf, True, r"alpha must be a finite number > 0; got inf"),
    (True, True, r"alpha must be a finite number > 0; got True"),
    ("1", True, r"alpha must be a finite number > 0; got '1'"),
])
def test_a_bad_number_names_the_parameter_the_bound_and_the_value(value, strict, message):
    with pytest.raises(ValueError, match=message):
        check_number("alpha", value, 0.0, strict=strict)


def test_the_bound_itself_passes_unless_strict():
    assert check_number("growth", 1, 1.0, strict=False) == 1.0
    with pytest.raises(ValueError, match=r"growth must be a finite number > 1"):
        check_number("growth", 1, 1.0, strict=True)
