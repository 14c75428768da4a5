#!/usr/bin/env bash
# One vLLM engine server per task (run by srun from common.sh:megarl_start_engines).
# Port MEGARL_ENGINE_PORT + SLURM_PROCID (block distribution, so the batch script can list
# every address up front). The server imports vLLM, then waits for the trainer to write
# <run_dir>/hf_engine/ (--wait-for-model): the engine starts from config.json +
# weights_manifest.json and gets its weights by sync.
# It binds 0.0.0.0 but answers only requests carrying the run's credential, read from
# MEGARL_ENGINE_TOKEN_FILE (made by common.sh:megarl_make_token), and exits when the trainer
# has sent nothing for MEGARL_ENGINE_LEASE_S seconds (its heartbeat comes every 5 s).
set -euo pipefail
port=$((MEGARL_ENGINE_PORT + SLURM_PROCID))
model="$MEGARL_RUN_DIR/hf_engine"
node="${SLURMD_NODENAME:-$(hostname)}"
# GPUs: engine k on a node gets the k-th group of engine_tp devices (wrapping around, so
# colocated engines share the trainer's GPUs). No GPUs on the node: leave it alone.
if [[ "${SLURM_GPUS_ON_NODE:-0}" -gt 0 ]]; then
    IFS=, read -ra visible <<<"${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((SLURM_GPUS_ON_NODE - 1)))}"
    mine=()
    for ((g = 0; g < MEGARL_ENGINE_TP; g++)); do
        mine+=("${visible[$(((SLURM_LOCALID * MEGARL_ENGINE_TP + g) % ${#visible[@]}))]}")
    done
    CUDA_VISIBLE_DEVICES="$(IFS=,; echo "${mine[*]}")"
    export CUDA_VISIBLE_DEVICES
fi
# CPU engines (no GPUs on the node, engine_tp 1): torch threads by megarl's one rule
# (megarl.fleet.cpu_threads.cpu_engine_threads: rollout.engine_threads, or the node's CPUs shared by
# its engines, less its trainer ranks with pipelined rollouts), when automatic at most the CPUs
# this task may run on. Without this an engine inherits the trainer ranks' OMP_NUM_THREADS
# (common.sh:megarl_set_omp), and vLLM's CPU worker keeps whatever it starts with.
if [[ "${SLURM_GPUS_ON_NODE:-0}" -eq 0 && "$MEGARL_ENGINE_TP" -eq 1 ]]; then
    threads="$("$MEGARL_PY" - "${MEGARL_ENGINE_THREADS:-0}" "${MEGARL_MAX_STALENESS:-0}" "${SLURM_CPUS_ON_NODE:-0}" \
        "${SLURM_NTASKS_PER_NODE:-1}" "${MEGARL_ENGINE_TRAINER_RANKS:-0}" <<'EOF'
import os
import sys

from megarl.fleet.cpu_threads import cpu_engine_threads

threads, staleness, cpus, engines, ranks = map(int, sys.argv[1:])
mine = len(os.sched_getaffinity(0))
print(threads or min(cpu_engine_threads(0, staleness, cpus or mine, engines, ranks), mine))
EOF
)"
    export OMP_NUM_THREADS="$threads"
fi
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" # CPU builds: KV cache GiB (the megarl flag sets the real budget)
echo "megarl-slurm: engine $SLURM_PROCID starting on $node:$port${CUDA_VISIBLE_DEVICES:+ GPUs $CUDA_VISIBLE_DEVICES}${threads:+ with $threads torch threads}; it waits up to ${MEGARL_ENGINE_WAIT_S}s for $model/weights_manifest.json"
# shellcheck disable=SC2086  # MEGARL_ENGINE_ARGS is a documented space-separated list
exec "$MEGARL_PY" -m megarl.engine.server --model "$model" --host 0.0.0.0 --port "$port" \
    --tp "$MEGARL_ENGINE_TP" --kv-cache-gb "$MEGARL_KV_CACHE_GB" --seed "$((MEGARL_SEED + SLURM_PROCID))" \
    --lease-s "$MEGARL_ENGINE_LEASE_S" --wait-for-model "$MEGARL_ENGINE_WAIT_S" ${MEGARL_ENGINE_ARGS:-}
