"""Inputs for the K-quant kernel tests (host twin and GPU): quantized weights with a real file's scales, and
activations that int8 chunk quantization represents exactly."""
import numpy as np


def weights(qtype: str, shape: tuple, seed: int):
    """(stored bytes [..., row_bytes], float64 truth of ``shape``)."""
    import gguf

    from fastcomm_vllm.gguf.synth import make_tensor

    q = gguf.GGMLQuantizationType[qtype]
    stored, _ = make_tensor(np.random.default_rng(seed), q, shape)
    truth = gguf.quants.dequantize(stored, q).astype(np.float64).reshape(shape)
    return np.ascontiguousarray(stored, dtype=np.uint8), truth


def exact_activations(rng, n: int, cols: int) -> np.ndarray:
    """Each 32-value chunk a power-of-two scale times integers whose largest magnitude is exactly 127."""
    k = rng.integers(-127, 128, size=(n, cols // 32, 32))
    k[..., 0] = 127 * rng.choice([-1, 1], size=(n, cols // 32))
    scale = (2.0 ** rng.integers(-8, -2, size=(n, cols // 32, 1))).astype(np.float64)
    return (k * scale).reshape(n, cols).astype(np.float32)
