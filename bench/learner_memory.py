"""What one learner update costs on real model shapes: peak memory and seconds.

    python -m bench.learner_memory                       # on a GPU: Qwen3-4B and -8B shapes, 4k/16k/32k
    python -m bench.learner_memory --shapes tiny --lengths 256 512   # a check of the script on a CPU
    python -m bench.learner_memory --smol --lengths 8192 --batch 2    # the embedded SmolLM2 on a CPU
    python -m bench.learner_memory --lengths 4096 --batch 4 --replay-coef 0 20  # what replay adds

The models are built from Qwen3-4B- and Qwen3-8B-shaped configs with random weights (nothing is
downloaded: memory and speed do not depend on what the weights are), in the learner's own
dtype (bfloat16 on a GPU), and trained by the real `LoraTrainer` — LoRA r16 on every
projection, gradient checkpointing, the LM head over response tokens in chunks — on one batch
of `--batch` samples of each length (a quarter of it response, the rest prompt, as in agent
turns), packed into forward passes of up to `--micro-batch-tokens` (the default setting's).
Peak memory is torch.cuda.max_memory_allocated over the update (on a CPU: the process's peak
resident set, VmHWM, reset before the update). Writes bench/results/learner_memory[-<gpu>].json
and a PNG; the numbers go into deploy/README.md's memory table. `--smol` (or `--model DIR`)
trains a real local model instead; on a CPU the figure that matters is what the update adds to
the resident set (`added_gib`: the peak over what the loaded learner held after one short
pass — a server has served requests before it trains, so the process's one-time allocations,
`warmup_gib`, are made by then), one micro-batch's worth. `measured_pass_gib` is what the
learner's own memory budget measured (learner/memory_budget.py). `--replay-coef` runs each
length once per weight of NEXTSTATE_REPLAY_COEF: replay's full-vocabulary passes over everyday
prose happen outside the passes the memory budget plans, so what they add is measured here.
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import tempfile
import time
from pathlib import Path

import torch

from bench.report import pyplot, save
from nextstate.core.memory import process_status_bytes
from nextstate.core.settings import LearnerSettings
from nextstate.core.types import Sample
from nextstate.learner.trainer import LoraTrainer

# Shapes from the published configs (hidden, layers, heads, KV heads, MLP, vocab, head dim).
SHAPES = {
    "Qwen3-4B": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=9728, vocab_size=151936, head_dim=128),
    "Qwen3-8B": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=12288, vocab_size=151936, head_dim=128),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, head_dim=16),
}


def build(shape: str, out: Path, dtype: torch.dtype, device: str) -> Path:
    """A random-weight Qwen3 model directory of the named shape (tokenizer not needed), its
    weights drawn on `device` (an 8B model's 8 billion draws take minutes on a CPU)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPES[shape], max_position_embeddings=40960, tie_word_embeddings=False,
                         torch_dtype=str(dtype).removeprefix("torch."))
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.save_pretrained(out)
    del model
    gc.collect()
    return out


