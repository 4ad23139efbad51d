"""The model card: the HF `README.md` of an export or a release, generated from glmtune's records.

    text = render_card(facts)                   # facts: model_card_facts.run_facts / release_facts
    write_export_card(out_dir, text)            # into an export directory glmtune just wrote

The card is YAML front matter built with huggingface_hub's `ModelCardData` (base_model and
the base's revision, library_name, tags naming the method, the licence when the base's own
card declares one, hub datasets, and a `model-index` of the candidate's evaluated scores),
then sections rendered by jinja2 from `model_card.md.jinja` in this package: training,
data provenance and the filters' report, the evaluation's headline and gates (a release),
how to serve it, and limitations (the kept MTP layer, LoRA rank and targets). Nothing in it
is written by hand per run.

A card glmtune wrote carries `CARD_MARKER` (glmtune/io/output_owner.py) right after its
front matter: that is how `--overwrite` tells it from a README.md someone else wrote, which
is never replaced.

The MTP layer: GLM-5's checkpoints store their multi-token-prediction layer after the
decoder layers (`model.layers.{L}.*`), engines load it for speculative decoding, and
transformers' GlmMoeDsaForCausalLM does not build it: its `_keys_to_ignore_on_load_unexpected`
names `model.layers.78.*`, the index on GLM-5 (78 layers), so the upstream checkpoints and a
glmtune export of GLM-5 load without a word. A model of another depth (the tiny demo model:
4 layers) keeps its MTP layer at its own index, which that list does not name, and
`from_pretrained` reports those keys as UNEXPECTED (and skips them). `mtp_load_note` says
which case an export is in; the card's limitations repeat it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import jinja2
from huggingface_hub import EvalResult, ModelCardData
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa

from glmtune.config import load_run_config
from glmtune.io.output_owner import CARD_MARKER, record_added_file
from glmtune.io.outputs import output_file
from glmtune.io.text_limits import printable
from glmtune.release.artifacts import record_artifact
from glmtune.release.model_card_facts import run_facts

CARD_FILE = "README.md"
TEMPLATE = "model_card.md.jinja"
_METHOD = {"full": "Full fine-tuning", "lora": "LoRA"}


def mtp_ignored_by_transformers(layer: int) -> bool:
    """Whether transformers' GlmMoeDsaForCausalLM skips `model.layers.{layer}.*` without reporting it."""
    patterns = getattr(modeling_glm_moe_dsa.GlmMoeDsaForCausalLM, "_keys_to_ignore_on_load_unexpected", None) or []
    key = f"model.layers.{layer}.self_attn.q_a_proj.weight"
    return any(re.search(pattern, key) for pattern in patterns)


def mtp_load_note(model: dict[str, Any]) -> str | None:
    """One sentence on how transformers loads the kept MTP layer, or None when there is none."""
    layers, mtp = model.get("num_hidden_layers"), model.get("mtp_layers") or 0
    if not mtp or not isinstance(layers, int) or model.get("model_type") != "glm_moe_dsa":
        return None
    keys = f"model.layers.{layers}.*" if mtp == 1 else f"model.layers.{layers}-{layers + mtp - 1}.*"
    kept = (f"The multi-token-prediction (MTP) layer is kept as GLM-5's own checkpoints keep it ({keys}): "
            "vLLM and SGLang use it for speculative decoding; transformers does not build it.")
    if all(mtp_ignored_by_transformers(layers + j) for j in range(mtp)):
        return kept + " transformers' GlmMoeDsaForCausalLM ignores these keys by name, as for the upstream checkpoints."
    return (kept + f" transformers ignores only GLM-5's index (model.layers.78.*), so from_pretrained of this "
            f"{layers}-layer model lists {keys} as UNEXPECTED keys and skips them: expected, nothing is wrong.")


def method_label(facts: dict[str, Any]) -> str:
    """"LoRA (DPO)", "Full fine-tuning (SFT)": the method and the training objective."""
    run = facts["run"]
    return f"{_METHOD.get(run['method'], run['method'])} ({str(run['objective']).upper()})"


def _eval_results(facts: dict[str, Any]) -> list[EvalResult]:
    ev = facts.get("eval")
    if not ev:
        return []
    results = []
    for row in ev["scores"]:
        if not isinstance(row["candidate"], (int, float)) or isinstance(row["candidate"], bool):
            continue
        dataset = row["metric"].split("/", 1)[0]
        results.append(EvalResult(task_type="text-generation", dataset_type=f"glmtune-eval/{ev['suite']}",
                                  dataset_name=dataset, metric_type=row["metric"], metric_name=row["metric"],
                                  metric_value=row["candidate"], dataset_config=str(ev["version"])))
    return results


