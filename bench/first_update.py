"""What a fresh adapter's first update spends its KL on: Adam's first steps against a warmup.

    python -m bench.first_update --smol --seeds 0 1 2

Read from the saved bench runs at today's defaults (issue 38, twenty-fourth pass), the first
pass of a scope's *first* update moves the policy by a KL of 0.61 (median of 34 runs) where
every later update's first pass moves it by 0.07: the first update stops after one pass (its KL
target reached at once) and the opening word's held-out fit hardly moves (0.17 → 0.21). Adam's
first step is the cause to test: with its moments empty, bias correction makes it lr · sign(g)
for every parameter, however small or noisy that parameter's gradient (Kingma & Ba 2015, §2;
Liu et al. 2020, "On the variance of the adaptive learning rate and beyond", on why warmup is
needed). Later steps divide by a second moment that has seen several gradients, so a noisy
coordinate moves little.

This builds one first update's samples the way a person's ratings build them (8 replies of the
served base model to 8 of bench.personalization's tasks, each rated by the opening-word rule,
+1 or −1 with the wish as the correction, through POST /v1/feedback), then trains that one
update with the learner at every default from a fresh adapter, once per optimizer:

* `adamw` — the learner's as it is (AdamW, lr, betas (0.9, 0.98));
* `warmup K` — the same with NEXTSTATE_LR_WARMUP_STEPS=K: the learning rate rising linearly
  over the scope's first K optimizer steps (lr · t/K);
* `radam` — torch's RAdam with decoupled weight decay, which takes un-adapted momentum steps
  until its second moment is trustworthy (Liu et al. 2020).

For each: the passes taken and the batch's policy KL after each, the KL the update was kept at
(the line search's), and on the 24 held-out questions the log-probability that the reply begins
with the wish's word, before and after — the wish gained per unit of KL spent — and the share
of sampled replies to them that fit the wish (`--samples` each, the same seeds before and after).
`--kind length` rates by the length wish instead (at most 12 words): it has no one word to read,
so only the sampled share says what it gained — the kind the warmup cost on the bench
(docs/benchmark-log.md, "The warmup on the bench").

Writes bench/results/first_update-<model>.json.
"""

from __future__ import annotations

import argparse
import math
import statistics

import httpx
import torch

from bench.hint_shift import reply_logprobs
from bench.models import bench_model, bench_server
from bench.personalization import HELD_OUT_TASKS, KINDS, TASKS, Preference, instruction_for
from bench.report import pyplot, save

WORD = "The"
REPLIES = 8
MAX_TOKENS = 48


def rated_samples(model_dir, seed: int, preference: Preference) -> tuple[list, float]:
    """A first update's samples: the base model's replies to 8 tasks, each rated by the rule."""
    tasks = TASKS[REPLIES * seed: REPLIES * (seed + 1)]
    with bench_server(model_dir, learn=False, judge_calibration=False) as server:
        headers = {"Authorization": f"Bearer {server.key('alice')}"}
        fits = []
        with httpx.Client(timeout=600, headers=headers) as http:
            for i, task in enumerate(tasks):
                answer = http.post(f"{server.base_url}/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": task}], "max_tokens": MAX_TOKENS,
                    "seed": 1000 * seed + i}).json()
                fitted = preference.fits(answer["choices"][0]["message"]["content"])
                fits.append(fitted)
                rating = {"response_id": answer["id"], "rating": 1 if fitted else -1}
                if not fitted:
                    rating["correction"] = preference.instruction
                status = http.post(f"{server.base_url}/feedback", json=rating).json()["status"]
                assert status == "accepted", status
        samples = sorted(server.app.state.services.samples.samples(), key=lambda s: s.id)
    return [s for s in samples if s.status == "ready"], statistics.fmean(fits)


def wish_logprob(trainer, scope: str | None, word_ids: list[int]) -> float:
    """Mean log-probability over the held-out questions that the reply begins with the word,
    read by the base model (`scope` None) or the scope's adapter."""
    renderer = trainer._chat()
    prompts = [renderer.render([{"role": "user", "content": question}]).ids for question in HELD_OUT_TASKS]
    word = torch.tensor(word_ids)[:, None]

    def mean_read() -> float:
        return statistics.fmean(float(reply_logprobs(trainer.model, prompt, word_ids).gather(-1, word).sum())
                                for prompt in prompts)

    if scope is None:
        with trainer.model.disable_adapter():
            return mean_read()
    trainer._activate(scope)
    return mean_read()


def wish_share(trainer, scope: str | None, preference: Preference, n: int) -> float:
    """The share of `n` sampled replies to each held-out question (temperature 1, MAX_TOKENS)
    that fit the wish, from the base model (`scope` None) or the scope's adapter, drawn by the
    gate's sampler (`Readings.sampled`: each reply's random stream seeded by its prompt and
    index), so before and after differ by the weights alone."""
    if n <= 0:
        return float("nan")
    from nextstate.learner.readings import Readings

    renderer = trainer._chat()
    prompts = [renderer.render([{"role": "user", "content": question}]).ids for question in HELD_OUT_TASKS]

    def sample() -> float:
        replies = Readings(trainer).sampled(prompts, MAX_TOKENS, n).ids
        return statistics.fmean(preference.fits(renderer.tokenizer.decode(r, skip_special_tokens=True))
                                for r in replies)

    if scope is None:
        with trainer._base_model():
            return sample()
    trainer._activate(scope)
    return sample()


