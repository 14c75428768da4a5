# shellcheck shell=bash
# Shared by the megarl sbatch scripts (sourced, never run): read the MEGARL_* variables,
# check that the allocation fits the config, derive the rendezvous address from the node
# list, launch trainer/engine job steps, forward signals and requeue. slurm/README.md
# documents every variable; every line this prints starts with "megarl-slurm:".
#
# Invariants: nothing is launched before every check has passed (a misfit allocation fails
# in seconds with exit code 2); trainer node-rank 0 runs on MASTER_ADDR; the batch script
# never exits while a step it started is still running, except after `scontrol requeue`.

megarl_log() { echo "megarl-slurm: $*"; }
megarl_die() {
    echo "megarl-slurm: error: $*" >&2
    exit 2
}

# ---------------------------------------------------------------------------- setup

# megarl_init OVERRIDE...: read config + env, fill MEGARL_* globals, export the runtime env.
megarl_init() {
    [[ -n "${SLURM_JOB_ID:-}" ]] || megarl_die "not inside a SLURM allocation (submit with sbatch)"
    MEGARL_PY="${MEGARL_VENV:+$MEGARL_VENV/bin/python}"
    if [[ -z "$MEGARL_PY" ]]; then
        if [[ -x "$MEGARL_ROOT/.venv/bin/python" ]]; then MEGARL_PY="$MEGARL_ROOT/.venv/bin/python"; else MEGARL_PY="$(command -v python3)"; fi
    fi
    [[ -x "$MEGARL_PY" ]] || megarl_die "no Python at '$MEGARL_PY' (set MEGARL_VENV to the venv holding megarl)"
    export MEGARL_PY

    # MEGARL_SET="a.b=1 c.d=x" plus the script's own arguments → --set items (no spaces in values).
    local -a sets=()
    set -f
    # shellcheck disable=SC2206  # word splitting is the documented format
    sets=(${MEGARL_SET:-} "$@")
    set +f
    # MEGARL_TRACKERS="wandb,mlflow" → train.trackers=jsonl,tensorboard,wandb,mlflow (before the sets: they win)
    if [[ -n "${MEGARL_TRACKERS:-}" ]]; then sets=("train.trackers=jsonl,tensorboard,$MEGARL_TRACKERS" "${sets[@]}"); fi
    MEGARL_SETS=("${sets[@]}")
    MEGARL_TRAIN_ARGS=()
    if [[ -n "${MEGARL_CONFIG:-}" ]]; then MEGARL_TRAIN_ARGS+=(--config "$MEGARL_CONFIG"); fi
    local s
    for s in "${MEGARL_SETS[@]}"; do MEGARL_TRAIN_ARGS+=(--set "$s"); done

    # The config decides the trainer world size and where the engines find the model folder.
    local cfg
    cfg="$("$MEGARL_PY" - "${MEGARL_CONFIG:-}" "${MEGARL_SETS[@]}" <<'EOF'
import sys
from pathlib import Path

from megarl.config import ConfigError, load_config

try:
    c = load_config(sys.argv[1] or None, sys.argv[2:])
except ConfigError as e:
    sys.exit(f"megarl-slurm: error: config: {e}")
p, r = c.parallel, c.rollout
print(p.tensor_parallel, p.pipeline_parallel, p.data_parallel, r.engine_tp, r.kv_cache_gb, c.train.seed,
      r.engine_threads, r.max_staleness)
print(Path(c.train.run_dir).resolve())
print(",".join(c.train.trackers))
EOF
)" || megarl_die "could not read the megarl config (MEGARL_CONFIG='${MEGARL_CONFIG:-}', MEGARL_SET='${MEGARL_SET:-}')"
    read -r MEGARL_TP MEGARL_PP MEGARL_DP MEGARL_ENGINE_TP MEGARL_KV_CACHE_GB MEGARL_SEED \
        MEGARL_ENGINE_THREADS MEGARL_MAX_STALENESS <<<"$(sed -n 1p <<<"$cfg")"
    MEGARL_RUN_DIR="$(sed -n 2p <<<"$cfg")"
    MEGARL_TRACKER_LIST="$(sed -n 3p <<<"$cfg")"
    MEGARL_WORLD=$((MEGARL_TP * MEGARL_PP * MEGARL_DP))

    mapfile -t MEGARL_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    [[ ${#MEGARL_NODES[@]} -ge 1 ]] || megarl_die "scontrol show hostnames '$SLURM_JOB_NODELIST' returned no nodes"

    megarl_log "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on ${#MEGARL_NODES[@]} node(s): ${MEGARL_NODES[*]}"
    megarl_log "config ${MEGARL_CONFIG:-<defaults>} sets [${MEGARL_SETS[*]}] → TP=$MEGARL_TP PP=$MEGARL_PP DP=$MEGARL_DP world=$MEGARL_WORLD run_dir=$MEGARL_RUN_DIR"
    megarl_export_env
    megarl_log_trackers
    # From here on the batch shell survives USR1/TERM and hands them to the trainer step.
    MEGARL_GOT_SIGNAL=""
    trap 'megarl_forward USR1' USR1
    trap 'megarl_forward TERM' TERM
}

# Runtime environment for every step; each is only a default (an exported value wins).
megarl_export_env() {
    export PYTHONUNBUFFERED=1          # logs reach slurm-*.out as they happen
    export PYTHONFAULTHANDLER=1        # a hung or crashed rank dumps Python stacks
    export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}" # failed/timed-out collective aborts the rank instead of hanging the job
    export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"                                         # NCCL problems show up in the job output, without INFO noise
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"          # Megatron TP/SP overlap relies on in-order kernel launch
    export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"               # no fork warnings / thread oversubscription
    # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME / NCCL_IB_HCA: unset on purpose (site specific, see README).
}

# megarl_log_trackers: which trackers the run logs to and the tracker variables the steps inherit
# (sbatch and srun pass the environment through: W&B and MLflow read WANDB_* / MLFLOW_* themselves;
# a requeued job keeps them, and megarl continues the same tracker runs from <run_dir>/trackers.json).
# Names only for the secrets (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN / _PASSWORD).
megarl_log_trackers() {
    local v seen=()
    for v in WANDB_MODE WANDB_PROJECT WANDB_ENTITY WANDB_RUN_GROUP WANDB_TAGS WANDB_DIR WANDB_BASE_URL \
        MLFLOW_TRACKING_URI MLFLOW_EXPERIMENT_NAME; do
        if [[ -n "${!v:-}" ]]; then seen+=("$v=${!v}"); fi
    done
    for v in WANDB_API_KEY MLFLOW_TRACKING_TOKEN MLFLOW_TRACKING_PASSWORD; do
        if [[ -n "${!v:-}" ]]; then seen+=("$v=<set>"); fi
    done
    megarl_log "trackers: $MEGARL_TRACKER_LIST${seen:+ (${seen[*]})}"
}

# megarl_make_token: this run's engine credential, a fresh random token in a file only this
# user can read (umask 077), on the shared filesystem so engines on every node read the
# same one. Engines and trainer get its path (never the token: command lines are public).
megarl_make_token() {
    mkdir -p "$MEGARL_RUN_DIR"
    export MEGARL_ENGINE_TOKEN_FILE="$MEGARL_RUN_DIR/engine_token"
    unset MEGARL_ENGINE_TOKEN
    (
        umask 077
        rm -f "$MEGARL_ENGINE_TOKEN_FILE"
        "$MEGARL_PY" -c 'import secrets; print(secrets.token_hex(32))' >"$MEGARL_ENGINE_TOKEN_FILE"
    ) || megarl_die "could not write the engine credential $MEGARL_ENGINE_TOKEN_FILE"
    megarl_log "engine credential: $MEGARL_ENGINE_TOKEN_FILE (mode 0600)"
}

# megarl_set_omp NPROC: one rank's share of the node's CPUs, unless OMP_NUM_THREADS is set.
megarl_set_omp() {
    local cpus="${SLURM_CPUS_ON_NODE:-1}"
    local per=$((cpus / $1))
    ((per >= 1)) || per=1
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$per}"
}

