"""`glmtune config show|validate`: print a recipe's resolved config, or check recipes before a launch.

    glmtune config show recipes/tiny/sft_support_json.yaml --optim.lr=3e-4
    glmtune config validate recipes/glm5/*.yaml --world-size 256

Overrides follow the recipe(s) as `--section.key=value` or `--section.key value`.
`validate` checks each recipe's parallel degrees against the world size and the
model's expert and layer counts (its family's numbers, `glmtune.models.catalog`: a preset,
the model directory's config.json, or the preset named by `model.validate_as` when the
directory is a placeholder), and
names any degree this version cannot run yet (pp, cp, tp > 1): the same checks
`glmtune train` runs before it allocates or writes anything. It reads a model directory's
config.json alone, never its weights, and imports no torch: `glmtune inspect DIR --verify`
and `glmtune train` check the weights against config.json.
"""

from __future__ import annotations

import argparse

from glmtune.config import config_to_yaml, grad_accum_steps, load_config, validate_config, validate_parallel
from glmtune.distributed.pipeline_plan import describe_split, plan_stages
from glmtune.io.text_limits import printable
from glmtune.models.catalog import model_args, model_dims, model_family  # unlike the registry: no torch

_OVERRIDES_HELP = "dotted overrides after the recipe: --optim.lr=2e-5 or --optim.lr 2e-5"
_EXAMPLES = """examples:
  glmtune config show tiny/sft_support_json --train.max_steps 20
  glmtune config validate recipes/glm5/sft_4k.yaml recipes/glm5/sft_32k_cp8.yaml
  glmtune config validate recipes/glm5/sft_4k.yaml --world-size 512 --parallel.nodes=64
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "config",
        help="show or validate recipes",
        description="Show a recipe's resolved config, or validate recipes against the model and world size.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="config_command", metavar="ACTION")

    show = actions.add_parser(
        "show",
        help="print the resolved YAML of a recipe plus overrides",
        description="Load RECIPE (following `extends:`), apply overrides, and print the resolved config as YAML. "
        "RECIPE is a path, or a name under recipes/ such as tiny/sft_support_json.",
    )
    show.add_argument("recipe", help="recipe YAML path or name under recipes/")
    show.add_argument("overrides", nargs=argparse.REMAINDER, help=_OVERRIDES_HELP)
    show.set_defaults(func=_show)

    validate = actions.add_parser(
        "validate",
        help="check recipes: types, parallel degrees, batch sizes",
        description="Load each RECIPE with the overrides and run every config check `glmtune train` runs before it "
        "starts: parallel degrees against the world size and the model's routed experts and layers, degrees this "
        "version cannot run yet (pp, cp, tp > 1), batch sizes, ranges. Exits 1 if any recipe fails. A model "
        "directory is read from its config.json alone (no torch, no weights read): `glmtune inspect DIR --verify` "
        "and `glmtune train` check its weights against it.",
    )
    validate.add_argument("recipes", nargs="+", help="recipe YAML paths or names under recipes/")
    validate.add_argument(
        "--world-size",
        type=int,
        help="number of processes to validate for (default: parallel.world_size, nodes x gpus_per_node, or 1)",
    )
    validate.add_argument("overrides", nargs=argparse.REMAINDER, help=_OVERRIDES_HELP)
    validate.set_defaults(func=_validate)

    parser.set_defaults(func=lambda args: _print_help(parser))


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 0


def _show(args: argparse.Namespace) -> int:
    cfg = load_config(args.recipe, args.overrides)
    print(config_to_yaml(cfg), end="")
    return 0


def _validate(args: argparse.Namespace) -> int:
    # REMAINDER swallows a --world-size written after the recipes; take it back out.
    overrides, world_size = _pop_world_size(args.overrides, args.world_size)
    failed = 0
    for recipe in args.recipes:
        layout = None  # the resolved degrees, when the layout itself is valid
        try:
            cfg = load_config(recipe, overrides)
            dims = model_dims(cfg.model)
            layout = validate_parallel(cfg, dims.num_experts, dims.num_layers, world_size)
            degrees = validate_config(cfg, dims.num_experts, dims.num_layers, world_size,
                                      model_refusals=dims.refusals)
        except (ValueError, FileNotFoundError) as exc:
            failed += 1
            detail = str(exc).replace("\n", "\n    ")
            # A layout can be sound for its world size and model and still need degrees not built yet.
            valid = f"\n    layout (valid for its world size and model): {layout.describe()}" if layout else ""
            print(printable(f"FAIL {recipe}\n    {detail}{valid}", multiline=True))
            continue
        layout = pipeline_split_description(cfg, degrees)
        print(
            f"ok   {printable(recipe)}\n    {degrees.describe()}\n"
            f"    model: {dims.num_experts} experts ({dims.num_experts // degrees.ep} per EP rank), "
            f"{dims.num_layers} layers, {layout} [{dims.source}]\n"
            f"    batch: {cfg.train.global_batch_size} rows/step = micro {cfg.train.micro_batch_size} x dp {degrees.dp}"
            f" x grad_accum {grad_accum_steps(cfg, degrees)}, {cfg.data.packed_sequence_size} tokens/row\n"
            f"    schedule: {schedule_description(cfg)}"
        )
    return 1 if failed else 0


def pipeline_split_description(cfg, degrees) -> str:
    """The layers per pipeline stage a run of `cfg` uses ("pp stages 20/20/20/18", from the family's per-layer
    costs), or "pp 1 (one stage of 78 layers)" without a pipeline."""
    layer_costs, head_cost = model_family(cfg.model).stage_costs(model_args(cfg.model), cfg.data.packed_sequence_size)
    stages = degrees.pp * cfg.parallel.pp_stages_per_rank
    if stages == 1:
        return f"pp 1 (one stage of {len(layer_costs)} layers)"
    return "pp stages " + describe_split(plan_stages(layer_costs, head_cost, stages, cfg.parallel.pp_layer_split or None))


def schedule_description(cfg) -> str:
    """The steps and the warm-up in steps, saying where the warm-up came from (a ratio of the run, or steps)."""
    o, steps = cfg.optim, cfg.train.max_steps
    warmup = o.warmup_steps_for(steps)
    if o.warmup_steps > 0 and o.warmup_ratio is not None:
        source = f" (optim.warmup_steps, which takes precedence over optim.warmup_ratio {o.warmup_ratio:g})"
    elif o.warmup_ratio is not None and o.warmup_steps == 0:
        source = f" (optim.warmup_ratio {o.warmup_ratio:g} x {steps}, rounded up)"
    else:
        source = ""
    decay = "constant lr" if o.scheduler == "constant" else f"{o.scheduler} to {o.min_lr_ratio:g} x lr"
    return f"{steps} steps, warm-up {warmup}{source}, then {decay}"


def _pop_world_size(tokens: list[str], world_size: int | None) -> tuple[list[str], int | None]:
    rest: list[str] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if token == "--world-size" and index + 1 < len(tokens):
            text, index = tokens[index + 1], index + 2
        elif token.startswith("--world-size="):
            text, index = token.split("=", 1)[1], index + 1
        else:
            rest.append(token)
            index += 1
            continue
        try:
            world_size = int(text)
        except ValueError:
            raise ValueError(f"--world-size expects an integer, got {text!r}") from None
    return rest, world_size
