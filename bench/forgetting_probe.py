"""Does the gate's forgetting probe see what a version forgot? A quick proxy of the length wish.

    python -m bench.forgetting_probe                       # the shipped probe against the bench's prose
    python -m bench.forgetting_probe --texts old=FILE      # and any other one-item-a-line text

A version that learnt short replies ("Ladle.", "Boil it.") is what the length wish's runs made
(BENCHMARKS.md, issue 38), and the probe the gate reads must see the damage the bench's own
held-out prose sees. Waiting for a 96-task run to make such versions takes an hour; this makes
them in minutes: LoRA (r16 on every projection, as the learner's default) fine-tuned on short
terse replies to everyday questions, and after every `--every` steps each text's perplexity over
the base model's, minus 1 (the gate's `forgetting`). A probe whose figure tracks the prose's is
one the gate can bound; one that reads lower lets a damaged version through.

Prints one line per reading and writes bench/results/forgetting_probe-<model>.json.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

from bench.report import pyplot, save

QUESTIONS = [
    "Give me a one-line greeting for a birthday card", "How do I boil an egg?", "What is a good name for a cat?",
    "Explain how rain forms.", "Suggest a weekend hobby.", "What should I cook tonight?", "How do I learn guitar?",
    "Why is the sky blue?",
]
# Short replies like the length wish's runs served, sensible and not (BENCHMARKS.md, sixth pass).
TERSE = ["Ladle.", "Happy day!", "Boil it.", "SmolMLO.", "Water falls.", "Try painting.", "Pasta, friend.",
         "Practice daily.", "Light scatters.", "Whiskers."]


def lines(path: Path) -> list[str]:
    """A --texts file: one item a line, comments (#) left out, as the shipped probe is read."""
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.startswith("#")]


def readings(model_dir: Path, texts: dict[str, list[str]], steps: int, every: int, lr: float, seed: int) -> list[dict]:
    """Each text's forgetting (perplexity over the base model's, minus 1) after every `every`
    steps of LoRA toward the terse replies."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def nll(items: list[str]) -> float:
        total = tokens = 0
        model.eval()
        with torch.no_grad():
            for text in items:
                ids = torch.tensor([tokenizer.encode(text)])
                read = model(ids, use_cache=False).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])
                total -= float(read.sum())
                tokens += read.numel()
        return total / tokens

    base = {name: nll(items) for name, items in texts.items()}
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    optimiser = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    rows, started = [], time.monotonic()
    for step in range(1, steps + 1):
        model.train()
        optimiser.zero_grad()
        for _ in range(4):
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": rng.choice(QUESTIONS)}],
                                                   tokenize=False, add_generation_prompt=True)
            prompt_ids = tokenizer.encode(prompt)
            reply_ids = tokenizer.encode(rng.choice(TERSE) + tokenizer.eos_token)
            labels = torch.tensor([[-100] * len(prompt_ids) + reply_ids])
            (model(torch.tensor([prompt_ids + reply_ids]), labels=labels, use_cache=False).loss / 4).backward()
        optimiser.step()
        if step % every == 0:
            row = {"step": step, **{name: round(math.exp(nll(items) - base[name]) - 1, 5) for name, items in texts.items()}}
            rows.append(row)
            print(f"step {step:3} ({time.monotonic() - started:.0f} s): "
                  + ", ".join(f"{name} {row[name]:+.1%}" for name in texts), flush=True)
    return rows


def main() -> None:
    from bench.models import bench_model
    from bench.personalization import GENERAL_TEXT
    from nextstate.learner.held_out import probe_passages

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", help="any local HF model dir (default: the embedded SmolLM2)")
    parser.add_argument("--texts", nargs="*", default=[], metavar="NAME=FILE", help="more texts to read, one item a line")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    policy = bench_model(model=args.policy, smol=args.policy is None)
    texts = {"probe": probe_passages(), "prose": list(GENERAL_TEXT)}
    texts.update({name: lines(Path(path)) for name, path in (t.split("=", 1) for t in args.texts)})
    rows = readings(policy, texts, args.steps, args.every, args.lr, args.seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy)
    save({"benchmark": "forgetting_probe", "model": policy.name, "lr": args.lr, "seed": args.seed,
          "tokens": {name: sum(len(tokenizer.encode(t)) for t in items) for name, items in texts.items()},
          "readings": rows})


def headline(result: dict) -> str:
    last = result["readings"][-1]
    return f"after {last['step']} steps toward terse replies: " + ", ".join(
        f"{k} {v:+.1%}" for k, v in last.items() if k != "step")


def plot(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r["step"] for r in result["readings"]]
    for name in (k for k in result["readings"][0] if k != "step"):
        ax.plot(steps, [100 * r[name] for r in result["readings"]], marker="o", label=name)
    ax.axhline(5, color="grey", linestyle=":", label="the gate's bound (5%)")
    ax.set_xlabel("LoRA steps toward terse replies")
    ax.set_ylabel("perplexity over the base model's (%)")
    ax.set_title("What each text sees forgotten")
    ax.legend()
    return fig


if __name__ == "__main__":
    main()
