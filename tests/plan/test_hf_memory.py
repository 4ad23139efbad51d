"""The hf family's memory model against transformers' own models, and `glmtune plan` on an hf directory.

Parameters: memory_layout.py's count from config.json equals transformers' model by group, exactly,
for seven architectures and a Qwen3-8B-shaped config (built on meta). Activations: each decoder
layer's planned saved bytes equal a `saved_tensors_hooks` census of transformers' own forward on CPU
(every tensor autograd keeps for backward, each storage once, parameters aside), exactly, for Llama,
Qwen3, Qwen3-MoE and GLM-4 in fp32 and bf16, one document per row and packed documents (the SDPA
mask path), full fine-tuning and LoRA, and under full activation checkpointing. The plan of a tiny Qwen3 / Qwen3-MoE directory
uses those figures, keeps to the family's layouts (no pipeline, no expert parallelism), says when
the model's layer is not one the memory model knows, and the state it plans for an FSDP2 rank is
what `--measure`'s rank holds.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Glm4MoeConfig, MistralConfig, Olmo2Config, Qwen2Config, Qwen3Config

from glmtune.cli import main
from glmtune.config import load_config
from glmtune.config.degrees import MeshDegrees
from glmtune.config.schema import PeftConfig
from glmtune.models.common.memory_model import StepShape
from glmtune.models.hf.args import HfArgs
from glmtune.models.hf.memory_layout import parameter_count, parameter_counts
from glmtune.models.hf.memory_model import HF_MEMORY, layer_saved
from glmtune.models.hf.model import decoder_layers, final_hidden
from glmtune.models.hf.spec import HF
from glmtune.peft import apply_lora
from glmtune.plan.memory import step_shape
from tests.models.hf.conftest import _COMMON, CONFIGS, VOCAB, write_checkpoint

MORE = {
    "mistral": lambda: MistralConfig(**_COMMON),
    "qwen2": lambda: Qwen2Config(**_COMMON),
    "qwen3_bias_tied": lambda: Qwen3Config(**_COMMON, head_dim=24, attention_bias=True, tie_word_embeddings=True),
    "glm4_moe": lambda: Glm4MoeConfig(**_COMMON, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, first_k_dense_replace=1, n_shared_experts=1,
                                      use_qk_norm=True),
    "qwen3_8b": lambda: Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}
ROWS, SEQ = 2, 256


def _args(model, config) -> HfArgs:
    return HfArgs.from_config_dict({**config.to_dict(), "architectures": [type(model).__name__]}, "test")


@pytest.mark.parametrize("name", sorted(CONFIGS) + sorted(MORE))
def test_parameters_from_the_config_equal_transformers_model(name):
    config = {**CONFIGS, **MORE}[name]()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    real: dict[str, int] = {}
    for param_name, param in model.named_parameters():
        real[HF.architecture.param_group(param_name)] = real.get(HF.architecture.param_group(param_name), 0) + param.numel()
    args = _args(model, config)
    assert {group: n for group, n in parameter_counts(args).items() if n} == real
    assert parameter_count(args) == sum(real.values())
    if name == "qwen3_8b":
        assert sum(real.values()) == 8_190_735_360  # Qwen3-8B's published size


def _census(model, batch: dict) -> dict[str, int]:
    """Bytes autograd saves during the decoder's forward, by decoder layer ("layer{i}") or "other";
    a storage saved by several layers is counted once, as "shared"; parameters are not counted."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current, seen = ["other"], {}

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in params:
            seen.setdefault(ptr, [tensor.untyped_storage().nbytes(), set()])[1].add(current[0])
        return tensor

    for i, layer in enumerate(decoder_layers(model)):
        layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, f"layer{i}"))
        layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, "other"))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        final_hidden(model, **batch)
    out: dict[str, int] = {}
    for nbytes, owners in seen.values():
        key = owners.pop() if len(owners) == 1 else "shared"
        out[key] = out.get(key, 0) + nbytes
    return out


