"""An HF directory's config.json, hostile: every field the model reads of the wrong JSON type, out of
range, nested or sized past reason, is one sentence naming the file (`glmtune inspect DIR`, exit 2),
never a TypeError from deep inside the model build or a list of 10^12 layer kinds."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from glmtune.cli import main


def _inspect(directory: Path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["inspect", str(directory)])
    return code, err.getvalue()


def _set(**fields):
    return lambda config: json.dumps({**config, **fields})


def _without_indexer_types(**fields):
    return lambda config: json.dumps({**{k: v for k, v in config.items() if k != "indexer_types"}, **fields})


CONFIGS = {  # config.json -> what the sentence says
    "hidden_size a string": (_set(hidden_size="big"), "hidden_size is 'big', not a non-negative integer"),
    "layers a float": (_set(num_hidden_layers=2.5), "num_hidden_layers is 2.5, not a non-negative integer"),
    "layers negative": (_set(num_hidden_layers=-1), "num_hidden_layers is -1, not a non-negative integer"),
    "layers 10^12": (_without_indexer_types(num_hidden_layers=10**12), "more than 10,000 layers"),
    "experts a boolean": (_set(n_routed_experts=True), "n_routed_experts is True, not a non-negative integer"),
    "n_group 0": (_set(n_group=0), "n_group is 0, must be at least 1"),  # a ZeroDivisionError traceback
    "experts per token 0": (_set(num_experts_per_tok=0), "num_experts_per_tok is 0, must be at least 1"),
    "index_topk 0": (_set(index_topk=0), "index_topk is 0, must be at least 1"),
    "eps a string": (_set(rms_norm_eps="1e-5"), "rms_norm_eps is '1e-5', not a finite number"),
    "eps NaN": (lambda c: json.dumps({**c, "rms_norm_eps": float("nan")}), "rms_norm_eps is nan, not a finite"),
    "tie a number": (_set(tie_word_embeddings=1), "tie_word_embeddings is 1, not a bool"),
    "hidden_act a list": (_set(hidden_act=["silu"]), "hidden_act is ['silu'], not a str"),
    "eos a string": (_set(eos_token_id="</s>"), "eos_token_id is '</s>', not a token id"),
    "pad a list": (_set(pad_token_id=[1]), "pad_token_id is [1], not a token id"),
    "rope a list": (_set(rope_parameters=[1]), "rope_parameters is [1], not an object"),
    "rope_theta a string": (_set(rope_parameters={"rope_type": "default", "rope_theta": "x"}),
                            "not a rope_type name and a finite rope_theta"),
    "indexer_types a number": (_set(indexer_types=5), "indexer_types is 5, not a list of layer kinds"),
    "mlp_layer_types of numbers": (_set(mlp_layer_types=[1, 2, 3, 4]), "not a list of layer kinds"),
    "index_topk_pattern a number": (_without_indexer_types(index_topk_pattern=7),
                                    "index_topk_pattern is 7, not a string of F and S or a list"),
    "index_topk_freq a list": (_without_indexer_types(index_topk_freq=[4]), "must be integers"),
    "nested 40 deep": (_set(quantization_config=json.loads("[" * 40 + "]" * 40)), "nested deeper than 32 levels"),
    "not UTF-8": (lambda c: b'{"hidden_size": "\xff"}', "not UTF-8 text"),
    "over its size": (lambda c: json.dumps({**c, "pad": " " * (16 << 20)}), "not a model config"),  # 16 MiB bound
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_hostile_config_json_is_one_sentence_naming_it(saved, tmp_path, case):
    directory = tmp_path / "model"
    directory.mkdir()
    for file in saved.iterdir():  # the shards linked, config.json written: nothing large is copied
        (directory / file.name).symlink_to(file)
    (directory / "config.json").unlink()
    change, said = CONFIGS[case]
    content = change(json.loads((saved / "config.json").read_text()))
    (directory / "config.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    code, err = _inspect(directory)
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert f"{directory / 'config.json'}" in err and said in err, err


def test_the_intact_config_still_loads(saved):
    code, err = _inspect(saved)
    assert code == 0, err