# ---------------------------------------------------------------------------- checks

# megarl_check_trainer NNODES: choose ranks per node and check NNODES × that against the config.
megarl_check_trainer() {
    local nnodes=$1 src
    if [[ -n "${MEGARL_NPROC_PER_NODE:-}" ]]; then
        src="MEGARL_NPROC_PER_NODE"
    elif [[ -n "${SLURM_NTASKS_PER_NODE:-}" ]]; then
        MEGARL_NPROC_PER_NODE="${SLURM_NTASKS_PER_NODE%%(*}" src="--ntasks-per-node"
    elif [[ "${SLURM_GPUS_ON_NODE:-0}" -gt 0 ]]; then
        MEGARL_NPROC_PER_NODE="$SLURM_GPUS_ON_NODE" src="GPUs on the node"
    else
        ((MEGARL_WORLD % nnodes == 0)) ||
            megarl_die "config world size TP×PP×DP=$MEGARL_WORLD cannot be split evenly over $nnodes trainer node(s); set MEGARL_NPROC_PER_NODE or change the node count"
        MEGARL_NPROC_PER_NODE=$((MEGARL_WORLD / nnodes)) src="world/nodes"
    fi
    [[ "$MEGARL_NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]] || megarl_die "ranks per node must be a positive integer, got '$MEGARL_NPROC_PER_NODE' ($src)"
    local world=$((nnodes * MEGARL_NPROC_PER_NODE)) mp=$((MEGARL_TP * MEGARL_PP))
    ((world % mp == 0)) ||
        megarl_die "trainer world size $nnodes node(s) × $MEGARL_NPROC_PER_NODE rank(s) = $world is not divisible by tensor_parallel×pipeline_parallel = $MEGARL_TP×$MEGARL_PP = $mp"
    ((world == MEGARL_WORLD)) ||
        megarl_die "trainer world size $nnodes node(s) × $MEGARL_NPROC_PER_NODE rank(s) = $world but the config wants TP×PP×DP = $MEGARL_WORLD; add parallel.data_parallel=$((world / mp)) to MEGARL_SET or change the allocation"
    megarl_log "trainer: $nnodes node(s) × $MEGARL_NPROC_PER_NODE rank(s) per node ($src) = world $world"
    megarl_set_omp "$MEGARL_NPROC_PER_NODE"
}

# megarl_rendezvous FIRST_TRAINER_NODE: static torchrun rendezvous on the first trainer node,
# and the run's engine credential (made here, after the allocation checks: a misfit job
# leaves nothing behind).
megarl_rendezvous() {
    megarl_make_token
    export MASTER_ADDR="$1"
    # Derived from the job id: stable across requeues, different for jobs sharing a node.
    export MASTER_PORT="${MEGARL_MASTER_PORT:-$((15000 + SLURM_JOB_ID % 15000))}"
    megarl_log "rendezvous MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"
}

# ---------------------------------------------------------------------------- steps

# megarl_start_engines NODES_CSV NNODES PER_NODE TRAINER_RANKS_PER_NODE: one engine server per
# task, ports from MEGARL_ENGINE_PORT upward; sets MEGARL_ENGINE_PID, MEGARL_ENGINE_ADDRS,
# MEGARL_ENGINE_LOGS. TRAINER_RANKS_PER_NODE (0 on fleet-only nodes) sizes CPU engines' threads.
megarl_start_engines() {
    local nodes_csv=$1 nnodes=$2 per=$3
    export MEGARL_ENGINE_TRAINER_RANKS=$4
    export MEGARL_ENGINE_PORT="${MEGARL_ENGINE_PORT:-$((MASTER_PORT + 1))}"
    export MEGARL_ENGINE_WAIT_S="${MEGARL_ENGINE_WAIT_S:-1800}"
    export MEGARL_ENGINE_LEASE_S="${MEGARL_ENGINE_LEASE_S:-600}"
    export MEGARL_RUN_DIR MEGARL_ENGINE_TP MEGARL_KV_CACHE_GB MEGARL_SEED MEGARL_ENGINE_THREADS MEGARL_MAX_STALENESS
    # The trainer rewrites hf_engine/ at start; a stale manifest from an earlier run (or the
    # run before a requeue) must not let engines start before it does.
    rm -f "$MEGARL_RUN_DIR/hf_engine/weights_manifest.json"
    local -a hosts
    IFS=, read -ra hosts <<<"$nodes_csv"
    local j i addrs=()
    for ((j = 0; j < nnodes; j++)); do
        for ((i = 0; i < per; i++)); do addrs+=("${hosts[j]}:$((MEGARL_ENGINE_PORT + j * per + i))"); done
    done
    MEGARL_ENGINE_ADDRS="$(IFS=,; echo "${addrs[*]}")"
    MEGARL_ENGINE_LOGS="$MEGARL_RUN_DIR/logs"
    mkdir -p "$MEGARL_ENGINE_LOGS"
    megarl_log "engines: $per per node on $nodes_csv (engine_tp=$MEGARL_ENGINE_TP) → $MEGARL_ENGINE_ADDRS; logs $MEGARL_ENGINE_LOGS/slurm-engine-<task>.log"
    srun --job-name=megarl-engines --nodes="$nnodes" --nodelist="$nodes_csv" --ntasks="$((nnodes * per))" \
        --ntasks-per-node="$per" --distribution=block --overlap --kill-on-bad-exit=0 \
        --output="$MEGARL_ENGINE_LOGS/slurm-engine-%t.log" --open-mode=append \
        bash "$MEGARL_ROOT/slurm/engine_task.sh" &
    MEGARL_ENGINE_PID=$!
}

# megarl_run_trainer NODES_CSV NNODES: one torchrun agent per node; waits, forwarding signals.
megarl_run_trainer() {
    local nodes_csv=$1 nnodes=$2
    export MEGARL_NNODES="$nnodes" MEGARL_NPROC_PER_NODE
    export MEGARL_SHUTDOWN_TIMEOUT_S="${MEGARL_SHUTDOWN_TIMEOUT_S:-300}"
    local -a args=("${MEGARL_TRAIN_ARGS[@]}")
    if [[ -n "${MEGARL_ENGINE_ADDRS:-}" ]]; then args+=(--set "rollout.engine_addresses=$MEGARL_ENGINE_ADDRS"); fi
    megarl_log "trainer step: srun on $nodes_csv: megarl train ${args[*]}"
    srun --job-name=megarl-trainer --nodes="$nnodes" --nodelist="$nodes_csv" --ntasks="$nnodes" \
        --ntasks-per-node=1 --overlap --label --kill-on-bad-exit=1 \
        bash "$MEGARL_ROOT/slurm/trainer_task.sh" "${args[@]}" &
    MEGARL_TRAINER_PID=$!
    local rc r
    while :; do
        rc=0
        wait "$MEGARL_TRAINER_PID" || rc=$?
        # A trapped signal interrupts wait with rc > 128; keep waiting while srun lives.
        kill -0 "$MEGARL_TRAINER_PID" 2>/dev/null || break
    done
    if ((rc > 128)); then # srun may have ended during the trap: bash kept its real status
        r=0
        wait "$MEGARL_TRAINER_PID" || r=$?
        ((r == 127)) || rc=$r # 127: that status was already collected, rc is real
    fi
    MEGARL_TRAINER_RC=$rc
    megarl_log "trainer step exited with code $MEGARL_TRAINER_RC${MEGARL_GOT_SIGNAL:+ after SIG$MEGARL_GOT_SIGNAL}"
}

# Trap body. Slurm delivers a step signal to every process of the step (torchrun agents,
# ranks and anything rank 0 spawned), so the ranks see it directly; torchrun must survive it
# (--signals-to-handle in trainer_task.sh). `kill srun` would not do: srun aborts the step on
# TERM. A TERM that arrives while the job is no longer RUNNING (scancel, time limit,
# preemption) was already sent to the steps by Slurm: a second one would cut torchrun's wait.
megarl_forward() {
    MEGARL_GOT_SIGNAL=$1
    local state step
    state="$(squeue -h -j "$SLURM_JOB_ID" -o %T 2>/dev/null || true)"
    if [[ "$1" == TERM && -n "$state" && "$state" != RUNNING ]]; then
        megarl_log "caught SIGTERM while the job is $state: Slurm signals the steps itself, not forwarding"
        return 0
    fi
    step="$(squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' 2>/dev/null | awk '$2 == "megarl-trainer" {print $1; exit}' || true)"
    if [[ -z "$step" ]]; then
        megarl_log "caught SIG$1 but no trainer step is running; nothing to forward"
        return 0
    fi
    megarl_log "caught SIG$1, sending it to trainer step $step"
    scancel --signal="$1" "$step" || megarl_log "warning: scancel --signal=$1 $step failed"
}

# megarl_stop_engines: TERM the engine step, SIGKILL it after 30 s.
megarl_stop_engines() {
    [[ -n "${MEGARL_ENGINE_PID:-}" ]] || return 0
    kill -s TERM "$MEGARL_ENGINE_PID" 2>/dev/null || true
    local t
    for ((t = 0; t < 30; t++)); do
        kill -0 "$MEGARL_ENGINE_PID" 2>/dev/null || break
        sleep 1
    done
    kill -s KILL "$MEGARL_ENGINE_PID" 2>/dev/null || true
    wait "$MEGARL_ENGINE_PID" 2>/dev/null || true
    megarl_log "engine step stopped"
}

# megarl_finish: requeue after a USR1 (time limit warning / manual preemption), else exit
# with the trainer's code. The trainer resumes from <run_dir>/checkpoints/latest when
# SLURM_RESTART_COUNT > 0.
megarl_finish() {
    megarl_stop_engines
    if ((MEGARL_TRAINER_RC != 0)) && [[ -n "${MEGARL_ENGINE_LOGS:-}" ]]; then
        local f
        for f in "$MEGARL_ENGINE_LOGS"/slurm-engine-*.log; do
            if [[ -f "$f" ]]; then
                megarl_log "last lines of $f:"
                tail -n 20 "$f"
            fi
        done
    fi
    if [[ "$MEGARL_GOT_SIGNAL" == USR1 && "${MEGARL_REQUEUE_ON_USR1:-1}" == 1 ]]; then
        megarl_log "requeueing job $SLURM_JOB_ID (next SLURM_RESTART_COUNT=$((${SLURM_RESTART_COUNT:-0} + 1)))"
        scontrol requeue "$SLURM_JOB_ID" || megarl_die "scontrol requeue $SLURM_JOB_ID failed (submitted without --requeue?)"
        exit 0
    fi
    exit "$MEGARL_TRAINER_RC"
}

megarl_csv() {
    local IFS=,
    echo "$*"
}
