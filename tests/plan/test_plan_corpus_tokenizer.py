"""`glmtune plan` counts a corpus with the tokenizer training will use: for a GLM-5 recipe whose
model is a placeholder (`model.validate_as`, the checkpoint not here) that tokenizer is not here
either, so counting `data.train` needs `--data.tokenizer` (or the checkpoint): refused in one line
otherwise, as the bundled tiny tokenizer's counts are not the model's. With it, every GLM-5 CPT
recipe (full at 32 nodes, LoRA on the one-node FP8 base) validates and plans from the corpus'
token count: the bundled domain corpus (recipes/tiny/domain_text), each document's tokens as that
tokenizer gives them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmtune.cli import main
from glmtune.data.text_sources import TextReadOptions, read_documents
from glmtune.data.tokenizer import load_tokenizer

CORPUS = "recipes/tiny/domain_text/corpus.jsonl"
TOKENIZER = "glmtune/data/assets/tiny_tokenizer"  # a checkpoint's tokenizer files, as a user passes them


@pytest.fixture(scope="module")
def corpus_tokens() -> int:
    tokenizer = load_tokenizer(TOKENIZER)
    texts = [d.text for d in read_documents([CORPUS], TextReadOptions())]
    return sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])


def test_a_placeholder_models_corpus_needs_the_tokenizer(tmp_path, capsys):
    code = main(["plan", "recipes/glm5/cpt_4k.yaml", "--data.train", f"[{CORPUS}]", "--data.cache_dir",
                 str(tmp_path / "cache"), "--epochs", "1", "--gpu", "h200-141g"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "/path/to/GLM-5 is not here" in err and "--data.tokenizer DIR" in err and "--no-data" in err
    assert not (tmp_path / "cache").exists()  # refused before anything was tokenized


@pytest.mark.parametrize("recipe", ["recipes/glm5.2/cpt_4k.yaml", "recipes/glm5/cpt_lora_fp8_1node.yaml",
                                    "recipes/glm5.2/cpt_lora_fp8_1node.yaml", "recipes/glm5.3/cpt_lora_fp8_1node.yaml"])
def test_the_glm5_cpt_recipes_plan_from_the_corpus_tokens(recipe, corpus_tokens, tmp_path_factory, capsys):
    cache = tmp_path_factory.getbasetemp() / "plan-corpus-cache"  # one tokenization for every recipe
    assert main(["plan", recipe, "--data.train", f"[{CORPUS}]", "--data.tokenizer", TOKENIZER,
                 "--data.cache_dir", str(cache), "--epochs", "1", "--gpu", "h200-141g", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    corpus, documents = report["data"]["corpus"], len(Path(CORPUS).read_text().splitlines())
    assert (corpus["documents"], corpus["tokens"]) == (documents, corpus_tokens)
    assert corpus["removed_tokens"] == {} and corpus["kept_tokens"]["train"] == corpus_tokens  # one file: one source
    assert report["data"]["real_tokens"] == corpus_tokens + documents  # every document's tokens and its EOS
    assert report["gpus"][0]["recipe_layout"]["fits"], recipe
    assert report["run"]["source"] == "1 epochs of the data" and "every token of the documents" in report["objective"]
