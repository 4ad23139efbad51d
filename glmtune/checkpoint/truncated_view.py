"""The first K decoder layers of an HF checkpoint, as an HF directory that reads the original files.

A 754B checkpoint cannot be stepped on one machine; its first few layers can, with their
real weights. `truncated_view(src, dst, K, adapter, config_updates)` writes `dst/` with
  * `config.json`: the source's, with `config_updates` (the family's: its layer count and
    per-layer lists cut to K; GLM-5 also drops its MTP layer, which on disk sits after the
    last decoder layer, so a K-layer model would read layer K in its place);
  * `model.safetensors.index.json` naming only the tensors of that model (those `adapter`,
    the K-layer model's state-dict adapter, has a place for, FP8 scales with their weights),
    each in its original file;
  * symbolic links to the original shard files and tokenizer files.
Nothing is copied: glmtune's loaders read the index, so only the named tensors are read,
and the other layers' bytes are never touched. (`model.overrides` cannot do this: the loader
takes overrides for presets only, and refuses a tensor the config has no place for, which
every layer after K would be.) transformers loads the view too, reporting the other layers'
tensors in the shared files as unexpected keys. Knows no family: the spec passes the
K-layer model's adapter and config keys (GLM-5's: `glmtune/models/glm5/view_config.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from glmtune.checkpoint.fp8_layout import SCALE_SUFFIX
from glmtune.checkpoint.hf_io import INDEX_NAME, TOKENIZER_FILES, checkpoint_files
from glmtune.checkpoint.shard_paths import VIEW_SOURCE_KEY


def truncated_view(src: str | Path, dst: str | Path, num_layers: int, adapter: Any,
                   config_updates: dict[str, Any]) -> Path:
    """Write the `num_layers`-layer view of checkpoint directory `src` into the empty or new `dst`:
    the tensors `adapter` (the smaller model's, `from_hf_key` None for a tensor it has no place
    for) keeps, config.json updated with `config_updates`."""
    src, dst = Path(src).resolve(), Path(dst)
    files = checkpoint_files(src)
    kept = {key for key in files if adapter.from_hf_key(key) is not None}
    kept |= {key for key in files if key.endswith(SCALE_SUFFIX) and key[: -len(SCALE_SUFFIX)] in kept}
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.update(config_updates)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weight_map = {key: files[key].name for key in sorted(kept)}
    index = {"metadata": {VIEW_SOURCE_KEY: str(src), "num_hidden_layers": num_layers}, "weight_map": weight_map}
    (dst / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    for name in {*weight_map.values(), *(n for n in TOKENIZER_FILES if (src / n).is_file())}:
        if (dst / name).is_symlink():  # a view written before (a preflight run again in its directory)
            (dst / name).unlink()
        (dst / name).symlink_to(src / name)
    return dst
