"""Check 3: the config and tokenizer load without the weights; the architecture is the family's; the
template renders the data in its own turn format.

The model is built on the meta device by its family's spec (`glmtune.models.registry`) from
the recipe's model (an HF directory's config.json, or a preset with its overrides): no weight
is read and no memory allocated. For an HF directory, config.json must name the family's
architecture (GLM-5's `GlmMoeDsaForCausalLM`; the hf family's any `*ForCausalLM`) and
transformers must read it (`AutoConfig`, as its own loading would); a preset's dimensions are
reported as they are.

The tokenizer is the one the run loads (data.tokenizer, else the model directory's, else
the bundled tiny one), with a vocabulary that fits the model. The chat template is the one the
run renders with (the tokenizer directory's, else the bundled GLM-5 template); its turn format
(data/turn_formats.py: GLM, ChatML, Llama-3, or generation blocks) decides what it must render
for the first conversation of the recipe's data, and the tokenizer must hold that format's
marker tokens as single tokens. GLM (as before): `[gMASK]<sop>` first (also single tokens), the
role token of every message (`<|system|>`, `<|user|>`, `<|assistant|>`, `<|observation|>` for
tool results). ChatML, Llama-3: an assistant turn for every assistant message and a user turn
for every user message, by the format's openings. Every format: a generation prompt ending in
the format's assistant opening (then at most a `<think>`/`</think>` block), and assistant tokens
to train on under `data.loss_on`.

A raw-text recipe (`data.kind: text`) has no chat template: its tokenizer must have an EOS token
(training puts it after every document) and fit the model, and the first document of its data
tokenizes as training tokenizes it (`data.text_corpus.tokenize_texts`), every token a target.
"""

from __future__ import annotations

import hashlib
import itertools
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from glmtune.data.chat_template import (
    BUNDLED_TEMPLATE_PATH,
    chat_format,
    load_chat_template,
    render_conversation,
    tokenize_row,
)
from glmtune.data.contract import check_or_raise, normalize_row
from glmtune.data.sources import read_rows
from glmtune.data.synthetic import generate_rows
from glmtune.data.text_corpus import tokenize_texts
from glmtune.data.text_run_data import corpus_options
from glmtune.data.text_sources import no_documents_message, read_documents
from glmtune.data.tokenizer import EOS_TOKEN, ROLE_TOKENS, load_tokenizer, resolve_tokenizer_dir
from glmtune.data.turn_formats import GLM, TurnFormat
from glmtune.io.json_file import json_name, read_json_file
from glmtune.io.text_limits import clipped
from glmtune.models.common.hf_config import read_hf_config
from glmtune.models.registry import model_args
from glmtune.preflight.context import Preflight
from glmtune.preflight.result import CheckResult, verdict
from glmtune.train.model_source import tokenizer_dir_for

PREFIX = "[gMASK]<sop>"
ROLE_MARKERS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "tool": "<|observation|>"}
assert set(ROLE_MARKERS.values()) == set(ROLE_TOKENS)
_MAX_TOKENIZER_CONFIG_BYTES = 64 << 20  # as the chat template's loader reads it


def first_conversation(pf: Preflight) -> dict[str, Any]:
    """The first conversation of the recipe's training data, normalized as the pipeline reads it."""
    d = pf.cfg.data
    if d.train:
        return check_or_raise(itertools.islice(read_rows(d.train), 1))[0].data
    if d.synthetic is None:
        raise ValueError("data.train is empty and data.synthetic is not set: no conversation to render")
    return normalize_row(generate_rows(min(d.synthetic.rows, pf.rows), d.synthetic.seed)[0])


