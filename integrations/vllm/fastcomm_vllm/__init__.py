"""fastcomm for vLLM: a `vllm.general_plugins` plugin, its communicator, the RMSNorm fusion, `fastcomm-serve`.

Nothing happens at import. vLLM calls ``fastcomm_vllm.plugin:register`` in every process it starts; that
points the CUDA platform at ``communicator.FastcommCudaCommunicator``; with FASTCOMM_VLLM_FUSION=1 also at
``compile_pass.FastcommPassManager``, and it routes vLLM's fused all-reduce + RMSNorm helper to fastcomm
(``helper_route``). Both fusion routes call one op, ``fused_op``. ``FASTCOMM_VLLM=0`` turns all of it off.
"""
