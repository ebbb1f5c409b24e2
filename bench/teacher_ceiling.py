"""What the policy does when it is told: the ceiling of what its own hinted teacher can teach.

    python -m bench.teacher_ceiling --smol            # every preference kind of bench.personalization
    python -m bench.teacher_ceiling --smol --samples 2 --kinds opening case

The OPD teacher is the base model reading the person's hint (judge/teacher.py): whatever it can
teach, it must first do itself when told. For each preference kind of `bench.personalization`
this samples `--samples` replies to each of its 24 tasks from the base model, as its bench does
(48 tokens, temperature 1), once as the user asked and once with the kind's instruction appended
to the message as the teacher reads a hint, and scores them with the kind's own rule. A kind the
hinted model rarely does is one that distillation towards the hinted model itself
(NEXTSTATE_OPD_TARGET=teacher) cannot teach; the default target, the hint's shift, is limited
by the shift's direction instead (below).

Beside each share, the share of replies that fit *and* read as sense (`sensible`: no more than
2 nats a token stranger to the base model than its own replies to the untold task,
bench/reply_surprise.py), and their mean surprise: what the teacher can show of the wish met
with an answer. Not a hard ceiling: the binary reward can take a wish further (the opening word
was learnt to 0.9 sensible where its teacher shows 0.44, BENCHMARKS.md).

Beside the shares, the direction of the hint (bench/hint_shift.py): at the positions of the asked
replies where the kind's choice is live, how far the hint moves the log-odds of the tokens that
fit the wish. The default distillation target applies that shift to the policy again at every
update, so a direction held consistently compounds past what the hinted model writes.

`--guidance 2 3` adds a placement per scale: replies sampled from the base model with the hint's
log-ratio multiplied by that scale, log π(·|plain) + scale · (log π(·|hint) − log π(·|against)),
at every step: what the first update's distillation target (NEXTSTATE_OPD_TARGET=shift, a policy
still at the base) would write with NEXTSTATE_OPD_SHIFT_SCALE at that scale. `--contrast prompt`
(the default) measures the hint against the plain prompt, as a correction's is (classifier-free
guidance; scale 1 is the hinted model itself); `--contrast placebo` against the hint's words
shuffled (judge/hindsight.py's placebo, as a next state's is), so that what merely copying the
hint's words adds cancels, and scale 1 is already its own placement.

`--hint reaction` gives the teacher the rule user's whole reaction ("No, that's not how I like it.
<the wish> Please try again: <task>") instead of the wish's sentence.

Writes bench/results/teacher_ceiling-<model>.json.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from bench.hint_shift import reply_shift, spill_of, summary, token_class
from bench.models import bench_model, bench_server
from bench.personalization import (
    KINDS, TASKS, Preference, sampled_replies, instruction_for, missed, reference_readings,
)
from bench.reply_surprise import SENSIBLE_SURPRISE, of_reply, reading, surprise
from bench.report import pyplot, save
from nextstate.engine.kv_cache import cache_argument
from nextstate.judge.hindsight import scrambled
from nextstate.judge.teacher import enhanced_messages


def with_experience(instruction: str, accepted: list[tuple[str, str]]) -> str:
    """The hint an experience-augmented teacher reads (OpenClaw-RL's OEL track): the wish, then
    replies the person accepted to other questions, so the teacher sees what "short" or "begins
    with" meant to them, not only the words of the wish."""
    shown = "\n".join(f"Q: {task}\nA: {reply}" for task, reply in accepted)
    return f"{instruction}\n\nReplies they accepted before:\n{shown}" if accepted else instruction


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smol", action="store_true", help="the embedded SmolLM2 (default: the tiny test model)")
    parser.add_argument("--policy", help="any local HF model dir")
    parser.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=list(KINDS))
    parser.add_argument("--marker", default="The", help="the opening word (bench.personalization's marker:auto picks 'The' on SmolLM2)")
    parser.add_argument("--samples", type=int, default=4, help="replies per task and placement")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--experience", type=int, default=0,
                        help="also tell the teacher K replies the person accepted to other tasks (the asked replies "
                             "that fit and read as sense): the OEL track's experience-augmented teacher")
    parser.add_argument("--variant", help="a name for this run: its results get their own file (e.g. a subset of --kinds)")
    parser.add_argument("--guidance", type=float, nargs="*", default=[],
                        help="scales of the hint's shift to sample from as well (NEXTSTATE_OPD_SHIFT_SCALE)")
    parser.add_argument("--contrast", choices=("prompt", "placebo"), default="prompt",
                        help="what --guidance measures the hint's shift against: the plain prompt, or the hint's "
                             "words shuffled (NEXTSTATE_HINDSIGHT_CONTRAST's placebo)")
    parser.add_argument("--hint", choices=("instruction", "reaction"), default="instruction",
                        help="the hint the teacher reads: the wish's sentence, or the rule user's whole reaction to a "
                             "reply that missed it ('No, that's not how I like it. <wish> Please try again: <task>')")
    args = parser.parse_args()

    policy = bench_model(model=args.policy, smol=args.smol, peaked=True)
    rows = []
    reader = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()  # the base model's full distributions
    with bench_server(policy, "policy", learn=False, judge_enabled=False) as server:
        turns = server.app.state.services.turns
        tokenizer = turns.renderer.tokenizer
        vocab = [tokenizer.decode([i]) for i in range(len(tokenizer))]
        reference = reference_readings(server, args.max_tokens, 1.0)
        placebo = args.contrast == "placebo"
        guided = {f"guided{scale:g}{'-placebo' if placebo else ''}": scale for scale in args.guidance}  # name -> scale
        for kind in args.kinds:
            rule = f"marker:{args.marker}" if KINDS[kind] == "marker:auto" else KINDS[kind]
            preference = Preference(instruction_for(rule), rule)
            row = {"kind": kind, "rule": rule, "instruction": preference.instruction, "hint": args.hint,
                   "contrast": args.contrast}
            accepted: list[tuple[int, str, str]] = []  # (task index, task, reply) the person would have taken
            hint_for = functools.partial(hint_of, preference.instruction, args.hint)
            placements = ("asked", "hinted") + (("experienced",) if args.experience else ()) + tuple(guided)
            for placement in placements:
                examples, replies = [], []
                for i, task in enumerate(TASKS):
                    messages = [{"role": "user", "content": task}]
                    seeds = [7 * i + k for k in range(args.samples)]
                    if placement in guided:
                        texts = shifted_replies(reader, turns.renderer, messages, hint_for(task), placebo,
                                                guided[placement], seeds, args.max_tokens)
                    else:
                        if placement == "hinted":
                            messages = enhanced_messages(messages, hint_for(task))
                        elif placement == "experienced":
                            nearest = sorted((e for e in accepted if e[0] != i), key=lambda e: (i - e[0]) % len(TASKS))
                            others = [(t, r) for _, t, r in nearest[:args.experience]]  # the tasks just before
                            messages = enhanced_messages(messages, with_experience(hint_for(task), others))
                        texts = server.call(sampled_replies(turns, None, messages, seeds, args.max_tokens, 1.0),
                                            timeout=600)
                    replies += [{"task_index": i, "first_reply": t, "score": float(preference.fits(t))} for t in texts]
                    examples.append(texts[0][:160])
                row[placement] = round(statistics.fmean(r["score"] for r in replies), 3)
                asked = [(TASKS[r["task_index"]], r["first_reply"]) for r in replies]
                reads = [(task, reading(server, task, reply)) for task, reply in asked]  # read once, used twice
                read = surprise(reads, reference, [r["score"] for r in replies])
                row[f"{placement}_sensible"], row[f"{placement}_surprise"] = read["score_sensible"], read["surprise"]
                row[f"{placement}_examples"] = examples[:4]
                if placement == "asked":
                    cls = token_class(kind, vocab, list(turns.renderer.stop_token_ids), args.marker)
                    row["shift"] = hint_direction(reader, turns.renderer, cls, hint_for, replies)
                    spill = spill_of(cls) if cls is not None else None
                    row["spill"] = hint_direction(reader, turns.renderer, spill, hint_for, replies)
                    if placebo:  # the same direction, measured against the placebo
                        row["shift_placebo"] = hint_direction(reader, turns.renderer, cls, hint_for, replies, True)
                    accepted = [(r["task_index"], task, reply) for r, (task, reply), (_, base) in zip(replies, asked, reads)
                                if r["score"] and (x := of_reply(task, base, reference)) is not None
                                and x <= SENSIBLE_SURPRISE]
            told = "".join(f", {p} {row[p]:.2f} ({row[p + '_sensible']:.2f} sensible)" for p in placements[1:])
            spilt = f"; at later line and sentence starts{direction(row['spill'], first=False)[1:]}" if row["spill"].get("positions") else ""
            shuffled = f"; against the placebo{direction(row['shift_placebo'], first=False)[1:]}" if placebo else ""
            print(f"{kind:8} as asked {row['asked']:.2f} ({row['asked_sensible']:.2f} sensible){told}"
                  f"{direction(row['shift'])}{spilt}{shuffled}", flush=True)
            rows.append(row)
    save({"benchmark": "teacher_ceiling", "model": policy.name, "variant": args.variant,
          "replies_per_placement": args.samples * len(TASKS),
          "max_tokens": args.max_tokens, "kinds": rows})


