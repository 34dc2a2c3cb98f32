#!/usr/bin/env bash
# Every number and figure that README.md, docs/ and the two demo model cards quote about the bundled demos,
# from an empty folder, in one command (issue 16):
#
#   bash benchmarks/demo_numbers.sh OUT            # an hour or more on the shared 2-core CPU machine (README.md)
#   bash benchmarks/demo_numbers.sh OUT --quick    # a few questions per step: checks that every step runs
#       (--quick on Dec 4: 351 s wall (CPU 167 s, load 4.4-6.9) on the shared 2-core CPU machine)
#
# The default `prune-audit run` is timed first, then README's quick-start block (as written in README.md,
# in OUT/quick-start), each alone with its default threads; everything else runs with --threads 1 in two
# parallel lanes (one per core). Every timed step logs wall time, CPU time (user + system) and the load
# average. OUT/summary.txt collects the numbers; the model cards' tables are OUT/table-demo/table.md and
# OUT/table-demo-qwen/table.md, the cost tables of docs/compute.md and README.md OUT/compute-table.md and
# OUT/compute-table-readme.md; every PNG that README.md and docs/ embed is under OUT/figures with the
# same file name (copy them over docs/ and docs/images/ to refresh the figures; tests/test_readme.py checks
# that each embedded PNG is named here).
set -euo pipefail

OUT=${1:?usage: bash benchmarks/demo_numbers.sh OUT [--quick]}
QUICK=${2:-}
if [ -e "$OUT" ]; then
    echo "error: $OUT exists; pass a folder that does not exist yet" >&2
    exit 2
fi
if [ -n "$QUICK" ] && [ "$QUICK" != "--quick" ]; then
    echo "error: the second argument can only be --quick, got $QUICK" >&2
    exit 2
fi
mkdir -p "$OUT/runs" "$OUT/figures"
OUT=$(cd "$OUT" && pwd)  # absolute: the quick start runs in its own folder
README="$(cd "$(dirname "$0")/.." && pwd)/README.md"
LIMIT=() PER_SPLIT=150 EVAL_SET=() STUDY_SIZE=() COMPUTE_LIMIT=90
if [ -n "$QUICK" ]; then
    LIMIT=(--limit 60) PER_SPLIT=10 EVAL_SET=(--scenes 20 --pope-images 10) COMPUTE_LIMIT=60
    STUDY_SIZE=(--limit 60 --bootstrap 50 --splits 20 --epsilons 0.2,0.5)  # 10 images: no smaller target
fi
# the cost tables (docs/compute.md: every selector the LLaVA demo runs, at 64 tokens; README.md: these runs)
COMPUTE_SELECTORS=cls_attn,coverage,dart,divprune,e2s,fastv,hiprune,pdrop,pool,random,scope,sparsevlm,sparsevlm2,tome
COMPUTE_SELECTORS+=,uniform,v2drop,visionzip,vispruner,vscan
README_COST_RUNS=dense,cls_attn@64,divprune@64,fastv@64,hiprune@64,pdrop@64,sparsevlm@64,visionzip@64,vscan@64
CACHE=${PRUNE_AUDIT_CACHE:-$HOME/.cache/prune-audit}
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
timed() {  # timed NAME COMMAND...: wall and CPU seconds of the command into summary.txt
    local name=$1; shift
    /usr/bin/time -f "%e %U %S" -o "$OUT/time-$name.txt" "$@"
    read -r wall user system < "$OUT/time-$name.txt"
    log "$name: wall ${wall} s, CPU $(python -c "print(round($user + $system, 1))") s (load: $(cut -d' ' -f1-3 /proc/loadavg))"
}

log "prune-audit $(python -c 'import prune_audit; print(prune_audit.__version__)') at $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
log "demo question cache at the start: $(ls -d "$CACHE"/demo-questions-* > /dev/null 2>&1 && echo present || echo absent)"

# first, with no other step of this script running: the default run (README: "Run the audit"), default threads
timed run-default prune-audit run --out "$OUT/runs/demo-dense" --quiet "${LIMIT[@]}"

