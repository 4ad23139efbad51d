"""The recipe checked against this process before anything is written."""

from __future__ import annotations

import pytest


def test_v_shaped_pipeline_schedules_need_torch_2_13(monkeypatch):
    import torch

    from glmtune.config import load_config
    from glmtune.train.process import check_recipe

    cfg = load_config("tiny/sft_support_json", ["--parallel.pp", "2", "--parallel.pp_schedule", "ZBVZeroBubble",
                                                "--parallel.pp_stages_per_rank", "2", "--train.generate_samples", "0"])
    assert check_recipe(cfg, 2, torch.device("cpu")).pp == 2  # this machine's torch
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(ValueError, match=r"^parallel.pp_schedule ZBVZeroBubble needs torch >= 2.13 here \(this is "
                                         r"torch 2.11.0\+cu130: on 2.11 its stage initialisation fails\)"):
        check_recipe(cfg, 2, torch.device("cpu"))
