"""GLM-5's sparse-attention selection between layers: a shared-indexer layer reads the selection,
bool [B, S, T], of the full-indexer layer before it, and keeps it as an input until its backward (the
shared layers after it read the same tensor); a full-indexer layer makes its own and is not handed the
earlier one. The memory model counts what is kept per layer (`LayerMemory.input_kept`), at every layer
of a stage but its first; `plan/memory.py` adds it to the layer's kept activations for each micro-batch
in flight. Handed to every layer, as they were until 2026-12-07, the selections held 4.62 GiB (rank 384)
and 5.38 GiB (rank 128) at sft_32k_cp8's peaks on an H100 (`indexer.py`'s `dsa_topk_mask`,
`benchmarks/rank_memory_snapshot.py recipes/glm5/sft_32k_cp8.yaml --at-peak`), though GLM-5's layers all
have their own indexer.

Checked on the tiny GLM-5 under full activation checkpointing: after its forward, the live bool [B, S, T]
tensors are the allowed mask and the selections the formula counts."""

from __future__ import annotations

import gc

import pytest
import torch

from glmtune.models.common.memory_model import StepShape
from glmtune.models.glm5.args import get_preset
from glmtune.models.glm5.memory_model import GLM5_MEMORY
from glmtune.models.glm5.model import Glm5ForCausalLM
from glmtune.models.glm5.parallelize import apply_activation_checkpointing

SEQ = 32  # more than index_topk: the selection is needed


def _live_masks(seq: int) -> int:
    """Distinct storages of the bool [1, seq, seq] tensors alive anywhere after the forward."""
    gc.collect()
    storages = set()
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter):  # no attribute lookups on others
            if obj.dtype == torch.bool and tuple(obj.shape) == (1, seq, seq):
                storages.add(obj.untyped_storage().data_ptr())
    return len(storages)


@pytest.mark.parametrize(("types", "kept"), [(["full", "shared", "full", "shared"], 2),
                                             (["full", "full", "full", "full"], 0),
                                             (["full", "shared", "shared", "shared"], 1)])
def test_a_shared_indexer_layer_keeps_the_selection_it_reads_and_a_full_one_none(types, kept):
    args = get_preset("tiny").replace(index_topk=8, indexer_types=types)
    torch.manual_seed(0)
    model = Glm5ForCausalLM(args)
    apply_activation_checkpointing(model, "full")
    loss = model(torch.randint(0, args.vocab_size, (1, SEQ))).logits.float().sum()
    step = StepShape(1, SEQ)
    counted = sum(GLM5_MEMORY.layer(args, step, i).input_kept for i in range(args.num_hidden_layers))
    assert counted == SEQ * SEQ * kept  # bool: one byte each
    assert _live_masks(SEQ) == 1 + kept  # and the allowed mask
    loss.backward()
