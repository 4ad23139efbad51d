"""JSON glmtune writes is RFC 8259 JSON: a NaN or an infinity is written as its name in a string."""

import json
import math

from glmtune.io.json_out import dumps, finite


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_written_as_strings():
    card = {"metrics": [{"value": math.nan}, {"value": 0.5}], "args": ({"x": math.inf, "y": [-math.inf, 1]},),
            math.inf: "key", "text": "NaN"}
    assert _strict(dumps(card)) == {"metrics": [{"value": "NaN"}, {"value": 0.5}],
                                    "args": [{"x": "Infinity", "y": ["-Infinity", 1]}], "Infinity": "key",
                                    "text": "NaN"}
    assert _strict(dumps(card, indent=1, ensure_ascii=False)) == _strict(dumps(card))


def test_finite_values_are_written_as_json_dumps_writes_them():
    value = {"a": [1, 2.5, None, True, "é\x1b"], "b": {"c": -0.0}}
    assert dumps(value) == json.dumps(value) and dumps(value, indent=1) == json.dumps(value, indent=1)
    assert finite(value) == value and finite(math.nan) == "NaN" and finite(-math.inf) == "-Infinity"