def samples(length: int, batch: int, vocab: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(batch):
        response = max(1, length // 4)
        ids = [rng.randrange(10, vocab) for _ in range(length)]
        out.append(Sample(
            id=i + 1, user="bench", session_id="bench", turn_index=1, policy_version=0, adapter=None, mode="binary",
            status="ready", prompt_ids=ids[:-response], response_ids=ids[-response:],
            old_logprobs=[-float(rng.uniform(0.5, 8)) for _ in range(response)], logprob_temperature=1.0,
            advantages=[rng.choice((-1.0, 1.0))] * response, loss_mask=[1] * response, reward=1.0, created_at=0.0,
        ))
    return out


def peak_bytes(device: str) -> int:
    """The peak since `reset_peak`: the CUDA allocator's, or the process's resident high-water
    mark (VmHWM) on the CPU."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return _status_bytes("VmHWM")


def current_bytes(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else _status_bytes("VmRSS")


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return
    try:  # "5" resets the process's VmHWM to its current resident set (Linux)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _status_bytes(field: str) -> int:
    found = process_status_bytes(field)
    return found if found is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(shape: str, lengths: list[int], batch: int, device: str, micro_batch_tokens: int,
            model_dir: Path | None = None, replay_coefs: tuple[float, ...] | None = None) -> list[dict]:
    settings = LearnerSettings(lr=1e-5, max_train_tokens=max(lengths) + 16, max_kl=1e9, micro_batch_tokens=micro_batch_tokens)
    replay_coefs = replay_coefs if replay_coefs is not None else (settings.replay_coef,)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model_dir = model_dir or build(shape, Path(tmp) / shape, dtype, device)
        trainer = LoraTrainer(model_dir, settings, device=device)
        trainer.ensure_scope("shared")
        if shape in SHAPES:  # a random-weight model has no tokenizer: replay reads random ids of the prose's length
            rng = random.Random(1)
            trainer.replay.passages = [[rng.randrange(10, SHAPES[shape]["vocab_size"]) for _ in range(90)] for _ in range(33)]
        loaded = current_bytes(device)
        reset_peak(device)
        # A server has run its model before the learner's first step (it served the requests
        # the samples came from): the process's one-time allocations (thread pools, kernel
        # caches) are made by then. A short pass makes them here; they are reported apart.
        with torch.no_grad():
            trainer._logprobs_many(samples(512, 1, trainer._base.config.vocab_size, 0))
        if device == "cuda":
            torch.cuda.synchronize()
        base = current_bytes(device)
        warmup_gib = round((peak_bytes(device) - loaded) / 2**30, 2)
        reset_peak(device)
        for length, replay_coef in [(n, c) for n in lengths for c in replay_coefs]:
            trainer.settings = settings.model_copy(update={"replay_coef": replay_coef})
            started = time.perf_counter()
            try:
                vocab = SHAPES[shape]["vocab_size"] if shape in SHAPES else trainer._base.config.vocab_size
                result = trainer.step("shared", samples(length, batch, vocab, length))
                error = result.skipped
            except torch.OutOfMemoryError as exc:
                error = f"out of memory: {str(exc)[:120]}"
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            rows.append({"shape": shape, "tokens_per_sample": length, "batch": batch, "replay_coef": replay_coef,
                         "seconds": round(seconds, 2),
                         "peak_gib": round(peak_bytes(device) / 2**30, 2), "weights_gib": round(base / 2**30, 2),
                         "added_gib": round((peak_bytes(device) - base) / 2**30, 2), "warmup_gib": warmup_gib,
                         "measured_pass_gib": round(result.peak_added_mb / 1024, 2) if not error else None,
                         "pass_tokens": result.pass_tokens if not error else None, "error": error})
            print(f"{shape}: {length} tokens x {batch}, replay {replay_coef:g}: {rows[-1]['peak_gib']} GiB peak (+{rows[-1]['added_gib']} GiB "
                  f"over the loaded, warmed-up learner; warm-up +{warmup_gib} GiB; the learner measured its largest "
                  f"pass at +{rows[-1]['measured_pass_gib']} GiB), {seconds:.1f} s"
                  + (f" ({error})" if error else ""), flush=True)
            reset_peak(device)
        del trainer
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def plot(result: dict):
    plt = pyplot()
    figure, (mem, speed) = plt.subplots(1, 2, figsize=(11, 4))
    # One line per shape, batch and replay weight: a file may gather runs of several.
    def line(r: dict) -> tuple:
        return r["shape"], r["batch"], r.get("replay_coef", 0.0)

    for shape, batch, replay in dict.fromkeys(map(line, result["rows"])):
        rows = [r for r in result["rows"] if line(r) == (shape, batch, replay) and not r["error"]]
        label = f"{shape}, batch {batch}" + (f", replay {replay:g}" if replay else "")
        mem.plot([r["tokens_per_sample"] for r in rows], [r["peak_gib"] for r in rows], marker="o", label=label)
        speed.plot([r["tokens_per_sample"] for r in rows], [r["seconds"] for r in rows], marker="o", label=label)
    mem.set(xlabel="tokens per sample", ylabel="peak memory (GiB)", title="one update")
    speed.set(xlabel="tokens per sample", ylabel="seconds per update", title=result["device"])
    for axis in (mem, speed):
        axis.legend()
    return figure


def headline(result: dict) -> str:
    return "; ".join(
        f"{r['shape']} {r['tokens_per_sample']} tok x{r['batch']}"
        + (f", replay {r['replay_coef']:g}: " if r.get("replay_coef") else ": ")
        + (f"+{r['added_gib']} GiB over the learner ({r['peak_gib']} GiB peak), {r['seconds']} s" if not r["error"]
           else r["error"][:40])
        for r in result["rows"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["Qwen3-4B", "Qwen3-8B"], choices=list(SHAPES))
    parser.add_argument("--smol", action="store_true", help="train the embedded SmolLM2-135M (its real weights)")
    parser.add_argument("--model", type=Path, help="train this local model directory instead of random shapes")
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384, 32768])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--replay-coef", nargs="+", type=float, default=[LearnerSettings().replay_coef],
                        help="NEXTSTATE_REPLAY_COEF: each length is trained once per weight given (default: the learner's)")
    parser.add_argument("--micro-batch-tokens", type=int, default=LearnerSettings().micro_batch_tokens,
                        help="NEXTSTATE_MICRO_BATCH_TOKENS: padded tokens per forward pass (samples packed up to it)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    if args.smol:  # imported here: the shapes' run on a GPU machine needs no server or its packages
        from bench.models import bench_model
    model = args.model or (bench_model(smol=True) if args.smol else None)
    shapes = [model.name] if model is not None else args.shapes
    for shape in shapes:
        rows += measure(shape, args.lengths, args.batch, device, args.micro_batch_tokens, model, tuple(args.replay_coef))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    save({"benchmark": "learner_memory", "variant": None if device == "cuda" else "-".join(shapes), "device": name,
          "batch": args.batch, "micro_batch_tokens": args.micro_batch_tokens, "rows": rows})


if __name__ == "__main__":
    main()
