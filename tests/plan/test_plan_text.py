"""`glmtune plan` of a continued-pretraining recipe (`data.kind: text`): it packs the corpus as
training does and prices the tokens left after the text contract, and the GLM-5 CPT recipes plan.

A corpus is written here (two sources of prose, one exact duplicate, one document under the
contract's minimum, one longer than a row): the plan's rows and tokens equal a direct count with
the tokenizer (each kept document's tokens and EOS, a long one split at the row's length), the
corpus line says what the contract removed, and `--epochs` turns the rows into steps and tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from glmtune.cli import main
from glmtune.data.tokenizer import load_tokenizer

SEQ = 64
PROSE = ["The pump housing is cast iron and its impeller bronze; torque the flange bolts to forty newton metres.",
         "Replace the seal kit every two thousand operating hours or when the pressure test shows a leak.",
         "Revenue rose four percent in the quarter while operating costs fell, the filing states plainly.",
         "The board declared a dividend of twelve cents per share, payable in March to holders of record."]
LONG = " ".join(PROSE) * 3  # longer than a row: split at SEQ tokens


def _recipe(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rows = [{"text": PROSE[0], "source": "manuals"}, {"text": PROSE[1], "source": "manuals"},
            {"text": PROSE[1], "source": "manuals"},  # an exact duplicate: removed
            {"text": "Too short.", "source": "filings"},  # under min_document_tokens: removed
            {"text": PROSE[2], "source": "filings"}, {"text": PROSE[3], "source": "filings"},
            {"text": LONG, "source": "filings"}]
    (corpus / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "cpt.yaml"
    recipe.write_text(f"""# a tiny continued-pretraining recipe (glmtune train)
name: tiny-cpt-plan
model: {{name_or_path: tiny, dtype: float32}}
data: {{kind: text, train: [{corpus}], source_field: source, min_document_tokens: 5, packed_sequence_size: {SEQ},
        split: {{train: 1.0}}, cache_dir: {tmp_path / "cache"}}}
train: {{max_steps: 3, global_batch_size: 2, micro_batch_size: 1, device: cpu, val_every: 0}}
""")
    return recipe


def test_a_text_corpus_is_priced_by_its_tokens_after_the_contract(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    assert main(["plan", str(recipe), "--gpu", "h200-141g", "--tflops-per-gpu", "100", "--epochs", "2",
                 "--restarts", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    tokenizer = load_tokenizer()
    kept = [PROSE[0], PROSE[1], PROSE[2], PROSE[3], LONG]
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in kept]  # + EOS
    assert lengths[-1] > SEQ
    data = report["data"]
    assert data["real_tokens"] == sum(lengths)  # every kept token once: split chunks do not repeat (overlap 0)
    assert data["documents"] == 4 + math.ceil(lengths[-1] / SEQ)  # the long document's chunks count as documents
    corpus = data["corpus"]
    kept_tokens = sum(lengths) - len(kept)  # the contract counts a document's own tokens, EOS aside
    assert corpus["documents"] == 7 and corpus["kept_tokens"]["train"] == kept_tokens
    assert len(corpus["removed_tokens"]) == 2  # the duplicate and the short document, by their rules
    assert corpus["tokens"] - sum(corpus["removed_tokens"].values()) == kept_tokens
    steps = math.ceil(2 * data["rows"] / 2)
    assert report["run"] == {"steps": steps, "tokens": steps * 2 * SEQ, "source": "2 epochs of the data"}
    assert report["objective"].startswith("sft: next-token loss on every token of the documents")
    assert main(["plan", str(recipe), "--gpu", "h200-141g"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert f"corpus: 7 documents, {corpus['tokens']:,} tokens read; removed by the contract:" in printed


def test_the_glm5_cpt_recipes_plan(capsys):
    for recipe, pp, ep in (("recipes/glm5/cpt_4k.yaml", 4, 64), ("recipes/glm5.3/cpt_lora_fp8_1node.yaml", 1, 8)):
        assert main(["plan", recipe, "--no-data", "--gpu", "h200-141g", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert (report["layout"]["pp"], report["layout"]["ep"]) == (pp, ep)
        assert report["gpus"][0]["recipe_layout"]["fits"], recipe
        assert "every token of the documents" in report["objective"]


def test_a_replay_mix_epoch_is_one_pass_over_the_domain_with_the_replay_it_draws(capsys):
    """recipes/tiny/cpt_domain_text_replay.yaml: 0.2 of the target tokens replay. The epoch holds every
    domain row once and as many replay rows as carry a quarter of the domain's targets (0.2 / 0.8), the
    replay taken in turn and again (its rows' targets are few: more rows than the replay holds)."""
    assert main(["plan", "recipes/tiny/cpt_domain_text_replay.yaml", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["data"]
    mix = data["mix"]
    assert mix["weights"] == {"domain": 0.8, "replay": 0.2}
    domain_rows, replay_rows = mix["rows"]["domain"], mix["rows"]["replay"]
    assert data["rows"] == domain_rows + replay_rows and replay_rows > mix["replay_rows_available"]
    assert data["corpus"]["kept_tokens"]["train"] > 0
    # the replay's drawn rows carry the weight's share of the epoch's targets, to about one row's targets
    targets = mix["targets"]
    assert abs(targets["replay"] / (targets["domain"] + targets["replay"]) - 0.2) < 50 / sum(targets.values())
    assert 0.5 < replay_rows / data["rows"] < 0.9  # docs/data.md: about 73% of the rows are replay rows
