"""Where a next state's hindsight hint leads when its shift compounds: echo or the wish.

    python -m bench.hindsight_echo --smol                  # 24 tasks, alpha 1 and 2, both contrasts
    python -m bench.hindsight_echo --smol --tasks 12 --alphas 2

With a benched judge each next state is itself the OPD hint (judge/hindsight.py), and the
learner distils the policy moved by what that hint changes in the base model
(NEXTSTATE_OPD_TARGET=shift) — update after update, so the shift compounds. This samples the
replies such a target leads to without training anything: from

    log π(·|question) + α · (log π(·|question + hint) − log π(·|contrast))

token by token, for each of the length wish's three reactions (bench.personalization's rule
user, turning down nonsense): a miss ("No, that's not how I like it. Answer in one short
sentence ... Please try again: …"), nonsense ("No, that doesn't answer my question. …") and a
thanks. α = 1 is the first update's target from the base model; α = 2 two updates that pull the
same way. The contrast is NEXTSTATE_HINDSIGHT_CONTRAST: `prompt`, the question alone (the shift
as it was), or `placebo`, the same hint with the next state's words shuffled.

Per contrast, α and reaction: the share of replies that fit the wish, the share that **echo** the
reaction (they speak of an answer, a response, a reply, the user, a question or thanks, or begin
"No"/"Yes" — words the everyday questions never call for: the base model's own replies do it
0-4% of the time), their words, and their surprise to the base model (bench/reply_surprise.py's
figure, against its own replies to the question) with the share read as sense (≤ 2 nats/token).

With `--judge-hint` the hint is instead what a judge extracts from a miss or a nonsense reaction,
the wish's sentence (bench.personalization's PreferenceJudge), and the placebo that sentence's
words shuffled: NEXTSTATE_HINT_CONTRAST's two choices, one row per contrast and α.

Writes bench/results/hindsight_echo-<model>.json.
"""

from __future__ import annotations

import argparse
import re
import statistics

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.hint_shift import reply_logprobs
from bench.models import bench_model
from bench.personalization import TASKS, THANKS, Preference, instruction_for, missed, not_an_answer
from bench.reply_surprise import SENSIBLE_SURPRISE, reply_surprise
from bench.report import pyplot, save
from nextstate.core.types import NextState
from nextstate.judge.hindsight import hindsight_hint, hindsight_placebo, scrambled
from nextstate.judge.teacher import enhanced_messages
from nextstate.modelio.chat_template import ChatRenderer

ECHO = re.compile(r"\b(?:answer(?:ed|s)?|response|repl(?:y|ied)|user|question|thanks|thank)\b|^\s*(?:no|yes)\b", re.I)
REACTIONS = {"miss": missed, "nonsense": not_an_answer, "thanks": lambda instruction, task: THANKS}
MAX_HINT_CHARS = 2000


class Sampler:
    """SmolLM2 (or any local chat model) read directly: several prompts advanced together."""

    def __init__(self, path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.renderer = ChatRenderer(self.tokenizer)
        self.stops = set(self.renderer.stop_token_ids)

    def ids(self, messages: list[dict]) -> list[int]:
        return self.renderer.render(messages).ids

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], weights: list[float], max_tokens: int, seed: int) -> str:
        """A reply drawn from Σ weightᵢ · log π(·|promptᵢ), renormalised, at temperature 1."""
        generator = torch.Generator().manual_seed(seed)
        caches: list = [None] * len(prompts)
        inputs = [torch.tensor([p]) for p in prompts]
        out: list[int] = []
        for _ in range(max_tokens):
            mixed = 0
            for j, (x, w) in enumerate(zip(inputs, weights)):
                step = self.model(input_ids=x, past_key_values=caches[j], use_cache=True)
                caches[j] = step.past_key_values
                mixed = mixed + w * torch.log_softmax(step.logits[0, -1].float(), -1)
            token = int(torch.multinomial(torch.softmax(mixed, -1), 1, generator=generator))
            if token in self.stops:
                break
            out.append(token)
            inputs = [torch.tensor([[token]])] * len(prompts)
        return self.tokenizer.decode(out)

    def reading(self, task: str, reply: str) -> list[float]:
        """The base model's log-probability of each token of `reply` as the answer to `task`."""
        prompt = self.ids([{"role": "user", "content": task}])
        reply_ids = self.tokenizer.encode(reply, add_special_tokens=False)
        if not reply_ids:
            return []
        return reply_logprobs(self.model, prompt, reply_ids).gather(-1, torch.tensor(reply_ids)[:, None])[:, 0].tolist()


def prompts_for(sampler: Sampler, task: str, said: str, contrast: str) -> tuple[list[int], list[int], list[int]]:
    """(asked, hinted, contrast) prompts for one reaction, as the judge builds its teacher's."""
    return hint_prompts(sampler, task, *reaction_hint(said), contrast)


def reaction_hint(said: str) -> tuple[str, str]:
    """A next state's hint and its placebo, as judge/hindsight.py builds them."""
    state = NextState(messages=[{"role": "user", "content": said}])
    return hindsight_hint(state, MAX_HINT_CHARS) or "", hindsight_placebo(state, MAX_HINT_CHARS) or ""


def hint_prompts(sampler: Sampler, task: str, hint: str, placebo: str, contrast: str) -> tuple[list[int], list[int], list[int]]:
    """(asked, hinted, contrast) prompts for one hint and its placebo."""
    asked = [{"role": "user", "content": task}]
    against = enhanced_messages(asked, placebo) if contrast == "placebo" else asked
    return sampler.ids(asked), sampler.ids(enhanced_messages(asked, hint)), sampler.ids(against)


