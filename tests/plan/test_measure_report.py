"""The measured rank's report (glmtune/plan/measure_report.py): what it derives from the measurement.

The whole report, from a real measured rank with emulated links, is checked in
tests/distributed/test_link_emulator.py.
"""

from glmtune.plan.measure_report import link_floor


def test_the_link_floor_is_the_compute_or_the_busiest_lane():
    lanes = {"ep": {"all_to_all": 1.5, "all_reduce": 0.25}, "dp_shard": {"all_gather": 1.0}}
    assert link_floor(2.0, lanes) == (2.0, "compute")  # every lane fits under the compute
    assert link_floor(1.0, lanes) == (1.75, "ep")  # one lane's collectives run in turn: 1.5 + 0.25
    assert link_floor(1.0, {}) == (1.0, "compute")  # no collectives
