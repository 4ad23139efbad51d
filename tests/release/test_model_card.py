"""The model card (glmtune/release/model_card.py): written with every release and export, its front
matter read back by huggingface_hub, its numbers the scorecard's, recorded and verified by the
release, and never written over a README the command did not create. Also the kept MTP layer:
named as transformers' GlmMoeDsa ignores it on GLM-5, reported as UNEXPECTED on the tiny model."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM

from glmtune.cli import main
from glmtune.config import load_run_config
from glmtune.io.output_owner import CARD_MARKER
from glmtune.models.glm5.args import PRESETS
from glmtune.models.glm5.state_dict_adapter import Glm5StateDictAdapter
from glmtune.release.model_card import front_matter, mtp_ignored_by_transformers, render_card
from glmtune.release.model_card_facts import run_facts


def _card(path: Path) -> ModelCard:
    text = path.read_text(encoding="utf-8")
    assert text.startswith("---\n") and CARD_MARKER in text
    return ModelCard(text)


def test_release_card_carries_the_scorecard_and_verifies(lora_run, capsys):
    run, eval_dir = lora_run
    assert main(["release", str(run), "--eval", str(eval_dir), "--engine", "vllm==0.11.0"]) == 0
    capsys.readouterr()
    card, manifest = run / "release.md", json.loads((run / "release.json").read_text())
    data = _card(card).data
    assert data.glmtune["method"] == "lora" and data.glmtune["objective"] == "sft"
    assert data.glmtune["base"]["name_or_path"] == "tiny"
    assert data.glmtune["base"]["weights_sha256"] == manifest["base"]["weights_sha256"]
    assert data.library_name == "peft" and "lora" in data.tags
    scorecard = json.loads((eval_dir / "scorecard.json").read_text())
    expected = {m["id"]: m["by_category"]["all"]["values"]["candidate"] for m in scorecard["metrics"]}
    assert {r.metric_type: r.metric_value for r in data.eval_results} == expected
    body = card.read_text()
    for gate in scorecard["gates"]:
        assert f"| {gate['name']} | {gate['metric']} |" in body
    assert manifest["engine"]["serve_command"] in body
    assert "model.layers.4.*" in body and "UNEXPECTED" in body  # the tiny model's kept MTP layer
    entry = next(a for a in manifest["artifacts"] if a["name"] == "model_card")
    assert entry["root"] == "release.md" and entry["size"] == card.stat().st_size

    assert main(["release", "verify", str(run / "release.json"), "--allow-outside"]) == 0
    capsys.readouterr()
    card.write_text(card.read_text().replace("all gates passed", "all gates passed!"))
    assert main(["release", "verify", str(run / "release.json"), "--allow-outside"]) == 1
    assert re.search(r"model_card\s+DRIFT", capsys.readouterr().out)


def test_release_never_replaces_a_readme_it_did_not_write(lora_run, capsys):
    run, eval_dir = lora_run
    (run / "release.md").write_text("# my notes\n")
    for extra in ([], ["--overwrite"]):
        assert main(["release", str(run), "--eval", str(eval_dir), "--engine", "vllm==0.11.0", *extra]) == 2
        assert re.search(r"model card \S*release.md .*not a model card glmtune wrote", capsys.readouterr().err)
        assert (run / "release.md").read_text() == "# my notes\n" and not (run / "release.json").exists()
    (run / "release.md").unlink()
    assert main(["release", str(run), "--eval", str(eval_dir), "--engine", "vllm==0.11.0"]) == 0
    assert main(["release", str(run), "--eval", str(eval_dir), "--engine", "vllm==0.12.0", "--overwrite"]) == 0
    assert "vllm 0.12.0" in (run / "release.md").read_text()  # its own card is replaced
    capsys.readouterr()


def test_export_cards(sft_source, lora_source, tmp_path, capsys):
    hf, adapter = tmp_path / "hf", tmp_path / "adapter"
    assert main(["export", str(sft_source), "--hf", str(hf)]) == 0
    assert main(["export", str(lora_source), "--adapter", str(adapter)]) == 0
    capsys.readouterr()
    full, lora = _card(hf / "README.md").data, _card(adapter / "README.md").data
    assert (full.library_name, full.glmtune["method"], full.base_model_relation) == ("transformers", "full", "finetune")
    assert (lora.library_name, lora.glmtune["method"], lora.base_model_relation) == ("peft", "lora", "adapter")
    assert "Not evaluated" in (hf / "README.md").read_text()
    # the card is the export's own: --overwrite replaces the directory, card included
    assert main(["export", str(lora_source), "--adapter", str(adapter), "--overwrite"]) == 0
    # a README.md someone added is not the export's: --overwrite refuses the directory
    (hf / "notes.md").write_text("mine")
    assert main(["export", str(sft_source), "--hf", str(hf), "--overwrite"]) == 2
    assert "notes.md" in capsys.readouterr().err


def test_a_training_run_cards_its_own_exports(sft_source, lora_source, tmp_path, capsys):
    """`glmtune train` writes RUN_DIR/hf (full fine-tuning) and RUN_DIR/adapter, adapter_per_expert
    (LoRA) itself: each carries the card `glmtune export` writes for the run's last checkpoint."""
    hf, adapter = tmp_path / "hf", tmp_path / "adapter"
    assert main(["export", str(sft_source), "--hf", str(hf)]) == 0
    assert main(["export", str(lora_source), "--adapter", str(adapter)]) == 0
    capsys.readouterr()
    assert (sft_source / "hf" / "README.md").read_text() == (hf / "README.md").read_text()
    for sub in ("adapter", "adapter_per_expert"):
        assert (lora_source / sub / "README.md").read_text() == (adapter / "README.md").read_text()


