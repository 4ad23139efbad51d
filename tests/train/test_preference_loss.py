"""glmtune's preference losses against TRL 1.16's own trainers (the dev extra pins trl==1.16.0).

On a tiny GLM-5 exported to an HF directory (fp32, CPU), three preference pairs go through:
  * TRL: `DPOTrainer` (or `trl.experimental.cpo.CPOTrainer` for SimPO) built on transformers'
    `GlmMoeDsaForCausalLM` with a tiny word-level tokenizer and an in-memory dataset; TRL's
    collator pads the pairs into its [chosen..., rejected...] batch and `trainer.compute_loss`
    (`DPOTrainer._compute_loss`; `CPOTrainer.get_batch_loss_metrics` for SimPO) computes the
    loss, then `loss.backward()`. Per-pair log-probabilities come from the same calls
    `_compute_loss` makes: the model's TRL fused LM head (`model(..., labels=, fused_lm_head=True)
    .log_probs.sum(1)`), and for SimPO `CPOTrainer.concatenated_forward`.
  * glmtune: the same token ids packed padding-free into two rows (pairs 0 and 1 in row 0,
    pair 2 then padding in row 1; documents 2i/2i+1 = chosen/rejected, positions restarting per
    document, document ids, -1 padding), `Glm5ForCausalLM(ids, mb, token_logps=True)` ->
    `pair_logps` (document sums) -> `preference_loss` -> `total_loss`, then backward.
Asserted equal to relative 1e-5: per-pair log-probabilities, the loss, TRL's logged reward
metrics, and the gradient of every trainable parameter (names in memory are transformers'
own, checked against the state-dict adapter's mapping; LoRA gradients are mapped to PEFT's
layout by glmtune's adapter export). The indexer's `index_topk` (64) is above every document's
length, so the sparse selection keeps every key on both sides (top-k is discontinuous).

The reference model: full fine-tuning passes TRL a separate `ref_model` (another seed's weights, so
policy != reference) and glmtune computes its log-probabilities with a no-grad forward of the
same weights; LoRA gives TRL a `peft_config` (a new adapter, so TRL's reference is the model
with adapters disabled, `use_adapter(model, None)`), then both sides load the same non-zero
adapter, and glmtune's reference is `adapters_disabled` (its adapters switched off).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from datasets import Dataset
from peft import LoraConfig, set_peft_model_state_dict
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, GlmMoeDsaForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer
from trl.experimental.cpo import CPOConfig, CPOTrainer

from glmtune import load_pretrained
from glmtune.models.common.loss import IGNORE_INDEX
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5.state_dict_adapter import Glm5StateDictAdapter
from glmtune.peft import adapter_state, apply_lora, export_adapter
from glmtune.peft.lora import adapters_disabled
from glmtune.train.preference_loss import document_sums, pair_logps, pairs, preference_loss, total_loss
from tests.parity.hf_reference import make_hf_model
from tests.peft.conftest import lora_cfg, randomize_adapters

VOCAB = 512
PAD, EOS = 0, 1
BETA = 0.1
# (prompt, chosen, rejected) lengths: unequal, so TRL pads and the averages differ.
LENGTHS = [(6, 4, 7), (3, 8, 2), (5, 3, 5)]
ROWS = [[0, 1], [2]]  # pairs per packed row
ROW_LEN = 64  # row 1 ends in padding
RTOL = 1e-5


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def _tokenizer() -> PreTrainedTokenizerFast:
    """Word-level: "w{i}" is token i, so text and ids map one to one, offline."""
    vocab = {"<pad>": PAD, "</s>": EOS, **{f"w{i}": i for i in range(2, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>")


def _text_pairs() -> list[dict[str, str]]:
    gen = torch.Generator().manual_seed(0)
    words = lambda n: " ".join(f"w{i}" for i in torch.randint(2, VOCAB, (n,), generator=gen).tolist())  # noqa: E731
    return [{"prompt": words(p), "chosen": " " + words(c), "rejected": " " + words(r)} for p, c, r in LENGTHS]


def _save_hf(path: Path, seed: int) -> Path:
    make_hf_model("glm5", seed, index_topk=64, pad_token_id=PAD).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The policy's starting weights and a different reference."""
    return _save_hf(tmp_path_factory.mktemp("policy"), 0), _save_hf(tmp_path_factory.mktemp("reference"), 1)


