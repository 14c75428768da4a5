"""The generation engine: one vLLM ``LLM`` behind a small authenticated HTTP protocol.

``server`` (entry point, ``python -m megarl.engine.server``), ``vllm_engine`` (generation,
sleep/wake), ``updates`` (staged weight updates of every transport, commit), ``staging``
(update manifest and per-tensor checks), ``http`` (handler, body limits, lifeline),
``connections`` (the listening server: unproven connection slots and their deadline),
``routes`` (the one route table), ``credentials`` (the run's token, private staging
folders), ``worker_ext`` (code inside vLLM's workers), ``wire`` (tensor records for NCCL /
CUDA IPC). The trainer's side is :mod:`megarl.fleet.client`.
"""