def front_matter(facts: dict[str, Any]) -> str:
    """The card's YAML metadata (without the `---` lines)."""
    run, base, training = facts["run"], facts["base"], facts["training"]
    tags = ["glmtune", run["objective"], "lora" if run["method"] == "lora" else "full-fine-tuning"]
    if facts["model"].get("model_type"):
        tags.append(facts["model"]["model_type"])
    if training.get("lora"):
        tags.append("peft")
    results = _eval_results(facts)
    adapter = facts["kind"] == "adapter" or (facts["kind"] == "release" and run["method"] == "lora")
    data = ModelCardData(
        base_model=base["hub_id"], library_name="peft" if adapter else "transformers",
        license=base["license"], datasets=facts["data"]["hub_datasets"] or None, tags=tags,
        model_name=run["name"] if results else None, eval_results=results or None, pipeline_tag="text-generation",
        base_model_relation="adapter" if adapter else "finetune",
        glmtune={"version": facts["glmtune"], "run_id": run["run_id"], "run_dir": run["run_dir"],
                 "method": run["method"],
                 "objective": run["objective"], "artifact": facts["kind"],
                 "base": {k: base[k] for k in ("name_or_path", "revision", "revision_source", "weights_sha256")}})
    if base["hub_id"] and base["revision"]:
        data.base_model_revision = base["revision"]
    return data.to_yaml()


def _cell(value: Any) -> str:
    """A value as one Markdown table cell: control characters escaped, pipes and line breaks neutralized."""
    return printable(str(value)).replace("|", "\\|").replace("\n", " ")


def _number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.dirname(__file__)), autoescape=False,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True)
    env.filters["cell"] = _cell
    env.filters["num"] = _number
    env.filters["text"] = lambda value: printable(str(value))
    return env


def render_card(facts: dict[str, Any], manifest_name: str | None = None) -> str:
    """The card's text: front matter, the marker, then the template's sections."""
    body = _environment().get_template(TEMPLATE).render(
        f=facts, method=method_label(facts), mtp_note=mtp_load_note(facts["model"]), manifest_name=manifest_name)
    return f"---\n{front_matter(facts)}\n---\n{CARD_MARKER}\n\n{body}"


def write_run_card(run_dir: Path, out_dir: Path, model_dir: Path, kind: str) -> Path:
    """Render the card of an export of the run in `run_dir` (kind: hf, adapter or merged) and write
    it into `out_dir` (`write_export_card`)."""
    cfg = load_run_config(run_dir / "config.yaml")
    return write_export_card(out_dir, render_card(run_facts(cfg, run_dir, model_dir, kind)))


def write_export_card(out_dir: str | os.PathLike[str], text: str) -> Path:
    """Write README.md into the export directory glmtune just wrote (atomically) and add it to
    the directory's output record, so a later `--overwrite` knows it for the export's own.
    A README.md already there that glmtune did not write is never replaced."""
    path = Path(out_dir) / CARD_FILE
    if os.path.lexists(path) and not is_glmtune_card(path):
        raise ValueError(f"{path} exists and is not a model card glmtune wrote; it is left as it is")
    tmp = path.with_name(f".{CARD_FILE}.tmp-{os.getpid()}")
    try:
        with open(tmp, "x", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    record_added_file(path.parent, CARD_FILE)
    return path


def is_glmtune_card(path: Path) -> bool:
    """Whether `path` is a regular file that holds glmtune's card marker in its first 64 KiB."""
    if path.is_symlink() or not path.is_file():
        return False
    with open(path, "rb") as fh:
        return CARD_MARKER.encode() in fh.read(1 << 16)


def release_card_path(manifest: str | os.PathLike[str]) -> Path:
    """Where a release's card goes: beside its manifest, `release.json` -> `release.md` (README.md
    when the release is published)."""
    manifest = Path(manifest)
    return manifest.with_suffix(".md") if manifest.suffix == ".json" else manifest.with_name(manifest.name + ".md")


def write_release_card(path: Path, facts: dict[str, Any], manifest_name: str, manifest_dir: Path, *,
                       overwrite: bool, sources) -> dict[str, Any]:
    """Write a release's card atomically (never over a file glmtune did not write); its artifact entry."""
    text = render_card(facts, manifest_name)
    with output_file(path, overwrite=overwrite, sources=sources, what="model card", command="release") as tmp:
        tmp.write_text(text, encoding="utf-8")
    return record_artifact("model_card", path, "file", "the model card (README.md when published)",
                           manifest_dir)[0]