def _hf(path) -> GlmMoeDsaForCausalLM:
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)


def _ours(path) -> torch.nn.Module:
    return load_pretrained(path, dtype=torch.float32, attention_backend="eager", moe_backend="grouped_mm")


def _trl_args(cls, tmp_path, **changes):
    # bf16=False: TRL defaults to bf16 autocast (the reference model runs under it); the proof is fp32.
    return cls(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, gradient_checkpointing=False,
               bf16=False, per_device_train_batch_size=len(LENGTHS), beta=BETA, **changes)


# -- glmtune's packed rows --------------------------------------------------------------------

def _pack(docs: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """Documents (ids, unshifted labels) of each row -> padded-free packed rows with shifted
    targets (targets[t] = labels[t + 1] within a document, -100 at its last token)."""
    fields = {"input_ids": [], "targets": [], "position_ids": [], "document_ids": []}
    for row_docs in docs:
        row = {key: [] for key in fields}
        for doc_id, (ids, labels) in enumerate(row_docs):
            row["input_ids"] += ids
            row["targets"] += labels[1:] + [IGNORE_INDEX]
            row["position_ids"] += range(len(ids))
            row["document_ids"] += [doc_id] * len(ids)
        pad = ROW_LEN - len(row["input_ids"])
        row["input_ids"] += [PAD] * pad
        row["targets"] += [IGNORE_INDEX] * pad
        row["position_ids"] += range(pad)
        row["document_ids"] += [-1] * pad
        for key in fields:
            fields[key].append(row[key])
    return {key: torch.tensor(value) for key, value in fields.items()}


def _dpo_rows(examples, rows_of_pairs) -> tuple[dict[str, torch.Tensor], list[int]]:
    """TRL's tokenized examples (prompt_ids, chosen_ids, rejected_ids) as packed rows."""
    def doc(prompt, answer):
        return prompt + answer, [IGNORE_INDEX] * len(prompt) + answer
    docs = [[d for i in pairs_ for d in (doc(examples[i]["prompt_ids"], examples[i]["chosen_ids"]),
                                           doc(examples[i]["prompt_ids"], examples[i]["rejected_ids"]))]
            for pairs_ in rows_of_pairs]
    return _pack(docs), [2 * len(pairs_) for pairs_ in rows_of_pairs]


def _logps(model, rows, num_documents, grad=True):
    with torch.set_grad_enabled(grad):
        mb = MicroBatch(rows["input_ids"], rows["position_ids"], rows["document_ids"], rows["targets"])
        out = model(mb.input_ids, mb, compute_logits=False, token_logps=True)
    return pair_logps(out.token_logps, rows["targets"], rows["document_ids"], num_documents)


# -- comparisons ------------------------------------------------------------------------------

def _assert_grads(ours, hf_named, checkpoint_keys=None, lora_to_peft=None):
    """Every trainable glmtune parameter has TRL's gradient, and nothing else got one.

    glmtune's in-memory names are transformers' own in-memory names; `checkpoint_keys` (the HF
    directory's tensors) checks that the state-dict adapter maps each one to checkpoint keys.
    """
    hf_grads = {name: p.grad for name, p in hf_named if p.grad is not None}
    if lora_to_peft is not None:
        ours_grads = lora_to_peft(ours)
    else:
        ours_grads = {name: p.grad for name, p in ours.named_parameters() if p.requires_grad}
        adapter = Glm5StateDictAdapter(ours.args)
        for name, grad in ours_grads.items():
            assert {key for key, _ in adapter.to_hf(name, grad)} <= checkpoint_keys, name
    assert set(ours_grads) == set(hf_grads), sorted(set(ours_grads) ^ set(hf_grads))[:6]
    assert len(hf_grads) > 20
    worst, name = max((_rel(ours_grads[name], hf_grads[name]), name) for name in hf_grads)
    assert worst <= RTOL, f"{name}: relative gradient error {worst:.2e}"


def _dpo_case(dirs, tmp_path, *, loss, label_smoothing=0.0, sft_weight=0.0, only_pair=None):
    """TRL DPOTrainer vs glmtune on the full model (policy and a different reference)."""
    policy_dir, ref_dir = dirs
    texts = _text_pairs() if only_pair is None else [_text_pairs()[only_pair]]
    loss_type, weights = ([loss], None) if not sft_weight else ([loss, "sft"], [1.0, sft_weight])
    # TRL 1.16's "sigmoid" has no label smoothing; its "aot" on a single pair is exactly cDPO.
    if label_smoothing and loss == "sigmoid":
        assert only_pair is not None
        loss_type = ["aot"]
    args = _trl_args(DPOConfig, tmp_path, loss_type=loss_type, loss_weights=weights, label_smoothing=label_smoothing,
                     router_aux_loss_coef=0.0)
    hf = _hf(policy_dir)
    trainer = DPOTrainer(model=hf, ref_model=_hf(ref_dir), args=args, train_dataset=Dataset.from_list(texts),
                         processing_class=_tokenizer())
    examples = [trainer.train_dataset[i] for i in range(len(texts))]
    batch = trainer.data_collator(examples)
    trainer.model.train()  # as in TRL's training step (its metrics land under "train")
    trl_loss = trainer.compute_loss(trainer.model, batch)
    trl_loss.backward()
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)
    with torch.no_grad():
        trl_logps = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                  labels=labels, fused_lm_head=True).log_probs.sum(1)

    rows, num_documents = _dpo_rows(examples, ROWS if only_pair is None else [[0]])
    ours = _ours(policy_dir)
    policy = _logps(ours, rows, num_documents)
    ref = _logps(_ours(ref_dir), rows, num_documents, grad=False)
    per_pair, stats = preference_loss(policy["chosen"], policy["rejected"], ref["chosen"], ref["rejected"],
                                      chosen_tokens=policy["chosen_tokens"], rejected_tokens=policy["rejected_tokens"],
                                      loss=loss, beta=BETA, label_smoothing=label_smoothing)
    ours_loss, _ = total_loss(per_pair, policy["chosen"], policy["chosen_tokens"], sft_weight=sft_weight)
    ours_loss.backward()

    ours_logps = torch.cat([policy["chosen"], policy["rejected"]]).detach()
    assert _rel(ours_logps, trl_logps) <= RTOL
    assert abs(ours_loss.item() - trl_loss.item()) <= RTOL * abs(trl_loss.item())
    metrics = trainer._metrics["train"]
    # Rewards and margins are differences of log-probabilities: relative to those (β × |log p|).
    scale = BETA * ours_logps.abs().max().item()
    checks = [("rewards/margins", stats["margin"], scale), ("rewards/chosen", stats["rewards_chosen"], scale),
              ("logps/rejected", stats["logps_rejected"], scale / BETA)]
    for key, ours_value, bound in checks:
        assert abs(ours_value.mean().item() - metrics[key][-1]) <= RTOL * bound, key
    assert stats["accuracy"].mean().item() == metrics["rewards/accuracies"][-1]
    _assert_grads(ours, hf.named_parameters(), set(load_file(policy_dir / "model.safetensors")))


