"""`ModelFamily`: what a model family answers from its numbers alone, without torch.

`glmtune --help` and `glmtune config validate` answer in a fraction of a second only while
nothing they import pulls in torch (seconds to import, more on a loaded machine). What they
need of a family is arithmetic on its architecture: the presets, a checkpoint's config.json
read into the family's args, `model.overrides` applied, the experts and layers the layout
check divides (`dims`), the per-layer training costs the pipeline split balances
(`stage_costs`) and the parameter count that bounds what a config.json may describe. A family
gives those as a `ModelFamily` built from its torch-free modules (`models/<family>/family.py`),
listed by `glmtune/models/catalog.py`.

Everything else (build, load, save, loss, parallelization) is the family's `ModelSpec`
(model_spec.py), which imports torch and answers the questions above through this object.
`read_args` reads config.json only: the spec's `args_from_hf` also checks the directory's
weights against it (train, eval, inspect and every load do; `config validate` does not).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


# A setting the family honours only at some values: (dotted config key, the values it honours,
# the rest of the sentence that refuses any other value, after "<key>: <value> "). Plain data:
# config/ checks it (`glmtune.config.validate.limit_errors`) and knows no model, models/ no config.
SettingLimit = tuple[str, tuple[Any, ...], str]


@dataclass(frozen=True)
class ModelDims:
    """What the layout check needs of a model: routed experts per MoE layer, decoder layers."""

    num_experts: int  # routed experts per MoE layer (config.json `n_routed_experts`)
    num_layers: int  # decoder layers, MTP excluded (config.json `num_hidden_layers`)
    source: str  # where the numbers came from, for messages
    # What no layout can run of the recipe: a sentence each (of the recipe's `model` section), or a
    # family's `SettingLimit` (validate_config checks them against the whole config, first).
    refusals: tuple[str | SettingLimit, ...] = ()


@dataclass(frozen=True)
class ModelFamily:
    """One family's torch-free answers (module docstring); `args` is the family's own architecture type."""

    name: str  # the family's folder under glmtune/models/ ("glm5")
    hf_model_type: str  # config.json `model_type` of the family's checkpoints
    presets: Mapping[str, Callable[[], Any]]  # preset name -> its architecture
    # an HF directory (or its config.json) -> its architecture, from config.json alone; a config
    # describing more than any machine holds is refused (nothing to check it against)
    read_args: Callable[[str | Path], Any]
    with_overrides: Callable[[Any, dict[str, Any]], Any]  # args with `model.overrides` (config.json keys)
    # (args, where they came from, model.overrides) -> experts and layers after the overrides (checked)
    dims: Callable[[Any, str, dict[str, Any] | None], ModelDims]
    # (args, tokens per row) -> (training cost of each decoder layer, of the head), for a pipeline split
    stage_costs: Callable[[Any, int], tuple[list[float], float]]
    parameter_count: Callable[[Any], int]  # every parameter, MTP or other extra layers included
    # settings the family does not honour beyond some values (EP, PP, CP, another family's losses):
    # refused by `glmtune config validate` and `glmtune train` before anything is allocated
    limits: tuple[SettingLimit, ...] = ()

    def preset_args(self, name: str) -> Any:
        """The architecture of preset `name`."""
        if name not in self.presets:
            raise ValueError(f"unknown model preset {name!r}; choose from {', '.join(self.presets)}")
        return self.presets[name]()
