#!/usr/bin/env bash
# One trainer task per node (run by srun from common.sh:megarl_run_trainer): a torchrun agent
# with MEGARL_NPROC_PER_NODE ranks. Static rendezvous: node-rank 0 (the first trainer node,
# MASTER_ADDR) hosts the store; SLURM_NODEID is this node's index in the trainer step.
# Arguments: the `megarl train` arguments (--config ..., --set ...).
set -euo pipefail
echo "megarl-slurm: trainer agent node-rank ${SLURM_NODEID} on ${SLURMD_NODENAME:-$(hostname)}: ${MEGARL_NPROC_PER_NODE} rank(s), master ${MASTER_ADDR}:${MASTER_PORT}"
# USR1 is added to torchrun's forwarded signals so the ranks see a time-limit warning;
# the agent then waits up to MEGARL_SHUTDOWN_TIMEOUT_S for them to checkpoint and exit.
exec "$MEGARL_PY" -m torch.distributed.run \
    --nnodes="$MEGARL_NNODES" \
    --node-rank="$SLURM_NODEID" \
    --nproc-per-node="$MEGARL_NPROC_PER_NODE" \
    --master-addr="$MASTER_ADDR" \
    --master-port="$MASTER_PORT" \
    --rdzv-id="$SLURM_JOB_ID" \
    --max-restarts=0 \
    --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    --shutdown-timeout="$MEGARL_SHUTDOWN_TIMEOUT_S" \
    -m megarl.cli train "$@"
