# shellcheck shell=bash
# Shared by the sbatch scripts and scripts/launch_local.sh: settings from the environment, the
# pipeline steps (data -> stage 1 -> vLLM server -> stage 2 -> evaluation) and DRY_RUN rendering.
#
# Every setting is an environment variable with a default; export it before `sbatch` (sbatch passes
# the environment on) or put it on the command line: CONFIG=rcgrpo_qwen7b sbatch ...
#
#   CONFIG          stage-2 recipe (conf/NAME.yaml); its rl.stage1_recipe is the stage-1 recipe
#   REPO            repository root inside the job (default: the submit directory)
#   IMAGE           container image for pyxis/enroot (a .sqsh file or registry#image); empty: no container
#   MOUNTS          pyxis --container-mounts (default: the repository and RUN_ROOT at the same paths)
#   RUN_ROOT        where runs, checkpoints, logs and evaluation results go (shared file system)
#   DATA_DIR        prepared data (created on first use)
#   MODEL_PATH      base model weights for stage 1 (Llama-3.1-8B-Instruct / Qwen2.5-7B-Instruct folder;
#                   default: the recipe's, e.g. $RCGRPO_LLAMA8B_PATH); stage 2 starts from stage 1's export
#   GEN_PORT        port of the first vLLM engine on a node (the next ones: GEN_PORT+1, ...)
#   OVERRIDES       extra Hydra overrides for both stages (space separated)
#   LOCAL=1         no Slurm: run the steps directly on this machine (scripts/launch_local.sh)
#   DRY_RUN=1       print the commands instead of running them (what the tests check)

set -euo pipefail

REPO=${REPO:-${SLURM_SUBMIT_DIR:-$(pwd)}}
CONFIG=${CONFIG:-rcgrpo_llama8b}
RUN_ROOT=${RUN_ROOT:-$REPO/runs}
DATA_DIR=${DATA_DIR:-$RUN_ROOT/data/bfcl_v4}
LOG_DIR=${LOG_DIR:-$RUN_ROOT/logs}
IMAGE=${IMAGE:-}
MOUNTS=${MOUNTS:-$REPO:$REPO,$RUN_ROOT:$RUN_ROOT}
MODEL_PATH=${MODEL_PATH:-}
GEN_PORT=${GEN_PORT:-8000}
MASTER_PORT=${MASTER_PORT:-29500}
OVERRIDES=${OVERRIDES:-}
DRY_RUN=${DRY_RUN:-0}
LOCAL=${LOCAL:-0}
PYTHON=${PYTHON:-python}

# run CMD...: execute, or print it (shell-quoted) under DRY_RUN=1
run() {
    if [[ "$DRY_RUN" == 1 ]]; then
        printf '+'
        printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}

# run_bg CMD...: like run, in the background (BG_PID is its pid; empty under DRY_RUN)
run_bg() {
    BG_PID=
    if [[ "$DRY_RUN" == 1 ]]; then
        printf '+'
        printf ' %q' "$@"
        printf ' &\n'
    else
        "$@" &
        # shellcheck disable=SC2034  # BG_PID is read by the caller
        BG_PID=$!
    fi
}

# One task on this node: srun (with the container) in a job, nothing with LOCAL=1.
one_task() {
    if [[ "$LOCAL" != 1 ]]; then
        printf '%s\n' srun --overlap --ntasks=1
        container_args
    fi
}

# The container flags of srun (pyxis), empty without IMAGE.
container_args() {
    if [[ -n "$IMAGE" ]]; then
        printf '%s\n' "--container-image=$IMAGE" "--container-mounts=$MOUNTS" "--container-workdir=$REPO"
    fi
}

# Hostnames of the allocation, one per line.
job_hosts() {
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
        scontrol show hostnames "$SLURM_JOB_NODELIST"
    else
        hostname
    fi
}

# Reads the recipe's layout (validated) into RCGRPO_* variables; extra args are overrides.
load_layout() {
    local out
    out=$(cd "$REPO" && "$PYTHON" -m nemo_rcgrpo.cli layout --config-name "$CONFIG" "$@") || {
        echo "error: the layout of $CONFIG does not validate (see above)" >&2
        exit 2
    }
    eval "$out"
}

# Hydra overrides shared by both stages.
common_overrides() {
    local o=("data.dir=$DATA_DIR")
    # shellcheck disable=SC2206  # OVERRIDES is a space-separated list on purpose
    o+=($OVERRIDES)
    printf '%s\n' "${o[@]}"
}

# Stage 1's model override (the base weights), if MODEL_PATH is set.
stage1_model() {
    if [[ -n "$MODEL_PATH" ]]; then
        printf '%s\n' "model.path=$MODEL_PATH"
    fi
}

# Requeue-safe: Slurm sends USR1 before the time limit (sbatch --signal=B:USR1@300); the job asks to
# be requeued and every step resumes from its newest checkpoint on the next start.
install_requeue_trap() {
    trap 'echo "time limit near: requeueing $SLURM_JOB_ID"; scontrol requeue "$SLURM_JOB_ID"' USR1
}

# Stops the job, in one line, when the layout gives generation no engine (stage 2 runs on vLLM engines of
# their own GPUs: layout.generation_gpus, a multiple of generation.vllm.tp).
require_engines() {
    if (( ${RCGRPO_GENERATION_ENGINES:-0} < 1 )); then
        echo "error: the layout of $CONFIG gives generation no GPU (layout.generation_gpus=$RCGRPO_GENERATION_GPUS," \
            "generation=$RCGRPO_GENERATION_BACKEND): the launchers run stage 2 with vLLM engines on GPUs of their own" >&2
        exit 2
    fi
}

# The generation engines' addresses as generation.vllm.url takes them: every engine of every host given
# (RCGRPO_ENGINES_PER_NODE each, on ports GEN_PORT, GEN_PORT+1, ...); one address alone, several as [a,b,...].
engine_urls() {
    local urls=() host i
    for host in "$@"; do
        for ((i = 0; i < RCGRPO_ENGINES_PER_NODE; i++)); do
            urls+=("http://$host:$((GEN_PORT + i))")
        done
    done
    if (( ${#urls[@]} == 1 )); then
        echo "${urls[0]}"
    else
        (IFS=,; echo "[${urls[*]}]")
    fi
}

# Polls the server's /health until it answers (or gives up after $2 seconds).
wait_for_server() {
    local url=$1 timeout=${2:-1800} waited=0
    if [[ "$DRY_RUN" == 1 ]]; then
        echo "+ wait_for_server $url"
        return 0
    fi
    until "$PYTHON" -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1] + '/health', timeout=5)" "$url" 2>/dev/null; do
        sleep 10
        waited=$((waited + 10))
        if (( waited >= timeout )); then
            echo "error: the vLLM server at $url did not become healthy in ${timeout}s (see $LOG_DIR)" >&2
            exit 3
        fi
    done
}
