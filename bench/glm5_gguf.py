"""The benchmark's GLM-5-shaped GGUF, from the writer the tests share (fastcomm_vllm.gguf.synth):

    python -m fastcomm_bench.glm5_gguf OUT_DIR --full [--no-mtp] [--shards N]
"""
from fastcomm_vllm.gguf.synth import main

if __name__ == "__main__":
    main()
