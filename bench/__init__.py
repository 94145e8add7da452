"""fastcomm benchmarks (importable as ``fastcomm_bench``)."""