@pytest.mark.parametrize("case", [
    dict(loss="sigmoid"),
    dict(loss="ipo"),
    dict(loss="robust", label_smoothing=0.2),
    dict(loss="sigmoid", sft_weight=0.7),  # RPO
    dict(loss="sigmoid", label_smoothing=0.25, only_pair=1),  # cDPO, against TRL's one-pair "aot"
], ids=["sigmoid", "ipo", "robust", "rpo", "cdpo"])
def test_dpo_full_model_matches_trl(dirs, tmp_path, case):
    _dpo_case(dirs, tmp_path, **case)


# -- LoRA: the reference is the same model with its adapters off --------------------------------

def _lora_grads_as_peft(model) -> dict[str, torch.Tensor]:
    """glmtune's LoRA gradients in PEFT's layout and names (`adapter_state` applied to the grads)."""
    params = [p for name, p in model.named_parameters() if ".lora_" in name]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.grad
        _, tensors = adapter_state(model)
    finally:
        for p, data in zip(params, saved):
            p.data = data
    return tensors


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_lora_matches_trl_with_peft(dirs, tmp_path, loss):
    """TRL with a new PEFT adapter (`peft_config`) takes its reference with adapters disabled;
    both sides then load the same non-zero adapter, so policy != reference."""
    policy_dir, _ = dirs
    ours = _ours(policy_dir)
    apply_lora(ours, lora_cfg(dropout=0.0))
    randomize_adapters(ours)
    adapter_dir = export_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(policy_dir))

    peft_config = LoraConfig.from_pretrained(str(adapter_dir))
    peft_config.inference_mode = False  # the export is for inference; TRL must train it
    args = _trl_args(DPOConfig, tmp_path, loss_type=[loss], router_aux_loss_coef=0.0)
    trainer = DPOTrainer(model=_hf(policy_dir), args=args, train_dataset=Dataset.from_list(_text_pairs()),
                         processing_class=_tokenizer(), peft_config=peft_config)
    loaded = set_peft_model_state_dict(trainer.model, load_file(adapter_dir / "adapter_model.safetensors"))
    assert not loaded.unexpected_keys
    assert trainer.ref_model is None and "ref" not in trainer.model.peft_config  # reference = adapters off
    examples = [trainer.train_dataset[i] for i in range(len(LENGTHS))]
    batch = trainer.data_collator(examples)
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, batch)
    trl_loss.backward()

    rows, num_documents = _dpo_rows(examples, ROWS)
    policy = _logps(ours, rows, num_documents)
    with adapters_disabled(ours):
        ref = _logps(ours, rows, num_documents, grad=False)
    assert (policy["chosen"] - ref["chosen"]).abs().max() > 0.1  # the adapters matter: policy != reference
    per_pair, stats = preference_loss(policy["chosen"], policy["rejected"], ref["chosen"], ref["rejected"],
                                      chosen_tokens=policy["chosen_tokens"], rejected_tokens=policy["rejected_tokens"],
                                      loss=loss, beta=BETA)
    ours_loss, _ = total_loss(per_pair, policy["chosen"], policy["chosen_tokens"])
    ours_loss.backward()
    assert abs(ours_loss.item() - trl_loss.item()) <= RTOL * abs(trl_loss.item())
    metrics = trainer._metrics["train"]
    assert abs(stats["rewards_chosen"].mean().item() - metrics["rewards/chosen"][-1]) <= RTOL * BETA * 100
    peft_named = [(name.replace(".default.", "."), p) for name, p in trainer.model.named_parameters()]
    _assert_grads(ours, peft_named, lora_to_peft=_lora_grads_as_peft)


