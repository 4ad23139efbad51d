"""A real model trained here to read passages, for the retrieval arm's end-to-end test on real
generations (tests/decide/test_planted_facts_model.py).

A tiny Qwen3 is built from its config (seeded, no download) and trained for a few steps, in plain
PyTorch, on the retrieval arm's own prompts (`with_passages`, rendered by eval's `Prompting` with
the bundled chat template) over the documents and questions of other seeds than the test's, whose
planted facts differ: given passages, its answer is passage [1]'s text and the citation ("... [1]");
given none, "I do not know." It is saved as an HF directory (`save_pretrained`) with the tiny
tokenizer and chat template beside it, which `glmtune decide --base DIR` loads as any HF model
(the hf family). It is too small and too briefly trained to copy a passage faithfully: what it
answers is whatever it generates, and the test asserts what the scoring makes of that.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from glmtune.data.chat_template import load_chat_template
from glmtune.data.synthetic_docs import generate_doc_questions, write_documents
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR, load_tokenizer
from glmtune.decide.documents import read_documents
from glmtune.decide.passages import Passages, with_passages
from glmtune.eval.answering import Prompting
from glmtune.models.hf.quiet import no_progress_bars

CHUNK_WORDS, OVERLAP, PASSAGES = 20, 10, 1  # short passages: a short copy to learn
ABSTAIN = "I do not know."
TRAIN_SEEDS = (1, 2, 3)
STEPS, BATCH, LR = 150, 16, 3e-3


def _examples(root: Path, seed: int, prompting: Prompting) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of every question of `seed`: with its passages, and without."""
    tokenizer = prompting.tokenizer
    docs = write_documents(root / f"docs-{seed}", seed=seed)
    passages = Passages(read_documents(docs, CHUNK_WORDS, OVERLAP), PASSAGES)
    examples = []
    for row in generate_doc_questions(seed=seed):
        prompt = row["messages"][:1]
        shown = passages.for_question(prompt[0]["content"])
        answer = f"{shown[0].chunk.text} [1]"
        for messages, text in ((with_passages(prompt, shown), answer), (prompt, ABSTAIN)):
            examples.append((prompting.render(messages, None), tokenizer.encode(text, add_special_tokens=False)))
    return examples


def _batch(items: list[tuple[list[int], list[int]]], end: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and labels (the answer and its end token only; -100 elsewhere)."""
    length = max(len(p) + len(a) + 1 for p, a in items)
    ids = torch.full((len(items), length), pad)
    labels = torch.full((len(items), length), -100)
    for i, (prompt, answer) in enumerate(items):
        sequence = prompt + answer + [end]
        ids[i, :len(sequence)] = torch.tensor(sequence)
        labels[i, len(prompt):len(sequence)] = torch.tensor(answer + [end])
    return ids, labels


def _answer_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The next-token loss on the answers' positions; the head is applied to those alone (most of
    a prompt's positions have no label, and the 4096-way head is most of a step's time)."""
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    kept = targets != -100
    return torch.nn.functional.cross_entropy(model.lm_head(hidden[kept]), targets[kept])


def train_reader(root: Path) -> Path:
    """The trained model's HF directory under `root` (module docstring)."""
    tokenizer = load_tokenizer(TINY_TOKENIZER_DIR)
    prompting = Prompting(tokenizer, load_chat_template(TINY_TOKENIZER_DIR), False, None)
    end = tokenizer.convert_tokens_to_ids("<|user|>")  # a stop token of the template's turns
    examples = [e for seed in TRAIN_SEEDS for e in _examples(root, seed, prompting)]
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=512,
                         pad_token_id=0, bos_token_id=1, eos_token_id=end)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * (1 - s / STEPS))
    order = random.Random(0)
    for _ in range(STEPS):
        ids, labels = _batch(order.sample(examples, BATCH), end, 0)
        _answer_loss(model, ids, labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    directory = root / "reader"
    with no_progress_bars():
        model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY_TOKENIZER_DIR / name, directory / name)
    return directory
