"""The first K decoder layers of an HF checkpoint, as an HF directory that reads the original files.

A 754B checkpoint cannot be stepped on one machine; its first few layers can, with their
real weights. `truncated_view(src, dst, K)` writes `dst/` with
  * `config.json`: the source's, with `num_hidden_layers` K, the per-layer lists
    (`mlp_layer_types`, `indexer_types`) cut to K, and no MTP layer
    (`num_nextn_predict_layers` 0: on disk the MTP layer sits after the last decoder layer,
    so a K-layer model would read layer K in its place);
  * `model.safetensors.index.json` naming only the tensors of that model (the embedding, the
    first K layers, the final norm and the head, with FP8 scales), each in its original file;
  * symbolic links to the original shard files and tokenizer files.
Nothing is copied: glmtune's loaders read the index, so only the named tensors are read,
and the other layers' bytes are never touched. (`model.overrides` cannot do this: the loader
takes overrides for presets only, and refuses a tensor the config has no place for, which
every layer after K would be.) transformers loads the view too, reporting the other layers'
tensors in the shared files as unexpected keys. Which HF keys belong to the smaller model
is decided by `Glm5StateDictAdapter` (the only place HF key names live).
"""

from __future__ import annotations

import json
from pathlib import Path

from glmtune.checkpoint.hf_io import INDEX_NAME, TOKENIZER_FILES, checkpoint_files
from glmtune.checkpoint.shard_paths import VIEW_SOURCE_KEY
from glmtune.models.glm5.args import Glm5Args, truncated_args
from glmtune.models.glm5.state_dict_adapter import SCALE_SUFFIX, Glm5StateDictAdapter


def truncated_view(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """Write the K-layer view of checkpoint directory `src` into the empty or new `dst`.

    Raises:
        ValueError: `num_layers` is not below the checkpoint's layer count.
    """
    src, dst = Path(src).resolve(), Path(dst)
    args = Glm5Args.from_hf_config(src)
    if not 1 <= num_layers < args.num_hidden_layers:
        raise ValueError(f"--layers {num_layers}: {src} has {args.num_hidden_layers} decoder layers; "
                         f"a view keeps 1 to {args.num_hidden_layers - 1} of them")
    small = truncated_args(args, num_layers)
    adapter = Glm5StateDictAdapter(small)
    files = checkpoint_files(src)
    kept = {key for key in files if adapter.from_hf_key(key) is not None}
    kept |= {key for key in files if key.endswith(SCALE_SUFFIX) and key[: -len(SCALE_SUFFIX)] in kept}
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.update({k: v for k, v in small.to_hf_dict().items() if k in
                   ("num_hidden_layers", "mlp_layer_types", "indexer_types", "num_nextn_predict_layers",
                    "index_topk_pattern", "layer_types")})
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weight_map = {key: files[key].name for key in sorted(kept)}
    index = {"metadata": {VIEW_SOURCE_KEY: str(src), "num_hidden_layers": num_layers}, "weight_map": weight_map}
    (dst / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    for name in {*weight_map.values(), *(n for n in TOKENIZER_FILES if (src / n).is_file())}:
        if (dst / name).is_symlink():  # a view written before (a preflight run again in its directory)
            (dst / name).unlink()
        (dst / name).symlink_to(src / name)
    return dst
