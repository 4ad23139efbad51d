#!/usr/bin/env bash
# The tiny demo's user flows on this machine's GPU, each command as the README prints it with
# `--train.device cuda` / `--device cuda`: train, eval, decide (issue 46), the distillation demo's
# steps (issue 48). Each step's output goes to $OUT/NAME.log, its exit status and wall seconds to
# $OUT/flows.tsv, its peak GPU memory (torch's, from the command's own report where it has one).
#
#   OUT=/tmp/out bash benchmarks/gpu_flows.sh            # every step
#   OUT=/tmp/out bash benchmarks/gpu_flows.sh train distill   # the steps whose name contains a word
#
# The GPU image may lack the wheels the CPU venv has (bm25s, pyarrow, jsonschema): installed from
# .devwheels/ first (pip download ... -d .devwheels). Nothing is downloaded from a hub.
set -uo pipefail
OUT=${OUT:?set OUT to a directory}
mkdir -p "$OUT"
if [ -d .devwheels ]; then
    python3 -m pip install -q --no-index --find-links .devwheels jsonschema bm25s pyarrow httpx2 openai >> "$OUT/pip.log" 2>&1
fi
export PYTHONPATH=. HF_HUB_OFFLINE=1
G=${G:-python3 -m glmtune}  # G=echo: print the commands only
RUN=runs/tiny-sft-support-json
STEPS=(
    "train|$G train recipes/tiny/sft_support_json.yaml --train.device cuda --overwrite"
    "eval|$G eval recipes/tiny/eval_support_json.yaml --base $RUN --candidate $RUN --device cuda --overwrite"
    "decide|$G decide recipes/tiny/eval_decide_support_json.yaml --base $RUN --examples $RUN
        --docs recipes/tiny/support_docs --compare $RUN,name=trained --out runs/decide-support-json --device cuda"
    "distill_prompts|$G data synth runs/distill-prompts.jsonl --rows 1000 --seed 0"
    "distill_generate|$G distill generate runs/distill-prompts.jsonl --out runs/distill-teacher --teacher $RUN/hf
        --top-logprobs 8 --max-new-tokens 64 --batch-size 64 --device cuda"
    "distill_train|$G train recipes/tiny/distill_support_json.yaml --train.device cuda --overwrite"
    "distill_eval|$G eval recipes/tiny/eval_distill_support_json.yaml --base runs/tiny-distill-support-json
        --candidate runs/tiny-distill-support-json --compare $RUN/hf,name=teacher --device cuda
        --out runs/tiny-distill-support-json/eval/arms --overwrite"
)
printf "step\texit\tseconds\n" >> "$OUT/flows.tsv"
for entry in "${STEPS[@]}"; do
    name=${entry%%|*}
    command=${entry#*|}
    wanted=$#
    for word in "$@"; do [[ "$name" == *"$word"* ]] && wanted=0; done
    [ "$wanted" -eq 0 ] || continue
    start=$(date +%s.%N)
    # shellcheck disable=SC2086  # the command is split into words on purpose
    $command > "$OUT/$name.log" 2>&1
    status=$?
    printf "%s\t%s\t%.1f\n" "$name" "$status" "$(python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$start" "$(date +%s.%N)")" | tee -a "$OUT/flows.tsv"
done
# what the flows wrote that the notes quote (small files only)
for f in runs/tiny-sft-support-json/eval/*/scorecard.md runs/decide-support-json/decision.md \
         runs/tiny-distill-support-json/eval/arms/scorecard.md runs/distill-teacher/manifest.json; do
    [ -f "$f" ] && cp "$f" "$OUT/$(echo "$f" | tr / _)"
done
