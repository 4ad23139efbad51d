#!/usr/bin/env bash
# The link emulator on one GPU (issue 50): the CUDA lanes' own check, the tiny recipe's measured
# losses with the stand-in copies on lanes (HEAD) against the control commit's (copies inline),
# and real GLM-5 ranks measured with --emulate-links. Code of two commits unpacked beside each
# other (git archive), so both run in one call:
#
#   OUT=/tmp/out HEAD_DIR=bench_head CTL_DIR=bench_ctl bash benchmarks/emulated_links.sh [RANK_NAME...]
#
# RANK_NAME: sft_4k_rank192, lora_fp8_1node_rank0, sft_32k_cp8_busiest (default: sft_4k_rank192).
# SKIP_TINY=1 leaves out the lanes' check and the tiny runs; PROFILE=1 adds --profile per rank.
set -uo pipefail
OUT=${OUT:?set OUT}
HEAD_DIR=${HEAD_DIR:?}
CTL_DIR=${CTL_DIR:?}
TIMEOUT=${MEASURE_TIMEOUT:-240}
mkdir -p "$OUT"
if [ -d .devwheels ]; then
    python3 -m pip install -q --no-index --find-links .devwheels jsonschema >> "$OUT/pip.log" 2>&1
fi
export HF_HUB_OFFLINE=1
if [ -z "${SKIP_TINY:-}" ]; then
PYTHONPATH=$HEAD_DIR python3 "$HEAD_DIR/benchmarks/cuda_link_lanes.py" > "$OUT/lanes.json" 2> "$OUT/lanes.err"
echo "lanes: exit $?"
tiny=(recipes/tiny/sft_support_json.yaml --measure --gpus 8 --rank 0 --steps 2 --warmup-steps 1 --json --train.micro_batch_size 1
      --train.generate_samples 0)
for which in HEAD CTL; do
    dir=$HEAD_DIR; [ "$which" = CTL ] && dir=$CTL_DIR
    (cd "$dir" && PYTHONPATH=. python3 -m glmtune plan "${tiny[@]}") > "$OUT/tiny_$which.json" 2> "$OUT/tiny_$which.err"
    echo "tiny $which: exit $?"
done
(cd "$HEAD_DIR" && PYTHONPATH=. python3 -m glmtune plan "${tiny[@]}" --emulate-links) > "$OUT/tiny_emulated.json" \
    2> "$OUT/tiny_emulated.err"
echo "tiny emulated: exit $?"
fi
declare -A RANKS=(
    [sft_4k_rank192]="recipes/glm5/sft_4k.yaml --rank 192"
    [lora_fp8_1node_rank0]="recipes/glm5/lora_fp8_1node.yaml --rank 0"
    [sft_32k_cp8_busiest]="recipes/glm5/sft_32k_cp8.yaml"
)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(sft_4k_rank192)
for name in "${names[@]}"; do
    read -r -a args <<< "${RANKS[$name]}"
    extra=()  # PROFILE=1: the timed steps under torch.profiler (its overhead is in their time)
    [ -n "${PROFILE:-}" ] && extra=(--profile "$OUT/profile_$name")
    (cd "$HEAD_DIR" && PYTHONPATH=. timeout "$TIMEOUT" python3 -m glmtune plan "${args[@]}" --measure --steps 1 \
        --warmup-steps 1 --emulate-links --json "${extra[@]}") > "$OUT/$name.json" 2> "$OUT/$name.err"
    echo "$name: exit $?"
done
