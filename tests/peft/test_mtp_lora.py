"""LoRA on the MTP layer (`train.mtp_loss_weight > 0` with `peft.method: lora`): which of its
modules take adapters, that they learn from the MTP loss, both export layouts under the MTP
layer's HF names, PEFT on transformers (no MTP layer in memory) giving our main-path logits,
loading back unmerged, and `glmtune merge` folding them into the MTP layer's weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glmtune import load_pretrained, save_pretrained
from glmtune.cli import main
from glmtune.models.glm5.lora_rules import DEFAULT_LORA_TARGETS
from glmtune.models.common.aux_loss import AuxiliaryLosses
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.args import Glm5Args
from glmtune.models.glm5.spec import GLM5
from glmtune.peft import apply_lora, export_adapter, lora_modules
from glmtune.peft.adapter_load import apply_adapter
from glmtune.train.data_loader import collate
from tests.peft.conftest import lora_cfg, randomize_adapters, tokens

PREFIX = "base_model.model."
MTP = "model.layers.4"  # the parity model's MTP layer on disk: 4 decoder layers, then MTP layer 0
WITH_EH = [*DEFAULT_LORA_TARGETS, "*.eh_proj"]


@pytest.fixture(scope="session")
def mtp_base(hf_dir, tmp_path_factory) -> Path:
    """The parity architecture with one MTP layer, written by glmtune (transformers drops layer 4 on load)."""
    path = tmp_path_factory.mktemp("hf-glm5-mtp")
    args = Glm5Args.from_hf_config(hf_dir).replace(num_nextn_predict_layers=1)
    save_pretrained(build_model(args, seed=0), path)
    return path


def _ours(base: Path, targets=WITH_EH, mtp: bool = True) -> torch.nn.Module:
    model = load_pretrained(base, dtype=torch.float32, attention_backend="eager", moe_backend="grouped_mm")
    GLM5.compute.set_auxiliary_training(model, mtp=mtp, indexer=False)  # what `glmtune train` does before LoRA
    apply_lora(model, lora_cfg(target_modules=list(targets)))
    randomize_adapters(model)
    return model.eval()


def test_the_mtp_layer_takes_adapters_only_with_the_mtp_loss():
    model = build_model(get_preset("tiny"), seed=0)
    apply_lora(model, lora_cfg())
    assert not any(name.startswith("mtp.") for name, _ in lora_modules(model))  # as before: no MTP loss
    with pytest.raises(ValueError, match="only mtp.0.eh_proj, which cannot take LoRA: the MTP layer runs only with"):
        apply_lora(build_model(get_preset("tiny"), seed=0), lora_cfg(target_modules=["*.eh_proj"]))

    model = build_model(get_preset("tiny"), seed=0)
    GLM5.compute.set_auxiliary_training(model, mtp=True, indexer=False)
    inventory = apply_lora(model, lora_cfg())
    adapted = {name for name, _ in lora_modules(model) if name.startswith("mtp.")}
    assert adapted == {f"mtp.0.{m}" for m in ("self_attn.q_a_proj", "self_attn.q_b_proj",
                                             "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj", "mlp.experts",
                                             "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                                             "mlp.shared_experts.down_proj")}  # eh_proj only when named
    for name, param in model.named_parameters():
        assert param.requires_grad == (".lora_" in name), name  # the MTP layer's base weights frozen again
    row = inventory.row("mtp")
    assert row.trainable > 0 and "mlp.experts.gate_up_proj+down_proj, 8 experts (x1)" in row.targets
    assert "self_attn.q_a_proj (x4)" in inventory.row("attention").targets  # the decoder layers' count alone

    model = build_model(get_preset("tiny"), seed=0)
    GLM5.compute.set_auxiliary_training(model, mtp=True, indexer=False)
    apply_lora(model, lora_cfg(target_modules=["*.eh_proj", "mtp.*.o_proj"]))
    assert [name for name, _ in lora_modules(model)] == ["mtp.0.self_attn.o_proj", "mtp.0.eh_proj"]
    for glob, message in (("mtp.0.*norm", "matches no module"), ("mtp.*.indexer.wk", "DSA indexer")):
        model = build_model(get_preset("tiny"), seed=0)
        GLM5.compute.set_auxiliary_training(model, mtp=True, indexer=False)
        with pytest.raises(ValueError, match=message):
            apply_lora(model, lora_cfg(target_modules=[glob]))


def test_the_mtp_adapters_learn_from_the_mtp_loss():
    model = build_model(get_preset("tiny"), seed=0, attention_backend="eager")
    GLM5.compute.set_auxiliary_training(model, mtp=True, indexer=False)
    apply_lora(model, lora_cfg(target_modules=WITH_EH))
    randomize_adapters(model)  # B != 0: A gets a gradient too
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(2):
        ids = torch.randint(1, model.args.vocab_size, (24,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * 4 + ids[4:], "document_ids": [0] * 24,
                     "position_ids": list(range(24))})
    batch = collate(rows)
    weight = 0.3
    mb = MicroBatch.of_batch(batch, aux=AuxiliaryLosses(mtp_weight=weight))
    loss_sum, _, stats = GLM5.compute.loss(model, mb)  # the training loss
    loss_sum.backward()
    assert stats["mtp_loss"][1] == batch["num_mtp_supervised"]
    mtp = {n: p.grad.clone() for n, p in model.named_parameters() if n.startswith("mtp.") and p.grad is not None}
    assert set(mtp) == {n for n, p in model.named_parameters() if n.startswith("mtp.") and p.requires_grad}
    assert all(g.abs().sum() > 0 for g in mtp.values()) and any(".eh_proj.lora_" in n for n in mtp)
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)

    # The MTP layer is in the MTP loss's path only: its adapters' gradients are those of w x MTP mean.
    model.zero_grad(set_to_none=True)
    mtp_only = MicroBatch(batch["input_ids"], batch["position_ids"], batch["document_ids"],
                          mtp_targets=batch["mtp_targets"])
    out = model(batch["input_ids"], mtp_only, compute_logits=False)
    (weight * out.mtp_loss_sum / batch["num_mtp_supervised"]).backward()
    for name, grad in mtp.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, rtol=1e-5, atol=1e-8, msg=name)


def test_peft_layout_carries_the_mtp_adapters_and_peft_gives_our_logits(mtp_base, tmp_path):
    ours = _ours(mtp_base)
    out = export_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(mtp_base))
    saved = load_file(out / "adapter_model.safetensors")
    config = json.loads((out / "adapter_config.json").read_text())
    mtp_keys = {k for k in saved if k.startswith(f"{PREFIX}{MTP}.")}
    layer = ours.mtp[0]
    assert torch.equal(saved[f"{PREFIX}{MTP}.self_attn.q_a_proj.lora_A.weight"], layer.self_attn.q_a_proj.lora_A.weight)
    assert torch.equal(saved[f"{PREFIX}{MTP}.eh_proj.lora_B.weight"], layer.eh_proj.lora_B.weight)
    assert saved[f"{PREFIX}{MTP}.mlp.experts.base_layer.lora_A.weight"].shape == (8 * 4, 64)  # [E*r, D]
    assert not any(k.startswith(PREFIX + "mtp") or ".indexer." in k for k in saved)
    assert len(mtp_keys) == 2 * (4 + 1 + 3 + 2)  # MLA 4, eh_proj, shared experts 3, two expert wrappers
    # every layer's module of a kind is adapted: layer-free suffixes, eh_proj among them
    assert config["target_modules"] == ["self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                                        "self_attn.o_proj", "eh_proj"]

    hf = pytest.importorskip("transformers").AutoModelForCausalLM.from_pretrained(
        mtp_base, attn_implementation="eager", dtype=torch.float32)
    peft = pytest.importorskip("peft")
    served = peft.PeftModel.from_pretrained(hf, out).eval()
    # The MTP keys match no module and are left out (PEFT 0.21 silently, 0.22 with a warning that
    # names them as unexpected); every other key is loaded and no adapted module misses its weights.
    loaded = peft.utils.get_peft_model_state_dict(served)
    assert set(saved) - set(loaded) == mtp_keys and set(loaded) <= set(saved)
    result = served.load_adapter(out, adapter_name="again")  # what from_pretrained does, with its result
    assert result.missing_keys == []
    assert len(result.unexpected_keys) == len(mtp_keys) and all(f"{MTP}." in k for k in result.unexpected_keys)
    x = tokens(seed=3)
    with torch.no_grad():
        served.set_adapter("default")
        assert (served(x).logits - ours(x).logits).abs().max().item() <= 1e-4


def test_per_expert_layout_carries_the_mtp_adapters(mtp_base, tmp_path):
    ours = _ours(mtp_base)
    out = export_adapter(ours, tmp_path / "engines", layout="per_expert")
    saved = load_file(out / "adapter_model.safetensors")
    config = json.loads((out / "adapter_config.json").read_text())
    assert "eh_proj" in config["target_modules"]
    experts = ours.mtp[0].mlp.experts
    key = PREFIX + MTP + ".mlp.experts.5.{}.lora_{}.weight"
    assert torch.equal(saved[key.format("gate_proj", "A")], experts.lora_gate_up_A[5])
    assert torch.equal(saved[key.format("up_proj", "B")], experts.lora_gate_up_B[5, 32:])
    assert torch.equal(saved[key.format("down_proj", "B")], experts.lora_down_B[5])
    assert torch.equal(saved[f"{PREFIX}{MTP}.eh_proj.lora_A.weight"], ours.mtp[0].eh_proj.lora_A.weight)
    assert len([k for k in saved if k.startswith(f"{PREFIX}{MTP}.")]) == 2 * (4 + 1 + 3 + 8 * 3)


@pytest.mark.parametrize("layout", ["peft", "per_expert"])
def test_an_exported_mtp_adapter_loads_back_unmerged(mtp_base, tmp_path, layout):
    ours = _ours(mtp_base)
    out = export_adapter(ours, tmp_path / "adapter", layout=layout)
    again = load_pretrained(mtp_base, dtype=torch.float32, attention_backend="eager", moe_backend="grouped_mm")
    apply_adapter(again, out)
    expected = {n: p for n, p in ours.named_parameters() if n.startswith("mtp.") and ".lora_" in n}
    got = {n: p for n, p in again.named_parameters() if n.startswith("mtp.") and ".lora_" in n}
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("layout", ["peft", "per_expert"])
def test_merge_folds_the_mtp_adapters_into_the_mtp_layer(mtp_base, tmp_path, layout):
    ours = _ours(mtp_base)
    adapter = export_adapter(ours, tmp_path / "adapter", layout=layout)
    assert main(["merge", str(mtp_base), str(adapter), str(tmp_path / "merged")]) == 0
    base = {k: v for f in sorted(mtp_base.glob("*.safetensors")) for k, v in load_file(f).items()}
    merged = {k: v for f in sorted((tmp_path / "merged").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert merged.keys() == base.keys()
    scale = 8.0 / 4  # alpha / r
    layer = ours.mtp[0]
    with torch.no_grad():
        q_a, eh = layer.self_attn.q_a_proj, layer.eh_proj
        expected = {f"{MTP}.self_attn.q_a_proj.weight": q_a.lora_B.weight @ q_a.lora_A.weight,
                    f"{MTP}.eh_proj.weight": eh.lora_B.weight @ eh.lora_A.weight}
        experts, inter = layer.mlp.experts, 32
        for e in (0, 6):
            gate_up = experts.lora_gate_up_B[e] @ experts.lora_gate_up_A[e]  # [2I, D]: gate rows, then up rows
            expected[f"{MTP}.mlp.experts.{e}.gate_proj.weight"] = gate_up[:inter]
            expected[f"{MTP}.mlp.experts.{e}.up_proj.weight"] = gate_up[inter:]
            expected[f"{MTP}.mlp.experts.{e}.down_proj.weight"] = experts.lora_down_B[e] @ experts.lora_down_A[e]
    for key, delta in expected.items():
        assert delta.abs().max() > 1e-3, key
        torch.testing.assert_close(merged[key], base[key] + scale * delta, rtol=0, atol=1e-6, msg=key)
    for key in (f"{MTP}.enorm.weight", f"{MTP}.hnorm.weight", f"{MTP}.shared_head.norm.weight",
                f"{MTP}.self_attn.indexer.wk.weight", f"{MTP}.self_attn.kv_b_proj.weight"):
        assert torch.equal(merged[key], base[key]), key  # no adapter: unchanged
    assert not torch.equal(merged["model.layers.2.self_attn.q_a_proj.weight"],
                           base["model.layers.2.self_attn.q_a_proj.weight"])  # the decoder layers merge as before


def test_a_lora_run_with_the_mtp_loss_ships_its_trained_mtp_adapters(tmp_path):
    """`glmtune train` (LoRA, MTP loss) -> RUN_DIR/adapter carries the trained MTP adapters; `glmtune export`
    rebuilds them from the checkpoint bit for bit; the merged checkpoint's MTP layer is the trained one."""
    from glmtune.checkpoint.manager import CheckpointManager
    from glmtune.config import load_config
    from tests.train.run_helpers import TWO_STEPS, run_in_fork

    run_dir, extra = tmp_path / "run", [*TWO_STEPS, "--train.mtp_loss_weight", "0.3"]
    done = run_in_fork(run_dir, tmp_path / "cache", *extra, recipe="tiny/lora_support_json")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert all(r["mtp_loss"] > 0 for r in records)
    assert json.loads((run_dir / "trainable.json").read_text())["groups"]["mtp"]["trainable"] > 0
    mtp_b = {k: v for k, v in load_file(run_dir / "adapter" / "adapter_model.safetensors").items()
             if k.startswith(f"{PREFIX}{MTP}.") and ".lora_B." in k}
    assert mtp_b and all(v.abs().max() > 0 for v in mtp_b.values())  # trained (B starts at 0)
    for layout, sub in (("peft", "adapter"), ("per_expert", "adapter_per_expert")):
        assert main(["export", str(run_dir), "--adapter", str(tmp_path / layout), "--layout", layout]) == 0
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            assert (tmp_path / layout / name).read_bytes() == (run_dir / sub / name).read_bytes(), (layout, name)

    base = run_dir / "base"
    trained = load_pretrained(base, dtype=torch.float32, attention_backend="eager", moe_backend="grouped_mm")
    GLM5.compute.set_auxiliary_training(trained, mtp=True, indexer=False)
    apply_lora(trained, load_config("tiny/lora_support_json").peft)
    checkpoints = CheckpointManager(run_dir / "checkpoints", trainable_only=True)
    checkpoints.load(checkpoints.latest(), trained, torch.optim.AdamW([p for p in trained.parameters()
                                                                       if p.requires_grad]))
    assert main(["merge", str(base), str(run_dir / "adapter"), str(tmp_path / "merged")]) == 0
    merged = load_pretrained(tmp_path / "merged", dtype=torch.float32, attention_backend="eager",
                             moe_backend="grouped_mm")
    plain = load_pretrained(base, dtype=torch.float32, attention_backend="eager", moe_backend="grouped_mm")
    x = tokens(vocab=trained.args.vocab_size)
    mtp_targets = torch.cat([x[:, 2:], torch.full_like(x[:, :2], -100)], dim=1)
    with torch.no_grad():
        expected, got, before = (m.eval()(x, MicroBatch(x, mtp_targets=mtp_targets)).mtp_hidden_states
                                 for m in (trained, merged, plain))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert (before - expected).abs().max() > 1e-2  # the adapters move the MTP layer's output (0.67)
