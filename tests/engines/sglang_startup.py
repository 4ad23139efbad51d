"""SGLang's own start-up, up to wrapping modules with LoRA, for a `python -m sglang.launch_server` command.

Run in the engines venv, one process per command (SGLang's configuration is process-wide):
`python tests/engines/sglang_startup.py OUT.json -- ARGS...`, ARGS being what follows
`-m sglang.launch_server`. It writes what the server did with the command's LoRA flags:

* the arguments parsed, resolved, checked and published as the launcher and the scheduler do
  (`prepare_server_args`, `ServerArgs.resolve_once`, `check_server_args`, `publish`);
* the model built by SGLang's own loader (`initialize_model_for_startup`: the shared-expert
  fusion decision `resolve_shared_experts_config`, then `GlmMoeDsaForCausalLM`) on the meta
  device, with the model's config from `--model-path`;
* `LoRAManager(...)` as `ModelRunner.init_lora_manager` calls it: it loads the adapter, resolves
  the target modules (`init_lora_shapes`: `all` through `auto_detect_lora_target_modules`, the
  "LoRA targets the DSA indexer" refusal) and checks them, and stops where it would wrap the
  model's modules (`init_lora_modules` allocates pinned, CUDA-side buffers);
* for the MoE layers: their expert slots (`FusedMoE.num_experts`, 256 routed + the fused shared
  expert) against the experts of the LoRA buffers (`LoRAMemoryPool._get_num_experts`), and the
  MoE LoRA runners' admission check (`MoeLoraRunner._admit`).

The host is an H200 (sm90) as SGLang sees it, which CPU-only torch cannot be: the device
capability answers (9, 0), `--device cuda` is what SGLang resolves there, and the two
construction-time decisions GLM-5 takes differently on CUDA are taken as on CUDA: the DSA
indexer's projection fusion (`dsa_indexer._is_cuda`, with its SM count) and the shared-expert
fusion gate (`deepseek_v2._is_cuda` while `resolve_shared_experts_config` runs). SGLang's
package import reaches torchvision through its multimodal configs; the registries here have
only CUDA builds of it for torch 2.13, so a placeholder stands in whose every call raises
(GLM-5's text path never calls it).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import socket
import sys
import traceback
import types
from pathlib import Path
from typing import Any

import torch
import transformers.image_utils  # noqa: F401 (transformers decides torchvision is absent before the placeholder)

H200_CAPABILITY = (9, 0)
H200_SMS = 132


class _Unavailable:
    """A torchvision attribute: reachable at import, refused when used."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> _Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is not installed in the engines venv")


class _TorchvisionPlaceholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):  # noqa: ARG002 (importlib API)
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__getattr__ = _Unavailable(spec.name).__getattr__
        return module

    def exec_module(self, module):
        module.__path__ = []


def _as_on_h200() -> None:
    sys.meta_path.append(_TorchvisionPlaceholder())
    torch.cuda.get_device_capability = lambda device=None: H200_CAPABILITY
    import sglang.srt.layers.attention.dsa.dsa_indexer as dsa_indexer
    import sglang.srt.model_loader.loader as loader
    import sglang.srt.models.deepseek_v2 as deepseek_v2

    dsa_indexer._is_cuda = True  # Indexer.__init__: use_dsa_indexer_fusion = _is_cuda and ...
    dsa_indexer.resolve_num_sms = lambda: H200_SMS
    resolve = loader.resolve_shared_experts_config

    def resolve_on_cuda(*args):  # DeepseekV2ForCausalLM.shared_experts_fusion_disable_reason reads _is_cuda
        deepseek_v2._is_cuda = True
        try:
            return resolve(*args)
        finally:
            deepseek_v2._is_cuda = False

    loader.resolve_shared_experts_config = resolve_on_cuda


def _published(argv: list[str]):
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args([*argv, "--device", "cuda"])
    server_args.resolve_once()
    server_args.check_server_args()
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    with socket.socket() as free:  # the one-process gloo group's rendezvous, on a port nobody holds
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    parallel_state.initialize_model_parallel(backend="gloo")
    return server_args


class _WrapsModulesNext(Exception):
    """LoRAManager got past every check of the adapter and its targets."""


def _lora_manager(model, model_config, load_config, server_args) -> tuple[Any, str | None]:
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.runtime_context import get_lora

    def stop(self):
        raise _WrapsModulesNext(self)

    LoRAManager.init_lora_modules = stop
    lora = get_lora()
    try:
        LoRAManager(base_model=model, base_hf_config=model_config.hf_config,
                    max_loras_per_batch=lora.max_loras_per_batch, load_config=load_config, dtype=model_config.dtype,
                    server_args=server_args, lora_backend=lora.lora_backend, max_lora_rank=lora.max_lora_rank,
                    target_modules=lora.lora_target_modules, lora_paths=lora.lora_paths)
    except _WrapsModulesNext as reached:
        return reached.args[0], None
    except Exception as e:  # noqa: BLE001 (the server's start-up fails with it)
        frames = traceback.extract_tb(e.__traceback__)
        return None, f"{type(e).__name__} in {frames[-1].name}: {e}"
    raise AssertionError("LoRAManager returned without wrapping modules")


def _moe_facts(model) -> dict:
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.lora.mem_pool import LoRAMemoryPool
    from sglang.srt.lora.moe.runner import MoeLoraRunner

    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    try:
        admitted = f"admitted ({MoeLoraRunner._admit(layers[0])})"
    except NotImplementedError as e:
        admitted = f"NotImplementedError: {e}"
    return {"moe_expert_slots": sorted({m.num_experts for m in layers}),
            "lora_buffer_experts": LoRAMemoryPool._get_num_experts(model),
            "shared_experts_fused": model.shared_experts_config.num_fused_shared_experts,
            "moe_lora_runner": admitted}


def startup(argv: list[str]) -> dict:
    _as_on_h200()
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader

    server_args = _published(argv)
    model_config = ModelConfig.from_server_args(server_args)
    load_config = LoadConfig()
    model = get_model_loader(load_config, model_config).initialize_model_for_startup(
        model_config=model_config, device_config=types.SimpleNamespace(device="meta"))
    manager, error = _lora_manager(model, model_config, load_config, server_args)
    return {"started": error is None, "error": error,
            "target_modules": sorted(manager.target_modules) if manager else None,
            "indexer_fused": any(getattr(m, "use_dsa_indexer_fusion", False) for m in model.modules()),
            **_moe_facts(model)}


if __name__ == "__main__":
    out, dash, *args = sys.argv[1:]
    assert dash == "--", sys.argv
    Path(out).write_text(json.dumps(startup(args), indent=1, sort_keys=True) + "\n")
