import math

import pytest

from glmtune.train.lr_schedule import lr_factor


def test_warmup_then_cosine_to_floor():
    values = [lr_factor(s, 10, 110, "cosine", 0.1) for s in range(110)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert values[10] == pytest.approx(1.0)
    assert values[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(110, 10, 110, "cosine", 0.1) == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[10:], values[11:]))


def test_linear_constant_and_unknown():
    assert lr_factor(55, 5, 105, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(99, 5, 105, "constant", 0.0) == 1.0
    with pytest.raises(ValueError, match="optim.scheduler"):
        lr_factor(50, 5, 105, "step", 0.0)
