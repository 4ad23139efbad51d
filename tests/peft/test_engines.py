"""The engine facts applied to real adapters: what each adapter adapts (read from its LoRA modules),
what vLLM and SGLang would apply differently (refused, with the fix, before anything is written),
and the serve command `glmtune export --engine` prints and `glmtune release` records."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from glmtune.cli import main
from glmtune.config import ModelConfig, PeftConfig
from glmtune.models.glm5.lora_rules import DEFAULT_LORA_TARGETS
from glmtune.models.registry import model_args, model_spec
from glmtune.peft import apply_lora
from glmtune.peft.engines import ENGINES, SGLANG_TARGET_MODULES, adapter_traits, caveats, refusals, serve_command
from tests.engines.variants import SGLANG_SERVED, peft_overrides
from tests.release.eval_fixture import make_eval_dir
from tests.train.run_helpers import TWO_STEPS, shared_run


def _traits(**peft):
    model = model_spec(ModelConfig()).weights.build(model_args(ModelConfig()), torch.float32, "meta")
    cfg = PeftConfig(method="lora", rank=peft.pop("rank", 8), **peft)
    apply_lora(model, cfg)
    return adapter_traits(model, cfg.rank, cfg.alpha, cfg.rslora)


def test_the_default_targets_adapt_kv_b_only_when_asked_shared_and_both_expert_projections():
    assert not _traits().kv_b  # the default leaves kv_b_proj out (config/schema.py)
    traits = _traits(target_modules=[*DEFAULT_LORA_TARGETS, "*.self_attn.kv_b_proj"])
    assert traits.kv_b and traits.shared_experts
    assert traits.expert_projections == {"gate_up_proj", "down_proj"}
    assert refusals(ENGINES["vllm"], traits, "per_expert") == refusals(ENGINES["sglang"], traits, "per_expert") == []
    [note] = caveats(ENGINES["vllm"], traits)
    assert "precomputed from the base kv_b_proj" in note and "delta is not applied" in note
    # prefill is not absorbed: up to index_topk tokens it is dense, through the backend's base kv_b_proj
    assert "prefill (dense attention for prompts up to the indexer's top-k, 2048 tokens on GLM-5) calls the base " \
           "kv_b_proj layer its attention backend holds, not the LoRA-wrapped module" in note
    assert caveats(ENGINES["sglang"], traits) == []  # SGLang corrects its absorbed path for a kv_b LoRA


def test_what_each_engine_would_apply_differently_is_refused_with_the_fix():
    down_only = [t for t in DEFAULT_LORA_TARGETS if t != "*.mlp.experts"] + ["*.mlp.experts.down_proj"]
    single = _traits(target_modules=down_only)
    assert single.expert_projections == {"down_proj"}
    [why] = refusals(ENGINES["vllm"], single, "per_expert")  # vLLM's pack_moe asserts on it
    assert "covers down_proj only" in why and "target both expert projections" in why
    assert refusals(ENGINES["sglang"], single, "per_expert") == []  # applied: the command names both projections
    rslora = _traits(rslora=True, rank=32)
    assert refusals(ENGINES["vllm"], rslora, "per_expert") == []  # vLLM scales alpha/sqrt(r)
    [why] = refusals(ENGINES["sglang"], rslora, "per_expert")
    assert "0.177x its trained update" in why and "peft.rslora false" in why
    assert "rank 1024 is above vllm's largest --max-lora-rank 512" in refusals(
        ENGINES["vllm"], _traits(rank=1024), "per_expert")[0]
    [why] = refusals(ENGINES["sglang"], _traits(), "peft")
    assert "export with --layout per_expert" in why


_ATTENTION = ["*.self_attn.q_a_proj", "*.self_attn.q_b_proj", "*.self_attn.kv_a_proj_with_mqa", "*.self_attn.o_proj"]
_DEFAULT_NAMES = ["down_proj", "gate_proj", "kv_a_proj_with_mqa", "o_proj", "q_a_proj", "q_b_proj", "up_proj"]


def _sglang_lora_flags(traits) -> list[str]:
    command = serve_command(ENGINES["sglang"], "/m/base", "/m/a", traits)
    assert command[:9] == ["python", "-m", "sglang.launch_server", "--model-path", "/m/base", "--enable-lora",
                           "--lora-paths", "adapter=/m/a", "--max-lora-rank"]
    return command[10:]


def test_the_serve_commands_carry_the_flags_the_adapter_needs():
    traits = _traits(rank=24)
    assert serve_command(ENGINES["vllm"], "/m/base", "/m/a", traits) == [
        "vllm", "serve", "/m/base", "--enable-lora", "--lora-modules", "adapter=/m/a", "--max-lora-rank", "32",
        "--max-loras", "1"]  # 24 rounds up to vLLM's next allowed rank; default 16 would refuse it
    assert serve_command(ENGINES["sglang"], "/m/base", "/m/a", traits)[8:10] == ["--max-lora-rank", "24"]
    assert serve_command(ENGINES["sglang"], "/m/hf", None, None) == [
        "python", "-m", "sglang.launch_server", "--model-path", "/m/hf"]


def test_sglang_gets_the_adapters_module_names_never_all():
    """`--lora-target-modules all` takes in the DSA indexer's wq_b, which SGLang refuses at start-up on
    GLM-5 on NVIDIA GPUs (indexer fusion): the command names the adapter's modules (the per-expert
    adapter_config's target_modules), with both expert projections when routed experts are adapted
    (SGLang wraps the MoE layer only with both), each a name SGLang's --lora-target-modules accepts."""
    assert _sglang_lora_flags(_traits()) == ["--lora-target-modules", *_DEFAULT_NAMES,
                                             "--disable-shared-experts-fusion"]
    attention = _traits(target_modules=_ATTENTION)
    assert _sglang_lora_flags(attention) == [
        "--lora-target-modules", "kv_a_proj_with_mqa", "o_proj", "q_a_proj", "q_b_proj"]  # the MoE stays unwrapped
    # routed experts on down_proj only, no MLP targeted: gate_proj/up_proj added so the MoE layer is wrapped
    experts_down = _traits(target_modules=[*_ATTENTION, "*.mlp.experts.down_proj"])
    assert experts_down.modules == {"kv_a_proj_with_mqa", "o_proj", "q_a_proj", "q_b_proj", "down_proj"}
    assert _sglang_lora_flags(experts_down) == ["--lora-target-modules", *_DEFAULT_NAMES,
                                                "--disable-shared-experts-fusion"]
    for traits in (attention, experts_down, _traits(target_modules=[*DEFAULT_LORA_TARGETS, "*.self_attn.kv_b_proj"])):
        names = _sglang_lora_flags(traits)[1:]
        assert "all" not in names and set(names) - {"--disable-shared-experts-fusion"} <= set(SGLANG_TARGET_MODULES)


