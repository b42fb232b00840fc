"""The tests that rely on a time limit being reached size their work with ``runlib.outlasting``:
the sizes that passed only under load (200 steps x 0.2 s in a 60 s walltime with an 8 s margin
finished 0.4 s before the deadline on an idle machine) are refused where they are set."""

from __future__ import annotations

import pytest
from tests.runlib import outlasting

pytestmark = pytest.mark.fast


def test_sizes_that_fit_the_limit_on_a_fast_machine_are_refused() -> None:
    with pytest.raises(ValueError, match="raise the steps or the sleep"):
        outlasting(200, 0.2, time_limit_s=60, stop_margin_s=8)
    with pytest.raises(ValueError):
        outlasting(360, 0.15, time_limit_s=60, stop_margin_s=4)  # 54 s of sleep against 56 s


def test_sizes_whose_sleep_outlasts_the_limit_give_the_overrides() -> None:
    assert outlasting(300, 0.2, time_limit_s=60, stop_margin_s=8) == (
        "train.steps=300",
        "testing.step_sleep_s=0.2",
        "launch.stop_margin_s=8",
        "testing.step_sleep_resumed=false",
    )
