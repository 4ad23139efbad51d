"""Check 3: a tokenizer whose chat template is not its own (or GLM-5's without its markers), and a config of
another architecture."""

from __future__ import annotations

import json
import shutil

from glmtune.data.tokenizer import TINY_TOKENIZER_DIR
from glmtune.preflight.loading import check_model
from tests.preflight.conftest import SFT

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_passes_without_reading_weights(sft_done):
    evidence = sft_done.check(3)["evidence"]
    assert evidence["meta_model"]["bytes_allocated"] == 0
    assert evidence["chat_template"]["rendered_head"].startswith("[gMASK]<sop><|system|>")


def test_foreign_chat_template_fails(tmp_path, fresh):
    tokenizer = shutil.copytree(TINY_TOKENIZER_DIR, tmp_path / "tokenizer")
    (tokenizer / "chat_template.jinja").write_text(CHATML)
    result = check_model(fresh(SFT, "--data.tokenizer", str(tokenizer)))
    assert result.status == "fail"
    # the template's format is ChatML (checks follow it), whose tokens GLM-5's tokenizer lacks
    assert result.message.startswith(f"tokenizer {tokenizer}: <|im_start|> is not one token")
    assert any(f"{tokenizer / 'chat_template.jinja'} has ChatML turns, which need them; use the tokenizer the "
               "template came with" in p for p in result.evidence["problems"])


def test_glm_template_without_its_prefix_and_role_tokens_fails(tmp_path, fresh):
    tokenizer = shutil.copytree(TINY_TOKENIZER_DIR, tmp_path / "tokenizer")
    template = (tokenizer / "chat_template.jinja").read_text()
    (tokenizer / "chat_template.jinja").write_text(template.replace("[gMASK]<sop>", "").replace("<|system|>", ""))
    result = check_model(fresh(SFT, "--data.tokenizer", str(tokenizer)))
    assert result.status == "fail"
    assert result.message.startswith(f"chat template {tokenizer / 'chat_template.jinja'} does not start the "
                                     "conversation with [gMASK]<sop>")
    assert any("renders no <|system|>" in p for p in result.evidence["problems"])


def test_other_architecture_fails(ckpt, fresh):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    result = check_model(fresh(SFT, "--model.name_or_path", str(ckpt), "--data.tokenizer", str(TINY_TOKENIZER_DIR)))
    assert result.status == "fail"
    assert "architectures ['LlamaForCausalLM'], expected [GlmMoeDsaForCausalLM]" in result.message