def one_update(model_dir, samples, optimizer: str, warmup: int, preference: Preference, n: int) -> dict:
    from nextstate.core.settings import Settings
    from nextstate.learner.trainer import BETAS, WEIGHT_DECAY, LoraTrainer

    trainer = LoraTrainer(model_dir, Settings().learner.model_copy(update={"lr_warmup_steps": warmup}))
    scope = "bench"
    name = trainer.ensure_scope(scope)
    if optimizer == "radam":
        trainer._optimizers[scope] = torch.optim.RAdam(trainer._params(name), lr=trainer.lr, weight_decay=WEIGHT_DECAY,
                                                       betas=BETAS, decoupled_weight_decay=True)
    word_ids = trainer._chat().tokenizer.encode(WORD, add_special_tokens=False)
    opening = preference.rule.startswith("marker:")
    before = wish_logprob(trainer, None, word_ids) if opening else float("nan")
    share_before = wish_share(trainer, None, preference, n)
    result = trainer.step(scope, samples)
    after = wish_logprob(trainer, scope, word_ids) if opening else float("nan")
    share_after = wish_share(trainer, scope, preference, n)
    kl = result.policy_kl
    return {"optimizer": optimizer if optimizer != "warmup" else f"warmup {warmup}", "epochs": result.epochs,
            "epoch_kls": result.epoch_kls, "kl_tries": result.kl_tries, "policy_kl": kl, "kept": result.step_scale,
            "skipped": result.skipped, "wish_logprob_before": before, "wish_logprob_after": after,
            "wish_gain": after - before, "gain_per_kl": (after - before) / kl if kl and math.isfinite(kl) else None,
            "share_before": share_before, "share_after": share_after,
            "seconds": round(result.seconds, 1)}


def headline(result: dict) -> str:
    parts = []
    opening = result.get("kind", "opening") == "opening"
    for optimizer in dict.fromkeys(r["optimizer"] for r in result["runs"]):
        rows = [r for r in result["runs"] if r["optimizer"] == optimizer]
        part = (f"{optimizer}: first-pass KL {statistics.fmean(r['epoch_kls'][0] if r['epoch_kls'] else r['policy_kl'] for r in rows):.2f}, "
                f"passes {statistics.fmean(r['epochs'] for r in rows):.1f}, kept at KL {statistics.fmean(r['policy_kl'] for r in rows):.2f}")
        if opening:
            part += f", held-out log P('{result['word']}' first) {statistics.fmean(r['wish_gain'] for r in rows):+.2f}"
        if all(r.get("share_after") is not None and math.isfinite(r["share_after"]) for r in rows):
            part += f", held-out replies fitting {statistics.fmean(r['share_after'] - r['share_before'] for r in rows):+.2f}"
        parts.append(part)
    return "; ".join(parts) + (f" ({result.get('kind', 'opening')} wish; a fresh adapter's first update on "
                               f"{result['replies']} rated replies, means over seeds)")


def plot(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    opening = result.get("kind", "opening") == "opening"
    for i, optimizer in enumerate(dict.fromkeys(r["optimizer"] for r in result["runs"])):
        rows = [r for r in result["runs"] if r["optimizer"] == optimizer]
        gains = [r["wish_gain"] if opening else r["share_after"] - r["share_before"] for r in rows]
        ax.scatter([r["policy_kl"] for r in rows], gains, label=optimizer, color=f"C{i}")
    ax.set_xlabel("the update's policy KL (kept)")
    ax.set_ylabel(f"held-out log P('{result['word']}' first), gain" if opening else "held-out replies fitting, gain")
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.legend(fontsize=7)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", help="any local HF model dir (default: a tiny model)")
    parser.add_argument("--smol", action="store_true", help="the embedded SmolLM2")
    parser.add_argument("--kind", choices=("opening", "length"), default="opening",
                        help=f"the wish the replies are rated by: opening with '{WORD}', or at most 12 words")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--warmup", type=int, nargs="+", default=[4, 8], help="warmup lengths, in optimizer steps")
    parser.add_argument("--radam", action="store_true", help="also torch's RAdam")
    parser.add_argument("--samples", type=int, default=4, help="sampled replies per held-out question (0: none)")
    parser.add_argument("--variant", help="the results file's suffix (default: the kind, none for the opening word)")
    args = parser.parse_args()
    model_dir = bench_model(args.policy, args.smol)
    rule = f"marker:{WORD}" if args.kind == "opening" else KINDS[args.kind]
    preference = Preference(instruction_for(rule), rule)
    runs = []
    for seed in args.seeds:
        samples, fit = rated_samples(model_dir, seed, preference)
        print(f"seed {seed}: {len(samples)} samples, {fit:.2f} of the replies fit", flush=True)
        variants = [("adamw", 0)] + [("warmup", k) for k in args.warmup] + ([("radam", 0)] if args.radam else [])
        for optimizer, warmup in variants:
            row = {"seed": seed, "samples": len(samples), "fit": fit} | one_update(
                model_dir, samples, optimizer, warmup, preference, args.samples)
            runs.append(row)
            print(f"  {row['optimizer']:>9}: passes {row['epochs']} (KL after each {row['epoch_kls']}), kept "
                  f"{row['kept']:.3g} at KL {row['policy_kl']:.3f}; held-out log P('{WORD}' first) "
                  f"{row['wish_logprob_before']:.2f} -> {row['wish_logprob_after']:.2f} "
                  f"({row['wish_gain']:+.2f}, {row['gain_per_kl'] or 0:+.2f} a nat of KL); held-out replies fitting "
                  f"{row['share_before']:.2f} -> {row['share_after']:.2f}; {row['seconds']} s", flush=True)
    name = "SmolLM2-135M-Instruct" if args.smol else model_dir.name
    save({"benchmark": "first_update", "model": name, "variant": args.variant or (None if args.kind == "opening" else args.kind),
          "kind": args.kind, "word": WORD, "replies": REPLIES, "samples_per_question": args.samples, "runs": runs})


if __name__ == "__main__":
    main()