def hint_of(instruction: str, form: str, task: str) -> str:
    """The hint the teacher reads for `task`: the wish's sentence, as a judge extracts it
    (bench.personalization's PreferenceJudge), or (`reaction`) the rule user's whole reaction to
    a reply that missed it, as that judge passed it on for some kinds before 2026-12-02."""
    return missed(instruction, task) if form == "reaction" else instruction


def shifted_replies(reader, renderer, messages: list[dict], hint: str, placebo: bool, scale: float,
                    seeds: list[int], max_tokens: int) -> list[str]:
    """Replies from the base model at temperature 1, each token drawn from
    log π(·|plain) + scale · (log π(·|hint) − log π(·|contrast)), the contrast the plain prompt
    (classifier-free guidance) or, `placebo`, the hint's words shuffled — all contexts growing by
    the same sampled tokens. The full vocabulary, where the learner's target keeps the hinted
    model's top K and the rest."""
    plain = renderer.render(messages).ids
    contexts = [plain, renderer.render(enhanced_messages(messages, hint)).ids]
    if placebo:
        contexts.append(renderer.render(enhanced_messages(messages, scrambled(hint))).ids)
    stops = set(renderer.stop_token_ids)
    keyword = cache_argument(reader)
    out = []
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        inputs, caches, ids = [torch.tensor([c]) for c in contexts], [DynamicCache() for _ in contexts], []
        with torch.no_grad():
            for _ in range(max_tokens):
                reads = [torch.log_softmax(reader(input_ids=x, use_cache=True, **{keyword: cache}).logits[0, -1].float(), -1)
                         for x, cache in zip(inputs, caches)]  # each cache grows in place
                logits = reads[0] + scale * (reads[1] - reads[-1 if placebo else 0])
                token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
                if token in stops:
                    break
                ids.append(token)
                inputs = [torch.tensor([[token]])] * len(contexts)
        out.append(renderer.tokenizer.decode(ids, skip_special_tokens=True))
    return out


