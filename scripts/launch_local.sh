#!/bin/bash
# The paper pipeline on one GPU box without Slurm: the steps of scripts/slurm/rcgrpo_1node.sbatch
# (data -> stage 1 -> vLLM server -> RC-GRPO -> evaluation), run directly. GPUs are counted with
# nvidia-smi unless GPUS is set; the recipe's layout decides how many go to the vLLM server.
#
#   CONFIG=rcgrpo_qwen7b MODEL_PATH=/models/Qwen2.5-7B-Instruct scripts/launch_local.sh
#   DRY_RUN=1 scripts/launch_local.sh        # print the commands only
set -euo pipefail
REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
if [[ -z "${GPUS:-}" ]]; then
    GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
fi
if (( GPUS < 1 )); then
    echo "error: no GPU found (set GPUS=N, or use the CPU recipes: make demo)" >&2
    exit 2
fi
export REPO LOCAL=1
export OVERRIDES="layout.gpus_per_node=$GPUS ${OVERRIDES:-}"
exec bash "$REPO/scripts/slurm/rcgrpo_1node.sbatch"
