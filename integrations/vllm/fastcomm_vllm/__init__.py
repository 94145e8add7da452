"""fastcomm for vLLM: a `vllm.general_plugins` plugin, its communicator, the RMSNorm fusion, `fastcomm-serve`.

Nothing happens at import. vLLM calls ``fastcomm_vllm.plugin:register`` in every process it starts; that
points the CUDA platform at ``communicator.FastcommCudaCommunicator`` and ``fusion.FastcommPassManager``
and routes vLLM's fused all-reduce + RMSNorm helper to fastcomm. ``FASTCOMM_VLLM=0`` turns all of it off.
"""
