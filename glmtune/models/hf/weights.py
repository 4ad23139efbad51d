"""An HF directory's weights checked against its config.json, from the safetensors headers alone.

Every command reads an `hf` directory's architecture through the spec's `args_from_hf` before it
builds anything at that size: a config.json that does not describe the weights beside it (another
model's, a layer count edited by hand) is refused here, naming the file and the tensor, instead of
failing deep inside transformers' load. Only headers are read (safetensors' `safe_open`), never a
tensor's data.

The expected names and shapes are those of transformers' own model built on meta, as the family's
state-dict adapter names them on disk (a MoE layer's stacked experts: one tensor per expert and
projection, state_dict_adapter.py). A tied LM head may be absent from the files.
"""

from __future__ import annotations

import re
from pathlib import Path

from safetensors import safe_open
from torch import nn

from glmtune.models.common.hf_config import read_hf_config
from glmtune.models.hf.state_dict_adapter import HfStateDictAdapter

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def holds_weights(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and ((path / SINGLE_NAME).exists() or (path / INDEX_NAME).exists())


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of an HF directory (the index's, or the single file)."""
    if (path / INDEX_NAME).exists():
        weight_map = read_hf_config(path / INDEX_NAME).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{path / INDEX_NAME}: no weight_map of file names")
        names = sorted(set(weight_map.values()))
        outside = [name for name in names if Path(name).name != name]
        if outside:
            raise ValueError(f"{path / INDEX_NAME}: weight_map names {outside[0]!r}, not a file of this directory")
        return [path / name for name in names]
    return [path / SINGLE_NAME]


def header_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Tensor name -> (shape, file) over every safetensors file of `path`."""
    shapes = {}
    for file in weight_files(path):
        if not file.is_file():
            raise ValueError(f"{file}: missing (listed by the index) or not a regular file")
        with safe_open(str(file), framework="pt") as handle:
            names = handle.keys()  # a safetensors handle, not a dict
            for key in names:
                shapes[key] = (tuple(handle.get_slice(key).get_shape()), file)
    return shapes


def check_weights(path: str | Path, meta_model: nn.Module, num_layers: int, adapter: HfStateDictAdapter) -> None:
    """Refuse (one sentence naming the file and tensor) weights that are not `meta_model`'s, named on
    disk by the family's `adapter` (module docstring)."""
    path = Path(path)
    found = header_shapes(path)
    config = path / "config.json"
    for key, (shape, file) in found.items():
        layer = _LAYER.search(key)
        if layer and int(layer.group(1)) >= num_layers:
            raise ValueError(f"{file}: {key} is of layer {layer.group(1)}, but {config} has "
                             f"num_hidden_layers={num_layers}")
    tied_head = meta_model.get_output_embeddings().weight is meta_model.get_input_embeddings().weight
    for key, tensor in meta_model.state_dict().items():
        for hf_key, part in adapter.to_hf(key, tensor):
            if hf_key in found:
                shape, file = found[hf_key]
                if shape != tuple(part.shape):
                    raise ValueError(f"{file}: {hf_key} has shape {list(shape)}, {config} describes "
                                     f"{list(part.shape)}")
            elif not (tied_head and key.endswith("lm_head.weight")):
                raise ValueError(f"{path}: no tensor {hf_key} in the safetensors files, which {config} describes")
