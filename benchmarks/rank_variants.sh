#!/usr/bin/env bash
# One rank of a GLM-5 recipe measured under several sets of overrides, one process each, on this
# machine's GPU (`glmtune plan --measure --emulate-links`): what a schedule or compute option changes
# at real size, side by side in one device call (issue 50).
#
#   OUT=/tmp/out RECIPE=recipes/glm5/sft_4k.yaml RANK=192 bash benchmarks/rank_variants.sh \
#       "base:" "chunks2:--parallel.ep_overlap_chunks 2" "compile:--parallel.compile true"
#
# Each VARIANT is NAME:OVERRIDES; $OUT/NAME.json is the report (one JSON line) and $OUT/NAME.err its
# progress; the last lines are every report's figures side by side (`benchmarks/rank_reports.py`).
# RANK may be "busiest" (the plan's busiest rank). Each run is cut at MEASURE_TIMEOUT seconds
# (default 190; 400 with PROFILE: writing sft_4k rank 192's profile took 100 s on an H100).
# PROFILE=1 adds --profile $OUT/profile_NAME (its overhead is in the timed steps), prints
# the heaviest 25 rows of its sources table (the device returns a command's last lines even when it
# returns few files) and removes the Chrome trace, the largest file, unless KEEP_TRACE=1.
# PROFILE_PHASE=emulated profiles the emulated steps instead of the timed ones and prints their
# timeline (rank{R}_timeline.txt: compute beside the links' lanes, whole and per pipeline action).
set -uo pipefail
OUT=${OUT:?set OUT}
RECIPE=${RECIPE:?set RECIPE}
RANK=${RANK:-busiest}
TIMEOUT=${MEASURE_TIMEOUT:-$([ -n "${PROFILE:-}" ] && echo 400 || echo 190)}
mkdir -p "$OUT"
if [ -d .devwheels ]; then
    python3 -m pip install -q --no-index --find-links .devwheels jsonschema >> "$OUT/pip.log" 2>&1
fi
export HF_HUB_OFFLINE=1
for variant in "$@"; do
    name=${variant%%:*}
    read -r -a overrides <<< "${variant#*:}"
    flags=(--measure --steps 1 --warmup-steps 1 --emulate-links --json)
    [ "$RANK" != busiest ] && flags+=(--rank "$RANK")
    [ -n "${PROFILE:-}" ] && flags+=(--profile "$OUT/profile_$name")
    [ -n "${PROFILE:-}" ] && [ -n "${PROFILE_PHASE:-}" ] && flags+=(--profile-phase "$PROFILE_PHASE")
    start=$(date +%s)
    PYTHONPATH=. timeout "$TIMEOUT" python3 -m glmtune plan "$RECIPE" "${flags[@]}" "${overrides[@]}" \
        > "$OUT/$name.json" 2> "$OUT/$name.err"
    echo "$name: exit $? in $(( $(date +%s) - start )) s"
    if [ -n "${PROFILE:-}" ]; then
        head -26 "$OUT/profile_$name"/rank*_sources.txt 2>/dev/null
        cat "$OUT/profile_$name"/rank*_timeline.txt 2>/dev/null
        [ -n "${KEEP_TRACE:-}" ] || rm -f "$OUT/profile_$name"/rank*_trace.json
    fi
done
python3 benchmarks/rank_reports.py "$OUT"