def test_sglang_unfuses_shared_experts_whenever_the_experts_take_lora():
    """Fused, the MoE layer has 257 expert slots (256 routed + the shared one) against LoRA buffers of 256
    experts: SGLang's MoE LoRA runners refuse it (or index past the buffers). The command turns fusion off
    whenever the MoE layer is wrapped (routed experts, or both MLP projections' names) or a shared expert
    is adapted (its delta would be dropped)."""
    flag = "--disable-shared-experts-fusion"
    routed_only = _traits(exclude_modules=["*.mlp.shared_experts.*"])
    assert not routed_only.shared_experts and routed_only.expert_projections == {"gate_up_proj", "down_proj"}
    assert _sglang_lora_flags(routed_only)[-1] == flag
    assert _sglang_lora_flags(_traits(target_modules=[*_ATTENTION, "*.mlp.experts"]))[-1] == flag
    dense = _traits(target_modules=[*_ATTENTION, "*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj"])
    assert not dense.expert_projections and not dense.shared_experts
    assert _sglang_lora_flags(dense)[-1] == flag  # the dense MLP's names make SGLang wrap the MoE layers too
    shared_up = _traits(target_modules=[*_ATTENTION, "*.mlp.shared_experts.up_proj"])  # MoE unwrapped, shared adapted
    assert _sglang_lora_flags(shared_up)[-1] == flag
    assert flag not in _sglang_lora_flags(_traits(target_modules=_ATTENTION))


def _vllm_reads(item: str) -> tuple[str, str]:
    """(name, path) vLLM 0.34 reads from one --lora-modules item: entrypoints/common/cli_args.py
    LoRAParserAction, NAME=PATH only with `=` and no `,` (split at the first `=`), else JSON into
    LoRAModulePath(name, path, base_model_name=None, is_3d_lora_weight=False)."""
    if "=" in item and "," not in item:
        name, path = item.split("=", 1)
        return name, path
    fields = json.loads(item)  # vLLM: parser.error("Invalid JSON format for --lora-modules") otherwise
    assert set(fields) <= {"name", "path", "base_model_name", "is_3d_lora_weight"}, fields
    return fields["name"], fields["path"]


def _sglang_reads(item: str) -> tuple[str, str]:
    """(name, path) SGLang 0.5.23 reads from one --lora-paths item: arg_groups/argparse_actions.py
    LoRAPathAction strips it and loads `{...}` as JSON (lora_name, lora_path); arg_groups/lora_hook.py
    splits any other item at the first `=` (without one, the item is both name and path)."""
    item = item.strip()
    if item.startswith("{") and item.endswith("}"):
        fields = json.loads(item)
        return fields["lora_name"], fields["lora_path"]
    if "=" not in item:
        return item, item
    name, path = item.split("=", 1)
    return name, path


