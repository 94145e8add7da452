"""One tensor-parallel rank of test_tp_load.py: on the CPU, in a gloo group of WORLD ranks, build vLLM's own
GLM-5 model and its MTP model (tiny config, vllm-gguf-plugin's quantization config), load fastcomm's weight
stream into them as vLLM's loader does, and save every parameter as this rank holds it (after
process_weights_after_loading), for the test to compare with the file's slice for this rank.

    python tp_load_worker.py RANK WORLD PORT GGUF_FIRST_SHARD CONFIG_DIR OUT_DIR [nodump]

Writes OUT_DIR/rank{RANK}.pt: {model tag: {parameter: record}}, a record being {"data": tensor} plus, for a
GGUF-quantized module, "types" (shard -> GGML type) and "offsets" (shard -> (first row, end row, bytes)) of a
fused weight; and OUT_DIR/rank{RANK}.json: host memory before the model is built, after it is built and after
its weights are loaded, each phase's peak its own where the kernel can reset it (before the dump; with nodump
no dump is written: the load's memory alone), load seconds, and how many modules fastcomm_vllm.standin counts
as all-reducing (its sites).
"""
import json
import os
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations" / "vllm"))


def _memory() -> dict:
    """This process's host memory (kB), from /proc: the peak (VmHWM) and what is private (RssAnon) or mapped
    from files (RssFile; the GGUF pages it touched, shared with every other rank through the page cache)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0])
    return out


def _reset_peak() -> bool:
    """Start VmHWM again from the current RSS (Linux's clear_refs 5), so that each phase's peak is its own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def main(rank: int, world: int, port: str, gguf_path: str, config_dir: str, out: str, dump: bool = True) -> None:
    from vllm.platforms import current_platform

    if not current_platform.device_type:  # a CPU-only vLLM build reports no device type
        type(current_platform).device_type = "cpu"
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.config.speculative import SpeculativeConfig
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm_gguf_plugin.quantization import GGUFConfig

    from fastcomm_vllm import standin
    from fastcomm_vllm.gguf import adapter, files, metadata, plugin, weights

    plugin.register()  # what the fastcomm_gguf entry point does in each vLLM process

    class Stub(nn.Module):  # attention backends and indexer caches hold no weights and need a GPU to build
        def __init__(self, *args, **kwargs):
            super().__init__()

    import vllm.model_executor.layers.mla as mla
    import vllm.model_executor.models.deepseek_v2 as dsv2

    mla.MLAAttention = Stub
    for name in dir(dsv2):
        if name.endswith("IndexerCache"):
            setattr(dsv2, name, Stub)

    found = files.discover(gguf_path)
    meta = metadata.read(found)
    n_main = metadata.main_layers(meta)
    main_mc = ModelConfig(model=config_dir, dtype="bfloat16", max_model_len=1024, skip_tokenizer_init=True)
    draft_mc = ModelConfig(model=config_dir, dtype="bfloat16", max_model_len=1024, skip_tokenizer_init=True,
                           hf_overrides=SpeculativeConfig.hf_config_override)
    saved, seconds, memory, sites = {}, {}, {}, {}
    for tag, mc in (("main", main_mc), ("mtp", draft_mc)):
        part = weights.MTP if tag == "mtp" else weights.MAIN
        qc = GGUFConfig(unquantized_modules=adapter.unquantized_modules(meta, n_main, part))
        vc = VllmConfig(model_config=mc, load_config=LoadConfig(load_format="dummy"),
                        device_config=DeviceConfig("cpu"), quant_config=qc,
                        parallel_config=ParallelConfig(tensor_parallel_size=world))
        if tag == "mtp":
            object.__setattr__(vc, "speculative_config", types.SimpleNamespace(draft_model_config=mc))
        with set_current_vllm_config(vc):
            if tag == "main":
                init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{port}")
                initialize_model_parallel(world)
            cls, _ = get_model_architecture(mc)
            phases = {"before": _memory()}
            reset = _reset_peak()
            with torch.device("cpu"):
                model = cls(vllm_config=vc)
            phases["init"] = _memory()
            reset = _reset_peak() and reset
            start = time.perf_counter()
            model.load_weights(weights.iter_weights(found, torch.bfloat16, part, n_main, (rank, world)))
            for module in model.modules():
                method = getattr(module, "quant_method", None)
                if method is not None and (hasattr(module, "qweight") or hasattr(module, "w13_qweight")):
                    method.process_weights_after_loading(module)  # as vLLM's loader does after loading
            seconds[tag] = time.perf_counter() - start
            phases["load"] = _memory()
            memory[tag] = {**phases, "peak_reset": reset}
            sites[tag] = standin.count_sites(model)
            if dump:
                saved[tag] = _records(model)
            del model
    if dump:
        torch.save(saved, Path(out) / f"rank{rank}.pt")
    stats = {"memory_kb": memory, "load_s": seconds, "standin_sites": sites}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(stats))


def _records(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        rec = {"data": p.data.detach().clone()}
        leaf = name.rpartition(".")[2]
        if leaf.endswith("qweight_type"):
            rec["types"] = {str(k): int(v) for k, v in getattr(p, "shard_weight_type", {}).items()}
            rec["type"] = int(getattr(p, "weight_type", -1))
        if leaf == "qweight" and hasattr(p, "shard_offset_map"):
            rec["offsets"] = {str(k): tuple(int(x) for x in v) for k, v in p.shard_offset_map.items()}
        out[name] = rec
    return out


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6],
         dump=sys.argv[7:] != ["nodump"])
