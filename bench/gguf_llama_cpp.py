"""Does an adapter exported with `--format gguf` do in llama.cpp what it does in nextstate?

    python -m bench.gguf_llama_cpp --llama-python VENV/bin/python --converter LLAMA_CPP/convert_hf_to_gguf.py

llama.cpp is not a dependency of nextstate, and no wheel of its Python binding is on PyPI: build
one into a venv of its own first (`pip install llama-cpp-python`, a source build of ~15 minutes
on two cores; its sdist carries llama.cpp's `convert_hf_to_gguf.py`, the converter this needs,
which runs here and imports `sentencepiece`).

The check: an adapter with the learner's own LoRA config (rank 16 on every projection, random
weights so that it moves the model a lot) is published and exported both ways, as
`nextstate export` does. The base model is converted to a float32 GGUF by llama.cpp's own
converter — which reorders the query and key rows of llama-family models, as the export must
then do to the adapter's. One prompt's logprobs are compared: HF + the PEFT export against
llama.cpp + the GGUF export, beside the base model's own difference between the two runtimes
(their rounding) and the adapter's own effect (what a wrong export would leave unmatched).

Writes bench/results/gguf_llama_cpp-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.models import bench_model
from bench.report import pyplot, save

PROMPT = "Why is the sky blue? Answer briefly."
REPLY_START = "The sky is blue because"

# Runs in the llama.cpp venv (numpy and llama_cpp only): the logits of `ids` with and without the adapter.
LLAMA_SIDE = """
import json, sys
import numpy as np
from llama_cpp import Llama
model, adapter, ids_file, out = sys.argv[1:5]
ids = json.loads(open(ids_file).read())
for name, extra in (("base", {}), ("lora", {"lora_path": adapter})):
    llm = Llama(model_path=model, n_ctx=max(128, len(ids) + 8), logits_all=True, verbose=False, n_threads=2, **extra)
    llm.eval(ids)
    np.save(f"{out}/{name}.npy", np.array(llm.scores[: len(ids)], dtype=np.float32))
"""


def log_softmax(x):
    import numpy as np

    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-python", required=True, help="a Python with llama_cpp (llama-cpp-python) installed")
    parser.add_argument("--converter", required=True, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--policy", help="any local HF model dir of a llama-family model (default: the embedded SmolLM2)")
    args = parser.parse_args()

    import numpy as np
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nextstate.export import build_export, write_export
    from tests.learner_adapters import publish_random_adapter

    policy = bench_model(model=args.policy, smol=args.policy is None)
    with tempfile.TemporaryDirectory(prefix="nextstate-gguf-") as tmp:
        work = Path(tmp)
        # llama.cpp's converter refuses a config that says it came from a GGUF (the embedded
        # default was converted from one): a copy of the folder without that note
        plain = work / "base"
        plain.mkdir()
        for f in policy.iterdir():
            (plain / f.name).symlink_to(f.resolve())
        config = json.loads((policy / "config.json").read_text())
        config.pop("quantization_config", None)
        (plain / "config.json").unlink()
        (plain / "config.json").write_text(json.dumps(config))
        base_gguf = work / "base-f32.gguf"
        print("converting the base model with llama.cpp's converter", flush=True)
        subprocess.run([sys.executable, args.converter, str(plain), "--outtype", "f32", "--outfile", str(base_gguf)],
                       check=True, capture_output=True)

        settings = publish_random_adapter(work / "data", policy, std=0.02)
        peft_dir = write_export(build_export(settings, "alice"), work / "peft")
        gguf_dir = write_export(build_export(settings, "alice", format="gguf"), work / "gguf")
        (adapter,) = gguf_dir.glob("*.gguf")

        tokenizer = AutoTokenizer.from_pretrained(policy)
        text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text + REPLY_START, add_special_tokens=False)
        model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
        with torch.no_grad():
            hf_base = model(input_ids=torch.tensor([ids])).logits[0].numpy()
            hf_lora = PeftModel.from_pretrained(model, str(peft_dir)).eval()(input_ids=torch.tensor([ids])).logits[0].numpy()
        (work / "ids.json").write_text(json.dumps(ids))
        (work / "llama_side.py").write_text(LLAMA_SIDE)
        subprocess.run([args.llama_python, str(work / "llama_side.py"), str(base_gguf), str(adapter), str(work / "ids.json"),
                        str(work)], check=True)
        cpp_base, cpp_lora = np.load(work / "base.npy"), np.load(work / "lora.npy")

    def gap(a, b) -> float:
        return round(float(np.abs(log_softmax(a) - log_softmax(b)).max()), 4)

    result = {
        "benchmark": "gguf_llama_cpp", "model": policy.name, "tokens": len(ids),
        "runtimes_base": gap(cpp_base, hf_base),  # llama.cpp vs transformers, no adapter
        "runtimes_adapter": gap(cpp_lora, hf_lora),  # llama.cpp + GGUF export vs transformers + PEFT export
        "adapter_effect": gap(hf_lora, hf_base),  # what the adapter changes: a wrong export leaves this unmatched
        "argmax_agree": round(float((cpp_lora.argmax(-1) == hf_lora.argmax(-1)).mean()), 3),
    }
    print(headline(result))
    save(result)


def headline(result: dict) -> str:
    control = result.get("without_the_row_reordering")
    return (f"largest logprob difference over {result['tokens']} positions: llama.cpp + the GGUF export against "
            f"transformers + the PEFT export {result['runtimes_adapter']}, the base model alone {result['runtimes_base']}, "
            f"the adapter's own effect {result['adapter_effect']}"
            + (f", the export without its query/key row reordering {control}" if control is not None else "")
            + f"; next-token argmax agrees at {result['argmax_agree']:.0%}")


def plot(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    labels = ["base: llama.cpp vs HF", "adapter: GGUF vs PEFT", "the adapter's effect"]
    ax.bar(labels, [result["runtimes_base"], result["runtimes_adapter"], result["adapter_effect"]])
    ax.set_yscale("log")
    ax.set_ylabel("max |Δ logprob|")
    ax.set_title(f"{result['model']}: the GGUF export in llama.cpp")
    return fig


if __name__ == "__main__":
    main()