def _batch(documents: int) -> dict:
    document_ids = torch.arange(SEQ) * documents // SEQ
    positions = torch.arange(SEQ) - document_ids * (SEQ // documents)
    return {"input_ids": torch.randint(3, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0)),
            "position_ids": positions.expand(ROWS, SEQ), "document_ids": document_ids.expand(ROWS, SEQ),
            "single_document": documents == 1}


@pytest.mark.parametrize("lora_rank", [0, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_saved_activations_per_layer_equal_a_census_of_transformers_forward(name, dtype, lora_rank):
    config = CONFIGS[name]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    args, e = _args(model, config), dtype.itemsize
    if lora_rank:  # the family's default targets, as the bundled LoRA recipe trains them
        apply_lora(model, PeftConfig(method="lora", rank=lora_rank), seed=0)
    for documents in (1, 2):  # one document per row: plain causal SDPA; two: the packed-documents mask
        measured = _census(model, _batch(documents))
        step = StepShape(ROWS, SEQ, one_document=documents == 1, compute_bytes=e, lora_rank=lora_rank)
        for i in range(config.num_hidden_layers):
            assert layer_saved(args, step, i) == measured[f"layer{i}"], f"{name} {dtype} {documents} documents"
            assert HF_MEMORY.layer(args, step, i).kept == measured[f"layer{i}"]
        terms = HF_MEMORY.step_terms(args, step, [0, 1], last=True)
        # beyond its layers the decoder keeps the final norm's tensors, and the embedding its token ids
        # when it trains
        assert measured["other"] == terms.loss["final norm"] + (0 if lora_rank else 8 * ROWS * SEQ)
        if "shared" in measured:  # rope's cos/sin, computed once, kept by every layer (not GLM-4's)
            assert measured["shared"] == terms.fixed["rotary cos/sin"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_full_checkpointing_keeps_each_layers_input_and_recomputes_the_rest(name):
    config = CONFIGS[name]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    measured = _census(model, _batch(1))
    args, step = _args(model, config), StepShape(ROWS, SEQ, compute_bytes=4, activation_checkpointing="full")
    for i in range(config.num_hidden_layers):
        planned = HF_MEMORY.layer(args, step, i)
        assert planned.kept == measured[f"layer{i}"] == 4 * ROWS * SEQ * config.hidden_size
        assert planned.recomputed == layer_saved(args, StepShape(ROWS, SEQ, compute_bytes=4), i)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    dirs = {}
    for name in ("qwen3", "qwen3_moe"):
        dirs[name] = tmp_path_factory.mktemp(name)
        write_checkpoint(name, dirs[name])
    dirs["olmo2"] = tmp_path_factory.mktemp("olmo2")  # a layer the memory model does not know
    AutoModelForCausalLM.from_config(Olmo2Config(**_COMMON)).save_pretrained(dirs["olmo2"])
    return dirs


def _plan(capsys, model_dir, *overrides, recipe: str = "sft") -> dict:
    assert main(["plan", f"tiny/{recipe}_support_json", "--model.name_or_path", str(model_dir), "--no-data", "--json",
                 "--train.generate_samples", "0", *overrides]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("recipe", "ac"), [("sft", "none"), ("sft", "full"), ("lora", "none")])
def test_the_plan_of_an_hf_directory_uses_its_memory_model(hf_dirs, capsys, recipe, ac):
    overrides = ["--model.name_or_path", str(hf_dirs["qwen3"]), "--parallel.activation_checkpointing", ac,
                 "--train.generate_samples", "0"]
    report = _plan(capsys, hf_dirs["qwen3"], "--parallel.activation_checkpointing", ac, recipe=recipe)
    cfg = load_config(f"tiny/{recipe}_support_json", overrides)
    args = HF.architecture.args_from_hf(hf_dirs["qwen3"])
    assert report["model"].startswith(f"{hf_dirs['qwen3']}: ")
    step = step_shape(cfg, MeshDegrees(1, 1, 1, 1, 1, 1, 1))  # no data read: one-document rows
    assert step.lora_rank == (cfg.peft.rank if recipe == "lora" else 0) and step.activation_checkpointing == ac
    expected = {str(i): HF_MEMORY.layer(args, step, i).kept for i in range(args.num_hidden_layers)}
    assert {str(k): v for k, v in report["memory"]["activations_per_layer"].items()} == expected
    assert report["memory"]["peak_bytes"] > report["memory"]["state"]["total"]
    floor = {row["what"]: row["bytes"] for row in report["floor"]}
    if recipe == "sft":
        assert floor["bf16 weights"] == 2 * parameter_count(args)
    assert "LoRA on a bf16 base" in floor  # the family takes LoRA: the guide's LoRA rows are planned


def test_a_layer_the_memory_model_does_not_know_is_said_to_be_estimated(hf_dirs, capsys):
    """OLMo 2 normalizes whole query and key rows and after attention and the MLP, not before: its
    parameters are not the Llama layer's the memory model falls back on, and the plan says so."""
    assert "memory_model" not in _plan(capsys, hf_dirs["qwen3"])
    report = _plan(capsys, hf_dirs["olmo2"])
    assert report["memory_model"] == ("model_type 'olmo2' (not one the memory model knows: planned as a Llama layer): "
                                      "the memory model's layer layout counts 74,048 parameters, transformers' model "
                                      "has 74,240; the activations are an estimate")
    assert main(["plan", "tiny/sft_support_json", "--model.name_or_path", str(hf_dirs["olmo2"]), "--no-data",
                 "--train.generate_samples", "0"]) == 0
    assert "the activations are an estimate" in capsys.readouterr().out


def test_the_fit_search_keeps_to_the_familys_layouts(hf_dirs, capsys):
    """The hf family runs neither a pipeline nor expert parallelism: a MoE model's fit is searched over
    data-parallel layouts only (GLM-5's search would give it ep = its experts)."""
    report = _plan(capsys, hf_dirs["qwen3_moe"], "--gpus", "4", "--train.micro_batch_size", "1",
                   "--train.global_batch_size", "4", "--max-gpus", "16", "--gpu", "h100-80g")
    assert report["layout"]["ep"] == 1 and report["layout"]["pp"] == 1
    fit = report["gpus"][0]["smallest_fit"]
    assert fit["layout"]["ep"] == 1 and fit["layout"]["pp"] == 1 and fit["gpus"] == 1


def test_selective_checkpointing_is_refused_for_the_family(hf_dirs, capsys):
    assert main(["plan", "tiny/sft_support_json", "--model.name_or_path", str(hf_dirs["qwen3"]), "--no-data",
                 "--parallel.activation_checkpointing", "selective"]) == 2
    assert "is not available for the hf family" in capsys.readouterr().err


def test_an_fsdp2_rank_holds_the_state_the_plan_gives_it(hf_dirs, capsys):
    """`--measure` builds, shards (FSDP2 over 2 ranks, the other a loopback stand-in) and trains rank 1 of
    the hf model: its parameters, gradients and fp32-master AdamW state equal the plan's, byte for byte."""
    assert main(["plan", "tiny/sft_support_json", "--model.name_or_path", str(hf_dirs["qwen3"]), "--measure",
                 "--gpus", "2", "--rank", "1", "--steps", "1", "--warmup-steps", "0", "--json",
                 "--model.dtype", "bfloat16", "--data.packed_sequence_size", "64", "--train.micro_batch_size", "1",
                 "--train.global_batch_size", "2", "--train.generate_samples", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    held = report["memory"]["held"]
    assert held == report["memory"]["planned_held"] and held["optimizer"] > 5 * held["grads"]
    assert report["time"]["steps_timed"] == 1
    # the family's loss runs the decoder and head outside the model's forward: no forward/backward split, and
    # the report says so instead of calling it a pipeline schedule
    assert report["time"]["forward_s"] is None and report["time"]["pipelined"] is False