def sensible(reply: dict) -> bool:
    return reply["surprise"] is not None and reply["surprise"] <= SENSIBLE_SURPRISE


def figures(replies: list[dict], preference: Preference) -> dict:
    read = [r["surprise"] for r in replies if r["surprise"] is not None]
    return {
        "fit": round(statistics.fmean(preference.fits(r["reply"]) for r in replies), 3),
        "echo": round(statistics.fmean(bool(ECHO.search(r["reply"])) for r in replies), 3),
        "words": round(statistics.fmean(len(r["reply"].split()) for r in replies), 1),
        "surprise": round(statistics.fmean(read), 3) if read else None,
        "sensible": round(statistics.fmean(sensible(r) for r in replies), 3),
        "fit_sensible": round(statistics.fmean(preference.fits(r["reply"]) and sensible(r) for r in replies), 3),
        "replies": len(replies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smol", action="store_true", help="the embedded SmolLM2 (default: the tiny test model)")
    parser.add_argument("--policy", help="any local HF model dir")
    parser.add_argument("--tasks", type=int, default=24, help="the first N of bench.personalization's tasks")
    parser.add_argument("--alphas", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--contrasts", nargs="+", choices=("prompt", "placebo"), default=["prompt", "placebo"])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--judge-hint", action="store_true",
                        help="the hint a judge extracts (the wish's sentence) and its words shuffled, not the next state")
    parser.add_argument("--variant", help="a name for this run: its results get their own file")
    args = parser.parse_args()

    path = bench_model(model=args.policy, smol=args.smol, peaked=True)
    sampler = Sampler(path)
    preference = Preference(instruction_for("short"), "short")
    tasks = TASKS[:args.tasks]
    own = {task: [sampler.reading(task, sampler.sample([sampler.ids([{"role": "user", "content": task}])], [1.0],
                                                       args.max_tokens, seed=100 * i + k)) for k in range(2)]
           for i, task in enumerate(tasks)}

    def replies_of(weights_and_prompts) -> list[dict]:
        out = []
        for i, task in enumerate(tasks):
            prompts, weights = weights_and_prompts(task)
            reply = sampler.sample(prompts, weights, args.max_tokens, seed=i)
            out.append({"task_index": i, "reply": reply, "surprise": reply_surprise(sampler.reading(task, reply), own[task])})
        return out

    base = replies_of(lambda task: ([sampler.ids([{"role": "user", "content": task}])], [1.0]))
    rows = [{"contrast": "none", "alpha": 0.0, "reaction": "base model", **figures(base, preference),
             "examples": [r["reply"][:120] for r in base[:4]]}]
    print(f"base model        {_line(rows[0])}", flush=True)
    # per row: each task's (hint, placebo)
    hints = ({"judge hint": lambda task: (preference.instruction, scrambled(preference.instruction))} if args.judge_hint
             else {reaction: (lambda task, said=said: reaction_hint(said(preference.instruction, task)))
                   for reaction, said in REACTIONS.items()})
    for contrast in args.contrasts:
        for alpha in args.alphas:
            for reaction, hint_of in hints.items():
                replies = replies_of(lambda task: (list(hint_prompts(sampler, task, *hint_of(task), contrast)),
                                                   [1.0, alpha, -alpha]))
                row = {"contrast": contrast, "alpha": alpha, "reaction": reaction, **figures(replies, preference),
                       "examples": [r["reply"][:120] for r in replies[:4]]}
                rows.append(row)
                print(f"{contrast:8} α={alpha:g} {reaction:8} {_line(row)}", flush=True)
    save({"benchmark": "hindsight_echo", "model": path.name, "variant": args.variant, "tasks": len(tasks),
          "hint": "judge" if args.judge_hint else "next state",
          "max_tokens": args.max_tokens, "instruction": preference.instruction, "rows": rows})


def _line(row: dict) -> str:
    return (f"fit {row['fit']:.2f}  echo {row['echo']:.2f}  words {row['words']:5.1f}  "
            f"surprise {row['surprise'] if row['surprise'] is None else format(row['surprise'], '.2f')}  "
            f"sensible {row['sensible']:.2f}  fit and sensible {row['fit_sensible']:.2f}")


def headline(result: dict) -> str:
    def part(contrast: str) -> str:
        rows = [r for r in result["rows"] if r["contrast"] == contrast and r["alpha"] == max(
            x["alpha"] for x in result["rows"] if x["contrast"] == contrast)]
        if not rows:
            return ""
        return (f"{contrast} (α={rows[0]['alpha']:g}): echo " + "/".join(f"{r['echo']:.2f}" for r in rows)
                + ", fit " + "/".join(f"{r['fit']:.2f}" for r in rows))
    base = result["rows"][0]
    return "; ".join(filter(None, [f"base echo {base['echo']:.2f}, fit {base['fit']:.2f}", part("prompt"), part("placebo")])) + (
        f" (miss/nonsense/thanks, {result['tasks']} tasks: replies sampled from the compounded shift)")


def plot(result: dict):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    rows = [r for r in result["rows"] if r["contrast"] != "none"]
    labels = [f"{r['contrast']}\nα={r['alpha']:g} {r['reaction']}" for r in rows]
    for ax, figure in zip(axes, ("echo", "fit")):
        ax.bar(range(len(rows)), [r[figure] for r in rows], color=["C1" if r["contrast"] == "prompt" else "C0" for r in rows])
        ax.axhline(result["rows"][0][figure], color="grey", linestyle="--", label="base model")
        ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
        ax.set_title(f"replies that {'echo the reaction' if figure == 'echo' else 'fit the wish'}")
        ax.set_ylim(0, 1)
    axes[0].legend()
    return fig


if __name__ == "__main__":
    main()
