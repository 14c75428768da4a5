"""The engine protocol's route table: one name per route, shared by the server
(``megarl.engine.http``), the client (``megarl.fleet.client``), the fleet and the weight-sync
transports, so a path is written once. Every route needs the run's credential, except
:data:`HELLO`, where the engine proves it holds the credential before the client sends it."""

from __future__ import annotations

HEALTH = "/health"  # GET  -> {"ok", "version"}: liveness and the weight version only
INFO = "/info"  # GET  -> {"ok", "version", "pid", "tp", "asleep", "lease_s"}
GENERATE = "/generate"  # POST {"prompts", "n", "max_tokens", ...} -> binary frame (wire.encode_generation)
LOGPROBS = "/logprobs"  # POST {"sequences", "temperature"} -> {"version", "logprobs"} (integrity check)
HEARTBEAT = "/heartbeat"  # POST {}: keeps the engine's lease (the fleet sends it every few seconds)
BEGIN = "/weights/begin"  # POST {"version"}: open an update
LOAD = "/weights/load"  # POST {"version", "files", "begin"?, "commit"?}: stage files from the staging folder (shm)
LOAD_BYTES = "/weights/load_bytes"  # POST ?version=V, body: safetensors bytes (http transport)
CHECK = "/weights/check"  # POST {"tensors": [records]}: names/shapes/dtypes before NCCL / IPC data
NCCL_INIT = "/weights/nccl_init"  # POST: join the trainer's NCCL group
NCCL_LOAD = "/weights/nccl_load"  # POST {"version", "tensors", "nbytes"}: receive one bucket by broadcast
IPC_LOAD = "/weights/ipc_load"  # POST {"version", "tensors", "handle"}: one bucket over CUDA IPC
COMMIT = "/weights/commit"  # POST {"version"}: apply everything staged at once, reset the prefix cache
ABORT = "/weights/abort"  # POST {}: drop what is staged
SLEEP = "/sleep"  # POST {"level"}: vLLM sleep mode (colocated, CUDA)
WAKE_UP = "/wake_up"  # POST {"tags"}: weights before a sync, kv_cache after it
SHUTDOWN = "/shutdown"  # POST {}
HELLO = "/hello"  # GET ?nonce=HEX, no credential -> {"port", "proof"} (megarl.engine.credentials.engine_proof)

ROUTES: dict[str, str] = {
    HEALTH: "GET",
    INFO: "GET",
    GENERATE: "POST",
    LOGPROBS: "POST",
    HEARTBEAT: "POST",
    BEGIN: "POST",
    LOAD: "POST",
    LOAD_BYTES: "POST",
    CHECK: "POST",
    NCCL_INIT: "POST",
    NCCL_LOAD: "POST",
    IPC_LOAD: "POST",
    COMMIT: "POST",
    ABORT: "POST",
    SLEEP: "POST",
    WAKE_UP: "POST",
    SHUTDOWN: "POST",
}
"""Every route the engine serves, with its method (the server dispatches on it; tests iterate it)."""
