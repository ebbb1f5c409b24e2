"""A real SGLang server on this machine (tests/real_engines/server_process.py says how it runs).

It runs SGLang's torch-native CPU path: the flags are those that work on a CPU-only machine (see
the issue that added them, and deploy/README.md for the tested version).
"""

from __future__ import annotations

from tests.real_engines.server_process import ServerProcess

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_LORA_RANK = 16


class RealSGLang(ServerProcess):
    name = "SGLang"
    python_variable = "NEXTSTATE_SGLANG_PYTHON"
    distribution = "sglang"

    def command(self) -> list[str]:
        return [
            self.python, "-m", "sglang.launch_server", "--model-path", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native",
            "--sampling-backend", "pytorch", "--disable-overlap-schedule", "--sleep-on-idle",
            "--mem-fraction-static", "0.1", "--max-total-tokens", "8192",
            "--enable-lora", "--lora-backend", "torch_native", "--max-lora-rank", str(MAX_LORA_RANK),
            # no --max-loaded-loras: SGLang would then evict and reload by itself, and a client
            # that leaked one adapter per version would go unseen
            "--lora-target-modules", *LORA_TARGETS, "--max-loras-per-batch", "2",
        ]

    def environment(self) -> dict[str, str]:
        return super().environment() | {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_RETURN_ORIGINAL_LOGPROB": "1",
                                         "NEXTSTATE_SGLANG_CPU": "1"}