_LORA_FLAG = {"vllm": ("--lora-modules", _vllm_reads), "sglang": ("--lora-paths", _sglang_reads)}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("name, path", [
    ("adapter", "/tmp/x/step=2,final"), ("adapter", "/runs/a,b/adapter_per_expert"), ("adapter", "/runs/a=b"),
    ("my=name", "/m/a"), ("adapter", "/m/with space/a "), ("adapter", "/m/{a}"), ("adapter", "/m/new\nline"),
    ("ad,apter", "/m/a"), ("adapter", "/m/unicodé/a")])
def test_the_adapter_item_reads_back_as_its_name_and_path(engine, name, path):
    """A path with `,` (vLLM reads the item as JSON: "Invalid JSON format"), a name with `=` (both split at
    the first `=`), a trailing space (SGLang strips the item): the item is the JSON form the engine takes,
    and the engine's parse gives back exactly the name and the path; a plain one stays NAME=PATH."""
    flag, reads = _LORA_FLAG[engine]
    command = serve_command(ENGINES[engine], "/m/base", path, _traits(), name=name)
    item = command[command.index(flag) + 1]
    assert reads(item) == (name, path), item
    if engine == "vllm" and item.startswith("{"):
        assert json.loads(item)["base_model_name"] == "/m/base"  # the served model, vLLM's /v1/models parent
    plain = serve_command(ENGINES[engine], "/m/base", "/m/a", _traits())
    assert plain[plain.index(flag) + 1] == "adapter=/m/a"


@pytest.mark.parametrize("variant", SGLANG_SERVED)
def test_the_sglang_command_is_the_one_sglang_started_with(variant):
    """`make test-engines` recorded SGLang's own start-up with the command `glmtune export --engine sglang`
    printed for each variant (engine_fixtures/sglang-startup.json; test_engine_facts.py checks what SGLang did):
    today's command for that adapter is the same."""
    recorded = json.loads((Path(__file__).parent / "engine_fixtures" / "sglang-startup.json").read_text())
    command = serve_command(ENGINES["sglang"], "/m/base", "/m/a", _traits(**peft_overrides(variant)))
    assert command[command.index("--max-lora-rank"):] == recorded["commands"][variant]["lora_flags"]


def _glmtune(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(argv))
    return code, out.getvalue()


@pytest.fixture(scope="module")
def lora_run(shared_results) -> Path:
    return shared_run(shared_results, *TWO_STEPS, recipe="tiny/lora_support_json").run_dir


def test_export_for_an_engine_prints_its_command_and_refuses_before_writing(lora_run, tmp_path):
    code, printed = _glmtune("export", str(lora_run), "--adapter", str(tmp_path / "v"), "--engine", "vllm")
    assert code == 0 and (tmp_path / "v" / "adapter_config.json").is_file(), printed
    assert f"vllm serve {(lora_run / 'base').resolve()} --enable-lora --lora-modules adapter=" in printed
    # SGLang's command names exactly the modules the adapter's config lists
    code, printed = _glmtune("export", str(lora_run), "--adapter", str(tmp_path / "s"), "--engine", "sglang")
    listed = json.loads((tmp_path / "s" / "adapter_config.json").read_text())["target_modules"]
    assert code == 0 and f"--lora-target-modules {' '.join(listed)} --disable-shared-experts-fusion\n" in printed, \
        printed
    assert "absorbed MLA decode" not in printed  # the recipe's default targets leave kv_b_proj out
    code, printed = _glmtune("export", str(lora_run), "--adapter", str(tmp_path / "p"), "--engine", "sglang",
                             "--layout", "peft")
    assert code == 2 and "--engine sglang: sglang loads the per_expert layout exactly, not peft" in printed
    assert not (tmp_path / "p").exists()


def test_export_to_a_path_with_a_comma_prints_an_item_vllm_reads_back(lora_run, tmp_path):
    out = tmp_path / "step=2,final"
    code, printed = _glmtune("export", str(lora_run), "--adapter", str(out), "--engine", "vllm")
    assert code == 0, printed
    command = shlex.split(next(line for line in printed.splitlines() if line.startswith("  vllm serve")))
    item = command[command.index("--lora-modules") + 1]
    assert _vllm_reads(item) == ("adapter", str(out.resolve())), item


def test_release_refuses_an_rslora_adapter_for_sglang(lora_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(lora_run, run, ignore=shutil.ignore_patterns("checkpoints"))
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("rslora: false", "rslora: true"))
    eval_dir = make_eval_dir(tmp_path / "eval", run)
    code, printed = _glmtune("release", str(run), "--eval", str(eval_dir), "--engine", "sglang==0.5.23")
    assert code == 2 and "--engine sglang==0.5.23: sglang 0.5.23 scales every adapter by alpha/r" in printed
    assert not (run / "release.json").exists()
