"""Write tests/peft/engine_fixtures/ from trained runs: `python tests/engines/capture.py RUNS_ROOT`.

RUNS_ROOT holds one glmtune run per variant (variants.VARIANTS); run in the engines venv, with
glmtune's own venv as GLMTUNE_PYTHON (default .venv/bin/python) for `glmtune export` and the
GLM-5 config."""

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import engine_views  # noqa: E402
from variants import SGLANG_SERVED, VARIANTS  # noqa: E402

ROOT = Path(__file__).parents[2]
FIXTURES = ROOT / "tests" / "peft" / "engine_fixtures"
STARTUP_FIXTURE = "sglang-startup.json"
LAYOUTS = {"peft": "adapter", "per_expert": "adapter_per_expert"}
SERVER = ["python", "-m", "sglang.launch_server"]
UNFUSED = "--disable-shared-experts-fusion"


def glmtune_python() -> str:
    return os.environ.get("GLMTUNE_PYTHON", str(ROOT / ".venv" / "bin" / "python"))


def capture(runs_root: Path) -> dict[str, dict]:
    out = {}
    for variant in VARIANTS:
        run = runs_root / variant
        for layout, sub in LAYOUTS.items():
            for engine in ("vllm", "sglang"):
                out[f"{engine}-{layout}-{variant}.json"] = engine_views.fixture(engine, layout, variant, run / sub,
                                                                                run / "base")
    return out


def glm5_base(out: Path) -> Path:
    """A directory with GLM-5's config.json (glmtune's `glm5` preset, as the checkpoint writes it: it
    sets indexer_rope_interleave; plus moe_layer_freq and the bf16 dtype GLM-5's config.json carries,
    which the preset does not keep). SGLang builds the model from it on the meta device."""
    dumped = subprocess.run([glmtune_python(), "-c", "import json; from glmtune.models.glm5.args import get_preset; "
                             "print(json.dumps(get_preset('glm5').to_hf_dict()))"],
                            cwd=ROOT, check=True, capture_output=True, text=True).stdout
    config = {**json.loads(dumped), "moe_layer_freq": 1, "torch_dtype": "bfloat16"}
    assert config["indexer_rope_interleave"] is True and config["n_routed_experts"] == 256, config
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


def sglang_command(run: Path, out: Path) -> list[str]:
    """The arguments of the SGLang command `glmtune export RUN --engine sglang` prints."""
    printed = subprocess.run([glmtune_python(), "-m", "glmtune", "export", str(run), "--adapter", str(out),
                              "--engine", "sglang"], cwd=ROOT, check=True, capture_output=True, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout
    [command] = [shlex.split(line) for line in printed.splitlines() if line.strip().startswith(shlex.join(SERVER))]
    return command[len(SERVER):]


def sglang_startup(args: list[str], out: Path) -> dict:
    """tests/engines/sglang_startup.py on `args`, in a process of its own."""
    subprocess.run([sys.executable, str(Path(__file__).parent / "sglang_startup.py"), str(out), "--", *args],
                   cwd=ROOT, check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(out.read_text())


def _on(args: list[str], base: Path) -> list[str]:
    """`args` with --model-path pointing at `base`."""
    at = args.index("--model-path") + 1
    return [*args[:at], str(base), *args[at + 1:]]


def _lora_flags(args: list[str]) -> list[str]:
    """The command's flags from --max-lora-rank on (the paths before them differ per machine)."""
    return args[args.index("--max-lora-rank"):]


def _controls(commands: dict[str, list[str]]) -> dict[str, list[str]]:
    """What glmtune printed before: `--lora-target-modules all`, and no fusion flag when shared experts
    are not adapted (experts_down_only): they must fail, or the harness cannot tell."""
    full, experts_down = commands["full"], commands["experts_down_only"]
    at = full.index("--lora-target-modules") + 1
    return {"full, --lora-target-modules all": [*full[:at], "all", *[a for a in full[at:] if a.startswith("--")]],
            "experts_down_only, shared experts fused": [a for a in experts_down if a != UNFUSED]}


def capture_startup(runs_root: Path) -> dict:
    """SGLang's start-up with the command glmtune prints for each variant SGLang serves, on GLM-5 on an H200
    (tests/engines/sglang_startup.py), the controls, and the names its --lora-target-modules accepts."""
    with tempfile.TemporaryDirectory() as tmp:
        base = glm5_base(Path(tmp) / "glm5")
        commands = {v: _on(sglang_command(runs_root / v, Path(tmp) / f"adapter-{v}"), base) for v in SGLANG_SERVED}
        started = {v: {"lora_flags": _lora_flags(args), **sglang_startup(args, Path(tmp) / f"{v}.json")}
                   for v, args in commands.items()}
        controls = {name: {"lora_flags": _lora_flags(args), **sglang_startup(args, Path(tmp) / "control.json")}
                    for name, args in _controls(commands).items()}
    return {"engine": "sglang", "engine_version": engine_views.version("sglang"),
            "lora_target_modules_choices": engine_views.sglang_target_module_choices(),
            "commands": started, "controls": controls}


if __name__ == "__main__":
    FIXTURES.mkdir(parents=True, exist_ok=True)
    fixtures = capture(Path(sys.argv[1]))
    fixtures[STARTUP_FIXTURE] = capture_startup(Path(sys.argv[1]))
    for name, data in fixtures.items():
        (FIXTURES / name).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(name)
