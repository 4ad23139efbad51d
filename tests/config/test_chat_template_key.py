"""`data.chat_template` was accepted and ignored (the template is the tokenizer directory's own, else
GLM-5's): a recipe that sets it is refused when the recipe is checked, naming the key and what to do."""

from __future__ import annotations

import pytest

from glmtune.config import load_config, validate_config


def test_a_chat_template_path_is_refused_not_ignored():
    validate_config(load_config("tiny/sft_support_json"), 8, 4)  # unset: accepted
    cfg = load_config("tiny/sft_support_json", ["--data.chat_template", "my_template.jinja"])
    with pytest.raises(ValueError, match=r"data.chat_template my_template.jinja: a template file apart from the "
                                         r"tokenizer is not read; save it as chat_template.jinja in the tokenizer "
                                         r"directory \(data.tokenizer\)"):
        validate_config(cfg, 8, 4)