def hint_direction(reader, renderer, cls, hint_for, replies: list[dict], placebo: bool = False) -> dict:
    """bench/hint_shift.py's summary over the asked replies (empty for a kind without a token class),
    each task's hint (`hint_for(task)`) measured against the plain prompt or, `placebo`, the hint's
    words shuffled."""
    if cls is None:
        return {"positions": 0}
    shifts, firsts = [], []
    for r in replies:
        messages = [{"role": "user", "content": TASKS[r["task_index"]]}]
        reply = renderer.tokenizer.encode(r["first_reply"], add_special_tokens=False)
        if not reply:
            continue
        hint = hint_for(TASKS[r["task_index"]])
        base = enhanced_messages(messages, scrambled(hint)) if placebo else messages
        at, first = reply_shift(reader, renderer.tokenizer, cls, renderer.render(base).ids,
                                renderer.render(enhanced_messages(messages, hint)).ids, reply)
        shifts += at
        firsts.append(first)
    return summary(shifts, firsts)


def direction(shift: dict | None, first: bool = True) -> str:
    if not shift or not shift.get("positions"):
        return ""
    mass = f"; first-token mass {shift['first_mass_asked']:.3f} → {shift['first_mass_hinted']:.3f}" if first else ""
    return (f"; the hint's shift {shift['mean']:+.2f} nats of log-odds (median {shift['median']:+.2f}, "
            f"{shift['towards']:.0%} of {shift['positions']} positions the wish's way{mass})")


def headline(result: dict) -> str:
    def sensible(r: dict) -> str:  # results saved before the sensible share have none
        return f" ({r['asked_sensible']:.2f} → {r['hinted_sensible']:.2f} sensible)" if "hinted_sensible" in r else ""

    def experienced(r: dict) -> str:
        return (f", {r['experienced']:.2f} told with accepted replies ({r['experienced_sensible']:.2f} sensible)"
                if "experienced" in r else "")

    def guided(r: dict) -> str:
        return "".join(f", {r[k]:.2f} at shift ×{k.removeprefix('guided').replace('-placebo', ' against the placebo')}"
                       f" ({r[k + '_sensible']:.2f} sensible)"
                       for k in r if k.startswith("guided") and not k.endswith(("_sensible", "_surprise", "_examples")))

    return "; ".join(f"{r['kind']} {r['asked']:.2f} → {r['hinted']:.2f} told{sensible(r)}{experienced(r)}{guided(r)}"
                     f"{direction(r.get('shift'))}"
                     for r in result["kinds"]) + (
        f" (share of {result['replies_per_placement']} replies that fit, as asked → with the hint the teacher reads)")


def plot(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    kinds = result["kinds"]
    x = range(len(kinds))
    ax.bar([i - 0.2 for i in x], [r["asked"] for r in kinds], width=0.4, label="as asked")
    ax.bar([i + 0.2 for i in x], [r["hinted"] for r in kinds], width=0.4, label="told, as the OPD teacher is")
    ax.set_xticks(list(x), [r["kind"] for r in kinds])
    ax.set_ylim(0, 1)
    ax.set_ylabel("replies that fit the wish")
    ax.set_title(f"What {result['model']} does when told")
    ax.legend()
    return fig


if __name__ == "__main__":
    main()
