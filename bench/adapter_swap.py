"""How fast a new adapter version replaces an old one inside the embedded engine's model.

    python -m bench.adapter_swap            # tiny model
    python -m bench.adapter_swap --smol     # embedded SmolLM2-135M (r 16, all 7 projections)

Compares, on the same peft model and the same two adapter versions (random LoRA weights,
alternated): peft's own hot-swap (`peft.utils.hotswap.hotswap_adapter_from_state_dict`), the
engine's in-place tensor copy (`engine.adapter_slots.copy_into_slot`), both with the tensors
read from disk beforehand as the engine does off its model thread, and peft's `load_adapter`
into a new slot (what a swap costs without either). Each swap is checked: the model's logits afterwards must
equal those of a fresh load of the same version. Writes bench/results/adapter_swap-<model>.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.models import bench_model
from bench.report import pyplot, save
from nextstate.engine.adapter_slots import copy_into_slot


def peft_hotswap(model, slot: str, tensors: dict[str, torch.Tensor], config) -> None:
    from peft.utils.hotswap import hotswap_adapter_from_state_dict
    from peft.utils.save_and_load import _insert_adapter_name_into_state_dict

    state = _insert_adapter_name_into_state_dict(dict(tensors), adapter_name=slot, parameter_prefix="lora_")
    with torch.no_grad():
        hotswap_adapter_from_state_dict(model, state, adapter_name=slot, config=config)


def main() -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smol", action="store_true")
    parser.add_argument("--swaps", type=int, default=40)
    args = parser.parse_args()
    torch.set_grad_enabled(False)

    model_dir = bench_model(smol=args.smol)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=16, lora_alpha=32, target_modules=targets, init_lora_weights=False)
    tmp = Path(tempfile.mkdtemp())
    versions = []
    for i in range(2):
        torch.manual_seed(i)
        get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config).save_pretrained(tmp / f"v{i}")
        versions.append(tmp / f"v{i}")
    tensors = [load_file(str(v / "adapter_model.safetensors")) for v in versions]
    probe = torch.tensor([list(range(5, 37))])

    def reference(i: int) -> torch.Tensor:
        fresh = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), versions[i])
        return fresh.eval()(probe).logits

    expected = [reference(0), reference(1)]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), versions[0], adapter_name="slot0000").eval()

    def engine_copy(i: int) -> None:
        if not copy_into_slot(model, "slot0000", tensors[i]):
            raise RuntimeError("the adapter does not fit the slot")

    methods = {"peft_hotswap": lambda i: peft_hotswap(model, "slot0000", tensors[i], config), "engine_copy": engine_copy}
    timings: dict[str, list[float]] = {}
    max_error = {}
    for name, swap in methods.items():
        timings[name], max_error[name] = [], 0.0
        for k in range(args.swaps):
            i = (k + 1) % 2
            started = time.perf_counter()
            swap(i)
            timings[name].append(time.perf_counter() - started)
            if k < 4:  # correctness on the first swaps of each method
                max_error[name] = max(max_error[name], float((model(probe).logits - expected[i]).abs().max()))
        print(f"{name}: median {1000 * statistics.median(timings[name]):.2f} ms, max logit error {max_error[name]:.2e}", flush=True)
    loads = []
    for k in range(min(6, args.swaps)):
        started = time.perf_counter()
        model.load_adapter(versions[k % 2], adapter_name=f"new{k}", is_trainable=False)
        loads.append(time.perf_counter() - started)
        model.delete_adapter(f"new{k}")
    print(f"peft_load_adapter: median {1000 * statistics.median(loads):.1f} ms", flush=True)
    timings["peft_load_adapter"] = loads
    result = {
        "benchmark": "adapter_swap",
        "model": model_dir.name,
        "lora": {"r": 16, "alpha": 32, "target_modules": targets, "tensors": len(tensors[0])},
        "swaps": args.swaps,
        "median_ms": {k: round(1000 * statistics.median(v), 3) for k, v in timings.items()},
        "p90_ms": {k: round(1000 * sorted(v)[int(0.9 * (len(v) - 1))], 3) for k, v in timings.items()},
        "max_logit_error": max_error,
    }
    save(result)


def headline(result: dict) -> str:
    m = result["median_ms"]
    return (f"median swap: peft hotswap {m['peft_hotswap']:.1f} ms, engine's in-place copy {m['engine_copy']:.1f} ms, "
            f"peft load_adapter {m['peft_load_adapter']:.0f} ms ({result['lora']['tensors']} LoRA tensors)")


def plot(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(result["median_ms"])
    ax.barh(names, [result["median_ms"][n] for n in names])
    ax.set_xscale("log")
    ax.set_xlabel("median ms per swap (log scale)")
    ax.set_title(f"Replacing an adapter version in place — {result['model']}")
    return fig


if __name__ == "__main__":
    main()
