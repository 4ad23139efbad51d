#!/usr/bin/env bash
# A venv with vLLM and SGLang installed without their dependencies (no CUDA packages), for the
# opt-in engine test (`make test-engines`, tests/engines/). Only their pure-Python LoRA code runs,
# and SGLang's start-up up to wrapping modules (tests/engines/sglang_startup.py, meta device).
set -euo pipefail
VENV=${1:-/tmp/glmtune-engines}
VLLM=${VLLM_VERSION:-0.34.0}
SGLANG=${SGLANG_VERSION:-0.5.23}
MARK="$VENV/.installed-$VLLM-$SGLANG-startup"
[ -f "$MARK" ] && exit 0
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q --no-deps "vllm==$VLLM" "sglang==$SGLANG"
# What `import vllm.lora.lora_model` asks for, then what importing SGLang's server arguments, model
# loader, GLM-5 model and LoRA manager asks for (orjson onwards). Not torchvision: the registries have
# only CUDA builds of it for torch 2.13; sglang_startup.py puts a placeholder in its place.
"$VENV/bin/pip" install -q numpy packaging regex pydantic psutil pyzmq urllib3 requests aiohttp \
    "transformers>=5.16.1,<5.23" safetensors pytest pyyaml pillow pybase64 cachetools cbor2 msgspec \
    cloudpickle uvloop py-cpuinfo prometheus_client llguidance xgrammar einops \
    orjson starlette ipython dill sentencepiece compressed-tensors loguru gguf openai partial_json_parser \
    "torch==2.13.0"
touch "$MARK"
