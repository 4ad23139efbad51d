#!/usr/bin/env bash
# A venv with vLLM and SGLang installed without their dependencies (no CUDA packages), for the
# opt-in engine test (`make test-engines`, tests/engines/). Only their pure-Python LoRA code runs.
set -euo pipefail
VENV=${1:-/tmp/glmtune-engines}
VLLM=${VLLM_VERSION:-0.34.0}
SGLANG=${SGLANG_VERSION:-0.5.23}
[ -f "$VENV/.installed-$VLLM-$SGLANG" ] && exit 0
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q --no-deps "vllm==$VLLM" "sglang==$SGLANG"
# What `import vllm.lora.lora_model` asks for (the SGLang side only reads its installed sources).
"$VENV/bin/pip" install -q numpy packaging regex pydantic psutil pyzmq urllib3 requests aiohttp \
    "transformers>=5.16.1,<5.23" safetensors pytest pyyaml pillow pybase64 cachetools cbor2 msgspec \
    cloudpickle uvloop py-cpuinfo prometheus_client llguidance xgrammar einops "torch==2.13.0"
touch "$VENV/.installed-$VLLM-$SGLANG"
