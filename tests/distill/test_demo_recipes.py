"""The distillation recipes (issue 48): the GLM-5.2 -> smaller GLM-5.2-shaped student recipe validates
at its layout, its student is the cut architecture it says (fewer layers and experts, the KL on:
the teacher's tokenizer), and the tiny demo's scorecard suite loads with ground-truth tickets."""

from __future__ import annotations

from glmtune.config import RECIPES_DIR, load_config, validate_config
from glmtune.eval.suite import load_suite
from glmtune.models.glm5 import get_preset
from glmtune.models.glm5.counts import parameter_report
from glmtune.models.registry import model_dims


def test_the_glm5_student_recipe_validates_and_is_smaller_than_its_teacher():
    cfg = load_config(RECIPES_DIR / "glm5.2" / "distill_to_glm5_small.yaml")
    assert cfg.train.objective == "distill" and cfg.distill.weight > 0
    dims = model_dims(cfg.model)
    assert validate_config(cfg, dims.num_experts, dims.num_layers).world_size == 8
    teacher = get_preset("glm5.2")
    assert (dims.num_layers, dims.num_experts) == (16, 32) < (teacher.num_hidden_layers, teacher.n_routed_experts)
    assert cfg.data.tokenizer and cfg.parallel.pp == cfg.parallel.cp == 1  # the KL: shared tokenizer, whole rows
    student = parameter_report(teacher.replace(**cfg.model.overrides))
    assert round(student["total_params"] / 1e9, 1) == 21.5 and round(student["active_params"] / 1e9, 1) == 8.7


def test_the_tiny_distill_scorecard_suite_scores_ground_truth_tickets():
    suite = load_suite(RECIPES_DIR / "tiny" / "eval_distill_support_json.yaml")
    [tickets] = suite.sets
    assert tickets.path and tickets.path.name == "distill_tickets_seed7.jsonl"  # not the teacher's answers
    assert len(tickets.path.read_text().splitlines()) == 240  # 24 would hold 0 to 6 right by chance alone
    assert [g.metric for g in suite.file.gates] == ["tickets/task_success/exact"] and "tickets/task_success/exact" in suite.metrics
