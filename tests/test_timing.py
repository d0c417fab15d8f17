"""Timing helpers: the spread of repeated measurements and the busy-machine warning."""

import pytest

from vitflow.timing import busy_warning, spread


def test_spread_and_busy_warning():
    assert spread([100.0]) == 0.0
    assert spread([90.0, 100.0, 110.0]) == pytest.approx(0.2)
    assert busy_warning({"a": [99.0, 100.0, 101.0]}) is None
    warning = busy_warning({"a": [99.0, 100.0, 101.0], "packed": [9.0, 345.0, 200.0]})
    assert warning.startswith("the machine looks busy: rounds of packed spread 168%")
    assert "unreliable" in warning and "a spread" not in warning