def architecture_problems(pf: Preflight, evidence: dict[str, Any]) -> list[str]:
    args = model_args(pf.cfg.model)
    meta = pf.spec.weights.build(args, device="meta")
    evidence["meta_model"] = {"parameters": sum(p.numel() for p in meta.parameters()), "bytes_allocated": 0}
    evidence["architecture"] = pf.spec.architecture.summary(args)
    if pf.model_dir is None:
        evidence["source"] = f"preset {pf.cfg.model.name_or_path}"
        return []
    from transformers import AutoConfig

    config = read_hf_config(pf.model_dir)  # bounded, an object, or one sentence naming the file
    architectures = config.get("architectures")
    evidence["config_architectures"] = architectures
    expected = pf.spec.hf_architecture
    if not (isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)):
        return [f"{pf.model_dir}/config.json: architectures is {json_name(architectures)}, not a list of class "
                f"names; expected [{expected}]"]
    # the family's class name, or its pattern (the hf family: any `*ForCausalLM` transformers implements)
    problems = [] if any(fnmatchcase(a, expected) for a in architectures) else [
        f"{pf.model_dir}/config.json: architectures {clipped(architectures)}, expected [{expected}]"]
    evidence["transformers_config"] = type(AutoConfig.from_pretrained(pf.model_dir, local_files_only=True)).__name__
    return problems


def template_source(directory: Path) -> str:
    """Which file `load_chat_template(directory)` read the template from."""
    if (directory / "chat_template.jinja").is_file():
        return str(directory / "chat_template.jinja")
    config = directory / "tokenizer_config.json"
    if config.is_file() and read_json_file(config, max_bytes=_MAX_TOKENIZER_CONFIG_BYTES).get("chat_template"):
        return str(config)
    return f"{BUNDLED_TEMPLATE_PATH} (bundled GLM-5 template)"


def _required_tokens(turns: TurnFormat) -> tuple[str, ...]:
    """Tokens the tokenizer must hold as one token each under a template of `turns`."""
    if turns is GLM:
        return (*ROLE_TOKENS, EOS_TOKEN, "[gMASK]", "<sop>")
    return (*turns.markers, turns.appended_eos) if turns.appended_eos else turns.markers


def _turn_problems(turns: TurnFormat, row: dict[str, Any], text: str, prompt: str, source: str) -> list[str]:
    """What the rendered conversation `text` and generation `prompt` lack in the format of `turns`."""
    problems = []
    roles = [m["role"] for m in row["messages"]]
    if turns is GLM:
        if not text.startswith(PREFIX):
            problems.append(f"chat template {source} does not start the conversation with {PREFIX}: {text[:40]!r}")
        missing = sorted({ROLE_MARKERS[r] for r in roles} - {t for t in ROLE_TOKENS if t in text})
        if missing:
            problems.append(f"chat template {source} renders no {', '.join(missing)} for the data's messages")
    elif turns.assistant_start:  # ChatML, Llama-3: a turn for every message of the two roles
        found = {"assistant": len(turns.assistant_char_spans(text)), "user": len(turns.user_start.findall(text))}
        for role, count in found.items():
            if count < roles.count(role):
                problems.append(f"chat template {source} renders {count} {turns.name} {role} turns for the data's "
                                f"{roles.count(role)} {role} messages")
    if turns.assistant_start:
        opening = prompt.rfind(turns.assistant_start)
        tail = prompt[opening + len(turns.assistant_start):] if opening >= 0 else prompt
        if opening < 0 or tail.replace("<think>", "").replace("</think>", "").strip():
            problems.append(f"chat template {source}: the generation prompt ends {prompt[-30:]!r}, not {turns.label}")
    return problems


