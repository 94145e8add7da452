"""The benchmark's GLM-5-shaped GGUF, from the writer the tests share (fastcomm_vllm.gguf.synth):

    python -m fastcomm_bench.glm5_gguf OUT_DIR --full [--no-mtp] [--shards N]
    python -m fastcomm_bench.glm5_gguf OUT_DIR --tp8-shard [--shards N]   # rank 0 of GLM-5 at TP 8 (~55 GiB)
"""
from fastcomm_vllm.gguf.synth import main

if __name__ == "__main__":
    main()
