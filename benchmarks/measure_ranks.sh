#!/usr/bin/env bash
# One rank of each GLM-5 recipe's real job on this machine's one GPU (`glmtune plan --measure`),
# the ranks docs/benchmarks.md and docs/plan.md record: each as one JSON line in $OUT/NAME.json
# (a `glmtune plan --throughput` source) and its progress in $OUT/NAME.err.
#
#   OUT=/tmp/out bash benchmarks/measure_ranks.sh                 # all of them
#   OUT=/tmp/out bash benchmarks/measure_ranks.sh sft_32k_cp8     # those whose name contains the word
#
# Each run is cut at MEASURE_TIMEOUT seconds (default 150), so one slow rank cannot take the
# others' time. The GPU image may lack jsonschema (the data contract's import): wheels in
# .devwheels/ (pip download jsonschema -d .devwheels) are installed from there first.
set -uo pipefail
OUT=${OUT:?set OUT to a directory}
TIMEOUT=${MEASURE_TIMEOUT:-150}
mkdir -p "$OUT"
if [ -d .devwheels ]; then
    python3 -m pip install -q --no-index --find-links .devwheels jsonschema >> "$OUT/pip.log" 2>&1
fi
# name recipe rank
RANKS=(
    "lora_fp8_1node_rank0 recipes/glm5/lora_fp8_1node.yaml 0"
    "lora_4k_rank0 recipes/glm5/lora_4k.yaml 0"
    "sft_4k_rank0 recipes/glm5/sft_4k.yaml 0"
    "sft_4k_rank64 recipes/glm5/sft_4k.yaml 64"
    "sft_4k_rank192 recipes/glm5/sft_4k.yaml 192"
    "sft_32k_cp8_busiest recipes/glm5/sft_32k_cp8.yaml busiest"
)
for entry in "${RANKS[@]}"; do
    read -r name recipe rank <<< "$entry"
    if [ $# -gt 0 ] && [[ "$name" != *"$1"* ]]; then
        continue
    fi
    flags=(--measure --steps 1 --warmup-steps 1 --json)
    [ "$rank" != busiest ] && flags+=(--rank "$rank")
    PYTHONPATH=. HF_HUB_OFFLINE=1 timeout "$TIMEOUT" python3 -m glmtune plan "$recipe" "${flags[@]}" \
        > "$OUT/$name.json" 2> "$OUT/$name.err"
    echo "$name: exit $?" | tee -a "$OUT/$name.err"
done
