#!/usr/bin/env bash
# The tiny distillation demo (`make distill`, docs/distill.md "The tiny demo"), run in the current
# directory: recipes/ must be there (the repository root, or a directory with recipes/ linked, as
# tests/distill/test_distill_demo.py runs it); everything is written under runs/ there.
#
#   bash scripts/distill_demo.sh [BIN]     # BIN: the directory of glmtune (default .venv/bin)
#
# The teacher is the SFT demo's model (trained first when runs/ lacks it, as `make demo`'s first line
# does), in process: `transformers serve` returns no log-probabilities, so a served teacher would
# leave the KL term nothing to learn from. It answers 1000 tickets (seed 0, the demo's prompts) with
# its top-8 log-probabilities; a 3-layer, 4-expert student trains on them; one scorecard on 240
# tickets of another seed, base student -> distilled student with the teacher as a --compare arm
# (reported beside them, not gated): the gate, the distilled student above the base student (exit 1
# when it fails), is the script's status.
set -euo pipefail
BIN=${1:-.venv/bin}
export HF_HUB_OFFLINE=1
DEMO_RUN=runs/tiny-sft-support-json
DISTILL_RUN=runs/tiny-distill-support-json
SUITE=recipes/tiny/eval_distill_support_json.yaml

test -f "$DEMO_RUN/hf/config.json" || "$BIN/glmtune" train recipes/tiny/sft_support_json.yaml --overwrite
test -f runs/distill-prompts.jsonl || "$BIN/glmtune" data synth runs/distill-prompts.jsonl --rows 1000 --seed 0
"$BIN/glmtune" distill generate runs/distill-prompts.jsonl --out runs/distill-teacher \
    --teacher "$DEMO_RUN/hf" --top-logprobs 8 --max-new-tokens 64 --batch-size 16
"$BIN/glmtune" train recipes/tiny/distill_support_json.yaml --overwrite
status=0
"$BIN/glmtune" eval "$SUITE" --base "$DISTILL_RUN" --candidate "$DISTILL_RUN" \
    --compare "$DEMO_RUN/hf,name=teacher" --out "$DISTILL_RUN/eval/arms" --overwrite || status=$?
if [ "$status" -le 1 ]; then  # 0 the gate passed, 1 it failed: either way the scorecard is written
    echo "scorecard: $DISTILL_RUN/eval/arms/scorecard.md (base student -> distilled student, the teacher" \
        "compared; also scorecard.html, scorecard.json)"
fi
exit "$status"
