#!/usr/bin/env bash
# Build a tokload dataset with a Slurm job array: task k of N builds part k/N of the
# chunks of all inputs (`tokload build --part k/N`), then one more job joins the parts
# with `tokload merge` (by manifest: no data is copied, so keep the parts where they are).
# The merged dataset is the same bytes as one `tokload build` of the same inputs.
#
#   jid=$(sbatch --parsable --array=0-15 examples/slurm_build.sh)       # 16 parts
#   sbatch --dependency=afterok:$jid --array=0 \
#       --export=ALL,MERGE=1,PARTS=16 examples/slurm_build.sh         # then the merge
#
# Inputs, output and options come from the environment (sbatch passes it on):
#   INPUTS      files, globs or directories, space-separated (default: data)
#   OUT         the merged dataset (default: corpus); the parts go to $OUT-parts/K
#   TOKENIZER   a tokenizer.json, or "bytes" (default: bytes)
#   PARTS       N, the number of parts (default: the array's task count)
#   PART        k, this task's part (default: SLURM_ARRAY_TASK_ID)
#   WORKERS     processes per task (default: the task's CPUs)
#   BUILD_ARGS  more `tokload build` options, e.g. "--keep-field id --chunk-size 64M"
#   MERGE=1     join the parts instead of building one
# Every task must see the same INPUTS (the parts are slices of one plan), and all of
# them a shared filesystem. Without Slurm, set PART and PARTS by hand:
#   for k in 0 1 2; do PART=$k PARTS=3 bash examples/slurm_build.sh; done
#   MERGE=1 PARTS=3 bash examples/slurm_build.sh
#
#SBATCH --job-name=tokload-build
#SBATCH --cpus-per-task=8
#SBATCH --mem=32G
#SBATCH --time=04:00:00
#SBATCH --output=tokload-build-%A_%a.log
set -euo pipefail

INPUTS=${INPUTS:-data}
OUT=${OUT:-corpus}
TOKENIZER=${TOKENIZER:-bytes}
PARTS=${PARTS:-${SLURM_ARRAY_TASK_COUNT:?set PARTS, the number of parts}}
WORKERS=${WORKERS:-${SLURM_CPUS_PER_TASK:-1}}
PARTS_DIR="$OUT-parts"

if [[ ${MERGE:-0} == 1 ]]; then
    # The parts in order 0..N-1: the merged dataset lists their shards in that order.
    parts=()
    for ((k = 0; k < PARTS; k++)); do parts+=("$PARTS_DIR/$k"); done
    tokload merge "$OUT" "${parts[@]}"
    tokload verify "$OUT"  # every part is there and consistent
    exit 0
fi

PART=${PART:-${SLURM_ARRAY_TASK_ID:?set PART, the part to build, from 0}}
mkdir -p "$PARTS_DIR"
# INPUTS and BUILD_ARGS are split into words on purpose (and INPUTS' globs expanded).
# shellcheck disable=SC2086
tokload build $INPUTS -o "$PARTS_DIR/$PART" --part "$PART/$PARTS" \
    --tokenizer "$TOKENIZER" -j "$WORKERS" --no-progress ${BUILD_ARGS:-}
