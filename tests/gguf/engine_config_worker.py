"""Run by test_vllm_load.py in a subprocess: vLLM's engine configuration (EngineArgs.create_engine_config,
the code path `vllm serve` and `vllm.LLM` take) for fastcomm's GGUF kwargs, target and MTP draft; prints JSON.

    python engine_config_worker.py GGUF_PATH
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integrations" / "vllm"))


def main(model: str) -> None:
    from vllm.platforms import current_platform

    if not current_platform.device_type:  # a CPU-only vLLM build reports no device type
        type(current_platform).device_type = "cpu"
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    from fastcomm_vllm import gguf as fg

    load_general_plugins()
    kwargs = fg.engine_kwargs(model, derive_tokenizer=False)
    shown = json.loads(json.dumps(kwargs))  # vLLM 0.25 adds its config objects to the speculative_config dict
    vc = EngineArgs(**kwargs, skip_tokenizer_init=True, max_model_len=1024, enforce_eager=True).create_engine_config()
    target, draft = vc.model_config, vc.speculative_config.draft_model_config
    print(json.dumps({
        "target": {"model": target.model, "weights": target.model_weights, "model_type": target.hf_config.model_type,
                   "quantization": target.quantization, "layers": target.hf_config.num_hidden_layers},
        "draft": {"method": vc.speculative_config.method, "model": draft.model, "model_type": draft.hf_config.model_type,
                  "architectures": draft.hf_config.architectures, "quantization": draft.quantization,
                  "marker": getattr(draft.hf_config, "fastcomm_gguf_arch", None),
                  "k": vc.speculative_config.num_speculative_tokens},
        "kwargs": shown}))


if __name__ == "__main__":
    main(sys.argv[1])