def test_base_from_a_hub_snapshot_names_its_id_revision_and_licence(lora_source, tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "models--zai-org--GLM-5" / "snapshots" / commit
    shutil.copytree(lora_source / "base", snapshot)
    (snapshot / "README.md").write_text("---\nlicense: mit\n---\n# GLM-5\n")
    cfg = load_run_config(lora_source / "config.yaml")
    cfg.model.name_or_path = str(snapshot)
    facts = run_facts(cfg, lora_source, snapshot, "adapter")
    data = ModelCard(render_card(facts)).data
    assert (data.base_model, data.base_model_revision, data.license) == ("zai-org/GLM-5", commit, "mit")
    assert "base_model: zai-org/GLM-5" in front_matter(facts)


def test_mtp_layer_keys_are_the_ones_transformers_ignores_on_glm5():
    """GLM-5 (78 layers): the exported MTP layer is model.layers.78.*, which transformers' own
    `_keys_to_ignore_on_load_unexpected` names, so it loads as the upstream checkpoints do."""
    for name in ("glm5", "glm5.1", "glm5.2", "glm5.3"):  # every real GLM-5.x preset
        args = PRESETS[name]()
        adapter = Glm5StateDictAdapter(args)
        assert args.num_hidden_layers == 78 and args.num_nextn_predict_layers == 1, name
        assert adapter.hf_prefix("mtp.0.self_attn.q_a_proj.weight") == "model.layers.78.self_attn.q_a_proj.weight"
    assert mtp_ignored_by_transformers(78)
    assert not mtp_ignored_by_transformers(4) and not mtp_ignored_by_transformers(77)


def test_tiny_export_reports_exactly_its_mtp_layer_as_unexpected(sft_source):
    """The tiny model (4 layers) keeps its MTP layer at model.layers.4.*: transformers reports those
    keys, and only those, as unexpected, and leaves nothing of the model missing."""
    hf = sft_source / "hf"
    index = json.loads((hf / "config.json").read_text())
    assert index["num_hidden_layers"] == 4 and index["num_nextn_predict_layers"] == 1
    _, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert info["unexpected_keys"] and all(k.startswith("model.layers.4.") for k in info["unexpected_keys"])
    assert not info["missing_keys"]


def test_merge_cards_the_adapters_run(lora_source, tmp_path, capsys):
    """glmtune merge writes the card of the adapter's run: found as the adapter's run directory, or
    through the run an exported adapter's card names; an adapter of no known run gets none (said)."""
    exported = tmp_path / "exported"
    assert main(["export", str(lora_source), "--adapter", str(exported)]) == 0
    for adapter, out in ((lora_source / "adapter", tmp_path / "m1"), (exported, tmp_path / "m2")):
        assert main(["merge", str(lora_source / "base"), str(adapter), str(out)]) == 0
        data = _card(out / "README.md").data
        assert (data.glmtune["artifact"], data.glmtune["method"], data.library_name) == ("merged", "lora",
                                                                                          "transformers")
        assert data.glmtune["run_id"] == json.loads((lora_source / "run.json").read_text())["run_id"]
    loose = shutil.copytree(lora_source / "adapter", tmp_path / "loose" / "adapter")
    (loose / "README.md").unlink()  # the card training wrote names the run: without it, no run is known
    capsys.readouterr()
    assert main(["merge", str(lora_source / "base"), str(loose), str(tmp_path / "m3")]) == 0
    assert "no model card" in capsys.readouterr().out and not (tmp_path / "m3" / "README.md").exists()