# README's quick-start block as written (--quick: at --limit 60 and question 1), one shell, in its own folder
mkdir "$OUT/quick-start"
QUICK_START=$(awk '/^## Quick start/ {section = 1} section && /^```bash/ {block = 1; next} block && /^```/ {exit}
                   block && NF' "$README")
if [ -n "$QUICK" ]; then
    QUICK_START=$(sed -e 's/900/60/g' -e 's/--question-id [0-9]*/--question-id 1/' <<< "$QUICK_START")
fi
printf '%s\n' "$QUICK_START" > "$OUT/quick-start/commands.sh"
timed quick-start bash -c 'cd "$1" && bash -euo pipefail commands.sh > output.txt 2>&1' quick-start "$OUT/quick-start"
cp "$OUT"/quick-start/calibration-limit*/retention.png "$OUT/figures/calibrate-retention-demo.png"

llava_lane() {  # the study (first: the longest step, and it makes a README figure), the LLaVA demo's runs and table
    # the default study grid (docs/benchmarks.md's table and findings, README's study figure)
    timed study prune-audit study --threads 1 --out "$OUT/study" --quiet "${STUDY_SIZE[@]}"
    cp "$OUT/study/calibration_vs_budget.png" "$OUT/figures/study_demo_calibration_vs_budget.png"
    log "study: study/report.md"
    prune-audit run --selector e2s --budget 64 --out "$OUT/runs/demo-e2s-64" --threads 1 --quiet "${LIMIT[@]}" \
        > "$OUT/run-demo-e2s-64.txt"
    log "run --selector e2s --budget 64: see run-demo-e2s-64.txt"
    # the model card's table: every selector the model can run x budgets, first PER_SPLIT questions per split
    python -m benchmarks.demo_pruning --model demo --budgets 16,32,64 --per-split "$PER_SPLIT" --threads 1 \
        --out "$OUT/table-demo" > /dev/null 2> "$OUT/table-demo.log"
    log "model card table: table-demo/table.md"
}

other_lane() {  # README figures (first: seconds), accuracy, object removal, the Qwen demo's runs and table
    # README figures: kept tokens of several selectors on one scene (VisionZip's merged cells too)
    IMAGE=$(ls "$CACHE"/demo-questions-*/images/scenes2026_000000000002.png | head -n 1)
    prune-audit visualize "$IMAGE" --budget 64 --threads 1 --selector none --selector cls_attn --selector divprune \
        --selector fastv --selector pdrop --selector e2s --selector tome --selector pool \
        --out "$OUT/figures/visualize-demo.png" > /dev/null
    prune-audit visualize "$IMAGE" --model demo-qwen --budget 16 --threads 1 --selector none --selector divprune \
        --selector fastv --selector e2s --out "$OUT/figures/visualize-demo-qwen.png" > /dev/null
    prune-audit visualize "$IMAGE" --budget 16 --threads 1 --selector none --selector visionzip --selector cls_attn \
        --out "$OUT/figures/visualize-demo-merged.png" > /dev/null
    # a clip's frame strip (docs/usage.md, Video clips): VidCom2 at 36 of the video demo's 144 clip tokens
    prune-audit run --task video_presence --selector vidcom2 --budget 36 --threads 1 --quiet \
        --out "$OUT/runs/clips" > /dev/null
    prune-audit visualize --run "$OUT/runs/clips" --question-id 10 --out "$OUT/figures/visualize_clip_demo.png" > /dev/null
    log "figures: figures/"
    # the cost tables: FLOPs, KV bytes and latency parts next to accuracy and ECE (docs/compute.md, README.md)
    timed study-compute prune-audit study --selectors "$COMPUTE_SELECTORS" --budgets 64 --limit "$COMPUTE_LIMIT" \
        --threads 1 --epsilons 0.2 --out "$OUT/study-compute" --quiet > /dev/null
    python -m benchmarks.compute_table "$OUT/study-compute/summary.csv" > "$OUT/compute-table.md"
    python -m benchmarks.compute_table "$OUT/study-compute/summary.csv" --compact --runs "$README_COST_RUNS" \
        > "$OUT/compute-table-readme.md"
    log "cost tables: compute-table.md (docs/compute.md), compute-table-readme.md (README.md)"
    # unpruned accuracy on the 9,000 demo questions (LLaVA: also with the two instructions it was trained with)
    for model in demo demo-qwen; do
        prune-audit demo evaluate --model "$model" --threads 1 "${EVAL_SET[@]}" > "$OUT/evaluate-$model.json"
        log "demo evaluate --model $model: $(cat "$OUT/evaluate-$model.json")"
    done
    for instruction in "Answer yes or no." "Answer the question using a single word or phrase."; do
        result=$(prune-audit demo evaluate --threads 1 "${EVAL_SET[@]}" --instruction "$instruction")
        log "demo evaluate --instruction '$instruction': $result"
    done
    # does the LLaVA demo look at the object? (drop the object's tokens vs as many random tokens)
    python benchmarks/demo_object_removal.py ${QUICK:+--max-pairs 30} > "$OUT/object-removal.txt"
    log "object removal: $(tail -n 1 "$OUT/object-removal.txt")"
    prune-audit run --model demo-qwen --out "$OUT/runs/demo-qwen-dense" --threads 1 --quiet "${LIMIT[@]}" \
        > "$OUT/run-demo-qwen-dense.txt"
    prune-audit run --model demo-qwen --selector e2s --budget 16 --out "$OUT/runs/demo-qwen-e2s-16" --threads 1 \
        --quiet "${LIMIT[@]}" > "$OUT/run-demo-qwen-e2s-16.txt"
    log "run --model demo-qwen (dense, e2s@16): see run-demo-qwen-*.txt"
    python -m benchmarks.demo_pruning --model demo-qwen --budgets 8,16,24 --per-split "$PER_SPLIT" --threads 1 \
        --out "$OUT/table-demo-qwen" > /dev/null 2> "$OUT/table-demo-qwen.log"
    log "model card table: table-demo-qwen/table.md"
}

# then two lanes of one thread each, one per core
llava_lane & lane=$!
other_lane
wait "$lane"
# CPU time of every command this script waited for: bash's `times` (run here, not in a subshell, which would
# count only its own children), second line: children's user and system time
times > "$OUT/times.txt"
cpu=$(tail -n 1 "$OUT/times.txt" | awk '{split($1, u, "m"); split($2, s, "m"); printf "%.0f", u[1] * 60 + u[2] + s[1] * 60 + s[2]}')
log "done: wall ${SECONDS} s, CPU ${cpu} s (load: $(cut -d' ' -f1-3 /proc/loadavg))"