# -- SimPO: reference-free, against CPOTrainer --------------------------------------------------

def _cpo_rows(batch) -> tuple[dict[str, torch.Tensor], list[int]]:
    """TRL CPO's padded chosen/rejected sequences (ids, labels) as packed rows."""
    def doc(side, i):
        mask = batch[f"{side}_attention_mask"][i].bool()
        return batch[f"{side}_input_ids"][i][mask].tolist(), batch[f"{side}_labels"][i][mask].tolist()
    docs = [[d for i in pairs_ for d in (doc("chosen", i), doc("rejected", i))] for pairs_ in ROWS]
    return _pack(docs), [2 * len(pairs_) for pairs_ in ROWS]


@pytest.mark.parametrize("cpo_alpha", [0.0, 0.5])  # SimPO, and SimPO with CPO's NLL term (sft_weight)
def test_simpo_matches_trl_cpo(dirs, tmp_path, cpo_alpha):
    policy_dir, _ = dirs
    args = _trl_args(CPOConfig, tmp_path, loss_type="simpo", cpo_alpha=cpo_alpha, simpo_gamma=0.5,
                     label_smoothing=0.1, max_length=64)
    hf = _hf(policy_dir)
    trainer = CPOTrainer(model=hf, args=args, train_dataset=Dataset.from_list(_text_pairs()),
                         processing_class=_tokenizer())
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(LENGTHS))])
    trainer.model.train()
    trl_loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    trl_loss.backward()
    with torch.no_grad():
        trl_averages = torch.cat(trainer.concatenated_forward(trainer.model, batch)[:2])

    rows, num_documents = _cpo_rows(batch)
    ours = _ours(policy_dir)
    policy = _logps(ours, rows, num_documents)
    per_pair, stats = preference_loss(policy["chosen"], policy["rejected"], None, None,
                                      chosen_tokens=policy["chosen_tokens"], rejected_tokens=policy["rejected_tokens"],
                                      beta=BETA, label_smoothing=0.1, reference="none", simpo_gamma=0.5)
    ours_loss, sft_loss = total_loss(per_pair, policy["chosen"], policy["chosen_tokens"], sft_weight=cpo_alpha)
    ours_loss.backward()
    averages = torch.cat([policy["chosen"] / policy["chosen_tokens"], policy["rejected"] / policy["rejected_tokens"]])
    assert _rel(averages.detach(), trl_averages) <= RTOL
    assert abs(ours_loss.item() - trl_loss.item()) <= RTOL * abs(trl_loss.item())
    if cpo_alpha:
        assert abs(sft_loss.item() - metrics["nll_loss"]) <= RTOL * metrics["nll_loss"]
    assert abs(stats["margin"].mean().item() - metrics["rewards/margins"]) <= RTOL * BETA * averages.abs().max()
    assert stats["accuracy"].mean().item() == metrics["rewards/accuracies"]
    _assert_grads(ours, hf.named_parameters(), set(load_file(policy_dir / "model.safetensors")))


