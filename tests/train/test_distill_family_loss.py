"""Each model family's loss path with a teacher (Glm5Compute.loss, HfCompute.loss): the cross-entropy sum
plus λ times the bucketed, tempered KL of `distill_loss.topk_kl_reference` over the model's own
materialized logits, and the two parts as statistics; with λ = 0 the family's plain loss."""

import dataclasses

import pytest
import torch

from glmtune.models.common.distill_loss import TeacherTopK, topk_kl_reference
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.registry import GLM5, HF
from tests.models.hf.conftest import write_checkpoint

K = 5


def _batch(vocab: int, length: int = 24, seed: int = 0) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, length), generator=g)
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    targets[:, :6] = -100  # a prompt: no loss there
    mask = targets != -100
    mask[0, 10] = False  # a supervised position the teacher did not produce
    top = torch.randn(1, length, vocab, generator=g).log_softmax(-1).topk(K, dim=-1)
    teacher = TeacherTopK(torch.where(mask[..., None], top.indices, 0), torch.where(mask[..., None], top.values, 0.0),
                          mask, weight=0.7, temperature=1.5)
    return MicroBatch(ids, targets=targets, teacher=teacher)


def _check(spec, model, logits_fn, vocab):
    mb = _batch(vocab)
    loss, count, stats = spec.compute.loss(model, mb)
    plain = spec.compute.loss(model, dataclasses.replace(mb, teacher=None))
    no_kl = spec.compute.loss(model, dataclasses.replace(mb, teacher=dataclasses.replace(mb.teacher, weight=0.0)))
    assert torch.equal(no_kl[0], plain[0]) and len(no_kl) == 2  # λ = 0: the family's loss, nothing else
    with torch.no_grad():
        kl = topk_kl_reference(logits_fn(mb.input_ids).double(), mb.teacher)
    # (sum, supervised targets) pairs: the trainer sums them over every rank (a context-parallel rank's are
    # its own queries') and reports sum / count
    assert stats["ce"][0].item() == pytest.approx(plain[0].item(), rel=1e-6)
    assert stats["kl"][0].item() == pytest.approx(kl.item(), rel=1e-5)
    assert stats["ce"][1].item() == stats["kl"][1].item() == int((mb.targets != -100).sum())
    assert loss.item() == pytest.approx(plain[0].item() + 0.7 * kl.item(), rel=1e-6)
    assert int(count) == int((mb.targets != -100).sum())
    loss.backward()  # the KL's gradient reaches the head
    head = model.lm_head.weight if hasattr(model, "lm_head") else model.get_output_embeddings().weight
    assert head.grad is not None and torch.isfinite(head.grad).all()


def test_glm5_loss_adds_the_teacher_kl():
    model = GLM5.weights.build(GLM5.family.preset_args("tiny"), torch.float32, seed=0)
    _check(GLM5, model, lambda ids: model(ids).logits, 4096)


def test_hf_loss_adds_the_teacher_kl(tmp_path):
    write_checkpoint("qwen3", tmp_path)
    model = HF.weights.load_pretrained(tmp_path, torch.float32, "cpu")
    _check(HF, model, lambda ids: model(input_ids=ids).logits, 96)
