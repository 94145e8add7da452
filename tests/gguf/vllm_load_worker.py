"""Run in a subprocess by test_vllm_load.py: build vLLM's own GLM-5 model and its MTP model (CPU, tiny config,
vllm-gguf-plugin's quantization config), feed them fastcomm's weight stream, and report as JSON which
stream tensor went into which parameter, which parameters were filled, and the fused projections' data.

    python vllm_load_worker.py GGUF_FIRST_SHARD CONFIG_DIR OUT_JSON [swap]

A subprocess because vLLM's distributed state (a gloo group of one) is process-global.
"""
import json
import os
import sys
import types
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations" / "vllm"))


def main(gguf_path: str, config_dir: str, out: str, swap: bool) -> None:
    from vllm.platforms import current_platform

    if not current_platform.device_type:  # a CPU-only vLLM build reports no device type
        type(current_platform).device_type = "cpu"
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.config.speculative import SpeculativeConfig
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm_gguf_plugin.quantization import GGUFConfig

    from fastcomm_vllm.gguf import adapter, files, kquant_vllm, metadata, plugin, weights

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
    report = {"models": {}}
    stream_names = []
    for tag, mc in (("main", main_mc), ("mtp", draft_mc)):
        part = weights.MTP if tag == "mtp" else weights.MAIN
        qc = GGUFConfig(unquantized_modules=adapter.unquantized_modules(meta, n_main, part))
        vc = VllmConfig(model_config=mc, load_config=LoadConfig(load_format="dummy"),
                        device_config=DeviceConfig("cpu"), quant_config=qc)
        if tag == "mtp":
            object.__setattr__(vc, "speculative_config", types.SimpleNamespace(draft_model_config=mc))
        with set_current_vllm_config(vc):
            if tag == "main":
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method="tcp://127.0.0.1:" + os.environ["PORT"])
                initialize_model_parallel(1)
            cls, arch = get_model_architecture(mc)
            with torch.device("cpu"):
                model = cls(vllm_config=vc)
            params = dict(model.named_parameters())
            fed: dict[str, list[str]] = {}
            current = {"name": None}
            for pname, p in params.items():
                loader = getattr(p, "weight_loader", default_weight_loader)

                def record(*args, _loader=loader, _pname=pname, **kwargs):
                    fed.setdefault(current["name"], []).append(_pname)
                    return _loader(*args, **kwargs)

                p.weight_loader = record

            def stream():
                for n, t in weights.iter_weights(found, torch.bfloat16, part, n_main):
                    if swap:  # the negative control: layer 0's fused q_a / kv_a shards change places
                        n = _swap(n)
                    current["name"] = n
                    stream_names.append((tag, n))
                    yield n, t

            loaded = model.load_weights(stream())
            fused, kq_plans, kq_forms = {}, {}, {}
            for mname, module in model.named_modules():
                method = getattr(module, "quant_method", None)
                if method is not None and (hasattr(module, "qweight") or hasattr(module, "w13_qweight")):
                    method.process_weights_after_loading(module)  # as vLLM's loader does after loading
                    plan = kquant_vllm.layer_plan(module, "absent")
                    kq_plans[mname] = plan if plan in (None, "absent") else True if plan.segments is None else [
                        [s.type, s.start, s.rows] for s in plan.segments]
                    if plan not in (None, "absent"):
                        kq_forms[mname] = list(plan.forms)
                if mname.endswith(("fused_qkv_a_proj", "gate_up_proj")) and hasattr(module, "qweight"):
                    q = module.qweight
                    fused[mname] = {"shard_id": [str(s) for s in q.shard_id],
                                    "offsets": {str(k): list(v) for k, v in getattr(q, "shard_offset_map", {}).items()},
                                    "sum_rows": q.data.to(torch.float64).sum(dim=1).tolist()}
            dense = {n: [float(p.data.double().sum()), float(p.data.double().square().sum())]
                     for n, p in model.named_parameters() if p.dtype in (torch.bfloat16, torch.float32)}
            report["models"][tag] = {"arch": arch, "params": sorted(params), "loaded": sorted(loaded),
                                     "fed": fed, "fused": fused, "dense": dense, "kq_plans": kq_plans,
                                     "kq_forms": kq_forms,
                                     "qtypes": {m: int(getattr(mod.qweight_type, "weight_type", -1))
                                                for m, mod in model.named_modules() if hasattr(mod, "qweight_type")}}
    report["stream"] = stream_names
    report["forms_served"] = kquant_vllm.forms_served()
    Path(out).write_text(json.dumps(report))


def _swap(n: str) -> str:
    a, b = "model.layers.0.self_attn.q_a_proj.", "model.layers.0.self_attn.kv_a_proj_with_mqa."
    if n.startswith(a):
        return b + n[len(a):]
    if n.startswith(b):
        return a + n[len(b):]
    return n


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], len(sys.argv) > 4 and sys.argv[4] == "swap")