# -- the pieces --------------------------------------------------------------------------------

def test_document_sums_and_pairs_skip_padding_and_empty_slots():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [7.0, 8.0, 9.0, 10.0, 11.0, 12.0]])
    documents = torch.tensor([[0, 0, 1, 2, 3, 3], [0, 1, 1, -1, -1, -1]])
    sums = document_sums(values, documents, 4)
    assert torch.equal(sums, torch.tensor([[3.0, 3.0, 4.0, 11.0], [7.0, 17.0, 0.0, 0.0]]))
    chosen, rejected = pairs(sums, [4, 2])
    assert torch.equal(chosen, torch.tensor([3.0, 4.0, 7.0])) and torch.equal(rejected, torch.tensor([3.0, 11.0, 17.0]))
    with pytest.raises(ValueError, match="row 1 holds 3 documents"):
        pairs(sums, [4, 3])


def test_preference_loss_refuses_unknown_or_unsupported_choices():
    one = torch.zeros(1)
    kwargs = dict(chosen_tokens=one + 1, rejected_tokens=one + 1)
    with pytest.raises(ValueError, match="preference loss 'hinge' unknown"):
        preference_loss(one, one, one, one, loss="hinge", **kwargs)
    with pytest.raises(ValueError, match="reference 'none' is SimPO"):
        preference_loss(one, one, None, None, loss="ipo", reference="none", **kwargs)
    with pytest.raises(ValueError, match=r"must lie in \[0, 0.5\)"):
        preference_loss(one, one, one, one, loss="robust", label_smoothing=0.5, **kwargs)
