"""`data.kind: text` and its keys (glmtune/config/validate.py text_data_errors): each takes effect
or is refused before anything is allocated; the recipes validate."""

from __future__ import annotations

import pytest

from glmtune.config import load_config, validate_config
from glmtune.models.registry import model_dims

TEXT = ["--data.kind", "text", "--data.train", "[corpus.jsonl]"]


def _errors(*overrides: str) -> str:
    cfg = load_config(None, list(overrides))
    dims = model_dims(cfg.model)
    with pytest.raises(ValueError) as info:
        validate_config(cfg, dims.num_experts, dims.num_layers)
    return str(info.value)


def _valid(*overrides: str) -> None:
    cfg = load_config(None, list(overrides))
    dims = model_dims(cfg.model)
    validate_config(cfg, dims.num_experts, dims.num_layers)


@pytest.mark.parametrize("key, value", [
    ("text_field", "body"), ("text_separator", "===="), ("source_field", "family"), ("min_document_tokens", "5"),
    ("max_document_tokens", "100"), ("long_documents", "drop"), ("long_document_overlap", "8"),
])
def test_text_keys_refused_for_chat_data(key: str, value: str) -> None:
    assert f"data.{key} is set but data.kind is chat; set data.kind: text or remove it" in _errors(
        "--data.train", "[x.jsonl]", f"--data.{key}", value)


@pytest.mark.parametrize("key, value, message", [
    ("loss_on", "last_assistant", "data.loss_on is for chat rows and data.kind is text"),
    ("enable_thinking", "true", "data.enable_thinking is for chat rows"),
    ("json_schema", "s.json", "data.json_schema is for chat rows"),
    ("chat_template", "t.jinja", "data.chat_template is for chat rows"),
    ("too_long", "truncate", "data.too_long is for chat rows and data.kind is text; remove it (a document longer"),
    ("synthetic.rows", "10", "data.synthetic is for chat rows"),
    ("format", "hf_datasets", "data.format: hf_datasets with data.kind: text"),
    ("text_field", "''", "data.text_field is empty"),
    ("text_separator", "''", "data.text_separator is empty"),
    ("source_field", "text", "data.source_field must name another key than data.text_field"),
    ("min_document_tokens", "0", "data.min_document_tokens must be >= 1"),
    ("max_document_tokens", "0", "data.max_document_tokens (0) must be >= data.min_document_tokens (1)"),
    ("long_document_overlap", "3000", "data.long_document_overlap must be between 0 and half of"),
])
def test_text_settings_that_cannot_take_effect_are_refused(key: str, value: str, message: str) -> None:
    assert message in _errors(*TEXT, f"--data.{key}", value)


def test_overlap_needs_split_and_sft_only() -> None:
    assert "data.long_document_overlap is set but data.long_documents is drop" in _errors(
        *TEXT, "--data.long_documents", "drop", "--data.long_document_overlap", "4")
    assert "train.objective: dpo needs preference rows" in _errors(*TEXT, "--train.objective", "dpo")
    assert "train.generate_samples answers held-out chat prompts" in _errors(*TEXT, "--train.generate_samples", "4")


def test_text_config_validates() -> None:
    _valid(*TEXT, "--data.source_field", "source", "--data.long_document_overlap", "16",
           "--data.max_document_tokens", "9000", "--data.text_separator", "\n\n\n")


@pytest.mark.parametrize("recipe", ["recipes/tiny/cpt_domain_text.yaml", "recipes/tiny/cpt_lora_domain_text.yaml"])
def test_text_recipes_validate(recipe: str) -> None:
    cfg = load_config(recipe, [])
    assert cfg.data.kind == "text"
    dims = model_dims(cfg.model)
    validate_config(cfg, dims.num_experts, dims.num_layers)