def template_problems(pf: Preflight, evidence: dict[str, Any]) -> list[str]:
    tokenizer_dir = tokenizer_dir_for(pf.cfg, pf.model_dir)
    directory = resolve_tokenizer_dir(tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    vocab = pf.spec.architecture.vocab_size(model_args(pf.cfg.model))
    template = load_chat_template(directory)
    source = template_source(directory)
    turns = chat_format(template).turns  # a template of no format glmtune knows: a ValueError naming it
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in _required_tokens(turns)}
    evidence["tokenizer"] = {"directory": str(directory), "size": len(tokenizer), "special_token_ids": ids}
    problems = [f"tokenizer {directory}: {token} is not one token" for token, i in ids.items()
                if i in (None, tokenizer.unk_token_id)]
    if len(tokenizer) > vocab:
        problems.append(f"tokenizer {directory} has {len(tokenizer)} tokens, the model's vocab_size is {vocab}")
    row = first_conversation(pf)
    d = pf.cfg.data
    text = render_conversation(row["messages"], tools=row.get("tools") or None, template=template,
                               enable_thinking=d.enable_thinking, tokenizer=tokenizer)
    prompt = render_conversation(row["messages"][:-1], tools=row.get("tools") or None, template=template,
                                 enable_thinking=False, add_generation_prompt=True, tokenizer=tokenizer)
    evidence["chat_template"] = rendered = {
        "source": source, "sha256": hashlib.sha256(template.encode()).hexdigest(), "turn_format": turns.name,
        "rendered_head": text[:400], "generation_prompt_tail": prompt[-60:],
        "roles": [m["role"] for m in row["messages"]]}
    problems += _turn_problems(turns, row, text, prompt, source)
    try:
        sample = tokenize_row(row, tokenizer, template=template, loss_on=d.loss_on, enable_thinking=d.enable_thinking)
    except ValueError as exc:  # the loss mask cannot be found: role tokens missing or not atomic
        return problems + [f"chat template {source}: {exc}"]
    rendered.update(tokens=len(sample.input_ids), supervised_tokens=sample.num_targets)
    if not sample.num_targets:
        problems.append(f"chat template {source}: the conversation has no assistant token to train on")
    return problems


def text_problems(pf: Preflight, evidence: dict[str, Any]) -> list[str]:
    """data.kind text: the tokenizer (an EOS, a vocabulary that fits) and the first document tokenized."""
    tokenizer_dir = tokenizer_dir_for(pf.cfg, pf.model_dir)
    directory = resolve_tokenizer_dir(tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    vocab = pf.spec.architecture.vocab_size(model_args(pf.cfg.model))
    evidence["tokenizer"] = {"directory": str(directory), "size": len(tokenizer),
                             "eos_token_id": tokenizer.eos_token_id}
    problems = []
    if tokenizer.eos_token_id is None:
        problems.append(f"tokenizer {directory}: no EOS token, which training puts after every document")
    if len(tokenizer) > vocab:
        problems.append(f"tokenizer {directory} has {len(tokenizer)} tokens, the model's vocab_size is {vocab}")
    if problems:
        return problems
    paths = pf.cfg.data.train
    doc = next(read_documents(paths, corpus_options(pf.cfg, (1.0, 0.0, 0.0)).read), None)
    if doc is None:
        return [f"data.train: {no_documents_message(paths)}"]
    [ids] = tokenize_texts(tokenizer, [doc.text])
    evidence["text"] = {"origin": str(doc.origin), "source": doc.source, "tokens": len(ids)}
    return problems


def check_model(pf: Preflight) -> CheckResult:
    evidence: dict[str, Any] = {}
    try:
        problems = architecture_problems(pf, evidence)
    except (OSError, ValueError) as exc:
        return CheckResult(3, "fail", f"model config does not load: {exc}", evidence)
    try:
        problems += (text_problems if pf.cfg.data.kind == "text" else template_problems)(pf, evidence)
    except (OSError, ValueError) as exc:
        problems.append(f"tokenizer or chat template: {exc}")
    arch = evidence["architecture"]
    template = evidence.get("chat_template", {})
    text = evidence.get("text")
    meta = evidence["meta_model"]
    dims = pf.spec.family.dims(model_args(pf.cfg.model), pf.cfg.model.name_or_path)
    moe_layers = arch.get("num_moe_layers", 0)  # every family's summary says how many layers are MoE
    name = (evidence.get("config_architectures") or [pf.spec.hf_architecture])[0]
    message = (f"{name} on meta ({meta['parameters']:,} parameters, nothing read): "
               f"{dims.num_layers} layers ({dims.num_layers - moe_layers} dense, {moe_layers} MoE), "
               f"{dims.num_experts} experts, hidden {arch['hidden_size']}; tokenizer "
               f"{evidence.get('tokenizer', {}).get('size')} tokens; " + (
                   f"raw text, no chat template: the first document ({text['origin']}) is {text['tokens']} tokens "
                   "with its EOS, every one a target" if text else
                   f"template renders {'/'.join(template.get('roles', []))} with "
                   f"{template.get('turn_format', 'GLM')} turns, "
                   f"{template.get('supervised_tokens')} of {template.get('tokens')} tokens supervised"))
    return verdict(3, problems, message, evidence)
