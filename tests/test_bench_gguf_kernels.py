"""bench/gguf_kernels.py's report on the CPU (the timings need a GPU): the policy's form per op, speed-ups, and
the per-step sums weighted by how many layers run each product."""
from fastcomm_bench import gguf_kernels as gk


def test_report_weights_each_product_by_its_layers():
    rows = [{"op": name, "tokens": 1, "weight_MB": 1.0, "plugin_us": 10.0, "default": "staged", "mma_us": 4.5,
             "staged_us": 4.0, "unstaged_us": 5.0, "bf16_cublas_us": 3.0, "rel_diff_vs_plugin": 0.001}
            for name, *_ in gk.LINEARS]
    rows.append({"op": gk.MOE[0], "tokens": 1, "weight_MB_read": 2.0, "plugin_us": 100.0, "default": "grouped",
                 "grouped_us": 90.0, "pairs_us": 80.0, "rel_diff_vs_plugin": 0.01})
    text, steps = gk.report(rows, [1])
    layers = sum(n for *_, n in gk.LINEARS)
    assert steps[1]["plugin_us"] == round((10.0 * layers + 100.0 * gk.MOE[-1]) / 1000, 2)
    assert steps[1]["fastcomm_default_us"] == round((4.0 * layers + 90.0 * gk.MOE[-1]) / 1000, 2)
    assert steps[1]["fastcomm_best_us"] == round((4.0 * layers + 80.0 * gk.MOE[-1]) / 1000, 2)
    assert "| 90.0 (grouped) | 1.11x | grouped 90.0, pairs 80.0 |" in text
    assert "| 4.0 (staged) | 2.50x | mma 4.5, staged 4.0, unstaged 5.0 | 3.0 |" in text
