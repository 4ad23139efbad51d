"""Check 1: pin what the run depends on, so a later run can be compared against this one.

Recorded: glmtune's commit (`git rev-parse HEAD` of the checkout it runs from, "dirty" with
the number of changed or untracked files when the tree has changes; the package version
outside a git checkout), python, torch with its CUDA, cuDNN and NCCL versions and the GPUs
(when there are any), transformers, peft, safetensors, triton; the model (an HF directory:
the sha256 of its config.json, glmtune's hash of the model fields, and the revision the
download recorded, if any: an HF cache snapshot's commit, huggingface-cli's
`.cache/huggingface/download/config.json.metadata`, or a git checkout; a preset: its name,
config hash and seed); the recipe's bytes (and those of the recipes it extends) and the
resolved configuration's hash.

Passes when each of those could be determined, every requirement glmtune declares is
installed at a version it accepts (and peft's extra for a LoRA recipe, whose adapter check 8
loads with PEFT), and transformers has the model's class (the family's summary names it:
GLM-5's `GlmMoeDsaForCausalLM`, an hf-family directory's config.json `architectures`). A dirty
tree passes, said in the message: it runs, but its commit does not reproduce it.

glmtune's commit and the model's revision are read by glmtune/io/revisions.py, which eval and
release use to record the same pins.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import platform
from pathlib import Path
from typing import Any

import torch

from glmtune.config import config_to_yaml
from glmtune.config.yaml_layers import load_yaml_text
from glmtune.checkpoint.fingerprint import config_sha256
from glmtune.io.revisions import SOURCE_ROOT, glmtune_pin, model_revision
from glmtune.models.registry import model_args
from glmtune.preflight.context import Preflight
from glmtune.preflight.result import CheckResult, verdict


def sha256_bytes(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def library_pins() -> dict[str, Any]:
    pins: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        pins["cudnn"] = torch.backends.cudnn.version()
        pins["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        pins["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    for name in ("transformers", "peft", "safetensors", "triton"):
        try:
            pins[name] = importlib.import_module(name).__version__
        except ImportError:
            pins[name] = None
    return pins


def _declared_requirements() -> list[str]:
    """glmtune's requirements as installed, else as its source tree's pyproject.toml declares them."""
    try:
        return importlib.metadata.requires("glmtune") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree (PYTHONPATH)
        import tomllib

        project = tomllib.loads((SOURCE_ROOT / "pyproject.toml").read_text())["project"]
        return [*project["dependencies"], *(_with_extra(r, extra) for extra, reqs in
                                            project.get("optional-dependencies", {}).items() for r in reqs)]


def _with_extra(requirement: str, extra: str) -> str:
    """`requirement` of optional group `extra` as installed metadata writes it: a marker the
    requirement already has (`triton>=3.2; platform_system == 'Linux'`) joined with `and`."""
    spec, _, marker = requirement.partition(";")
    return f'{spec}; ({marker.strip()}) and extra == "{extra}"' if marker.strip() else f'{spec}; extra == "{extra}"'


def dependency_problems(extras: set[str]) -> tuple[list[str], dict[str, Any]]:
    """Every requirement glmtune declares (and those of `extras`), installed at a version it accepts."""
    from packaging.requirements import Requirement

    problems, found = [], {}
    for text in _declared_requirements():
        req = Requirement(text)
        if req.marker is not None and not any(req.marker.evaluate({"extra": extra}) for extra in extras):
            continue
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            version = None
        found[req.name] = {"required": str(req.specifier) or "any", "installed": version}
        if version is None:
            problems.append(f"glmtune needs {req}: {req.name} is not installed")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"glmtune needs {req}: {req.name} {version} is installed")
    return problems, found


def recipe_pins(recipe: Path) -> list[dict[str, str]]:
    """sha256 of the recipe file and of every recipe it extends, bases first."""
    data = load_yaml_text(recipe.read_text(encoding="utf-8"), str(recipe), "recipe") or {}
    bases = data.get("extends") or []
    chain = [pin for base in ([bases] if isinstance(bases, str) else bases)
             for pin in recipe_pins(recipe.parent / base)]
    return [*chain, {"path": str(recipe), "sha256": sha256_bytes(recipe)}]


def check_pins(pf: Preflight) -> CheckResult:
    code, libs = glmtune_pin(), library_pins()
    evidence: dict[str, Any] = {"glmtune": code, "libraries": libs}
    # LoRA adapters are checked by loading them with PEFT (check 8): its extra is required then.
    problems, evidence["dependencies"] = dependency_problems({"peft"} if pf.lora else set())
    import transformers

    model: dict[str, Any] = {"name_or_path": pf.cfg.model.name_or_path}
    try:
        args = model_args(pf.cfg.model)
        # the class transformers loads the checkpoint as (checks 8 and 9 compare against it)
        architecture = pf.spec.architecture.summary(args)["architecture"]
        if getattr(transformers, architecture, None) is None:
            problems.append(f"transformers {transformers.__version__} has no {architecture}, the model's class")
        model["config_sha256"] = config_sha256(args)
        if pf.model_dir is not None:
            model["config_json_sha256"] = sha256_bytes(pf.model_dir / "config.json")
            model["revision"], model["revision_source"] = model_revision(pf.model_dir)
        else:
            model["preset"], model["seed"] = pf.cfg.model.name_or_path, pf.cfg.train.seed
            model["overrides"] = pf.cfg.model.overrides
    except (OSError, ValueError) as exc:
        problems.append(f"model.name_or_path {pf.cfg.model.name_or_path}: config cannot be pinned: {exc}")
    evidence["model"] = model
    evidence["recipe"] = recipe_pins(pf.recipe)
    evidence["overrides"] = pf.overrides
    evidence["resolved_config_sha256"] = hashlib.sha256(config_to_yaml(pf.cfg).encode()).hexdigest()
    commit = (code["commit"][:10] + (f" dirty: {code['changed_files']} changed files" if code["dirty"] else "")
              if code["commit"] else f"version {code['version']} (no git checkout)")
    cuda = f", CUDA {libs['cuda']}, NCCL {libs['nccl']}" if "nccl" in libs else ""
    revision = model.get("revision") or (f"preset {model['preset']}" if "preset" in model else "no revision recorded")
    message = (f"glmtune {commit}; torch {libs['torch']}{cuda}; transformers {libs['transformers']}; "
               f"peft {libs['peft']}; model {revision}, config {model.get('config_sha256', '?')[:12]}; "
               f"recipe {evidence['recipe'][-1]['sha256'][:12]}; resolved config "
               f"{evidence['resolved_config_sha256'][:12]}")
    return verdict(1, problems, message, evidence)
