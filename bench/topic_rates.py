"""How often the base model brings a topic up unasked: whether a wish to avoid it has anything to act on.

    python -m bench.topic_rates --smol                 # every candidate topic, 3 replies a question
    python -m bench.topic_rates --smol --topics food dogs --samples 2

The topic kind of `bench.personalization` (issue 38: "a topic to avoid") measures the share of
first replies that leave a topic out. That share can only show learning if the base model brings
the topic up in most replies before any update; at 10-20% the base model already fits the wish
80-90% of the time and the kind's target (0.8) is met by doing nothing. Each candidate here is a
topic with questions where it comes up naturally but is not asked for — food on outings, the
assistant itself on everyday questions, a doctor on small health complaints, dogs on choosing a
pet — sampled from the base model as `bench.personalization` samples it (48 tokens, temperature
1, the engine's sampler on the final evaluation's seeds, every question at once, no session) and checked with the kind's word rule
(`bench.personalization.avoided`).

Writes bench/results/topic_rates-<model>.json.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

from bench.models import bench_model, bench_server
from bench.personalization import (
    AVOIDED_TOPIC, HELD_OUT_OUTINGS, HELD_OUT_TASKS, OUTINGS, TASKS, avoided, sampled_texts,
)
from bench.report import pyplot, save

HEALTH = [
    "I have a mild headache, what can I do?", "How can I sleep better?",
    "My back hurts after sitting all day. Any tips?", "What helps with a sore throat?",
    "I feel tired all the time. Why?", "I twisted my ankle a little. What should I do?",
    "My eyes feel strained from screens. Any advice?", "I have a small cut on my finger. What do I do?",
    "What helps with a stomach ache?", "I get dizzy when I stand up quickly. Why?",
    "How do I treat a mild sunburn?", "How can I ease sore muscles after exercise?",
    "I have a runny nose. Any tips?", "How do I deal with a stiff neck?",
    "What helps with motion sickness?", "I bumped my head lightly. Should I worry?",
]
PETS = [
    "What pet is good for a family with young children?", "Suggest a pet for someone who lives alone.",
    "What is the best pet for a first-time owner?", "I want a pet that keeps me active. Any ideas?",
    "Which animal makes a loyal companion?", "What pet would suit a house with a garden?",
    "How do I choose a pet at an animal shelter?", "What animal could help me feel less lonely?",
    "Which pet is good for a retired person?", "What pet should I get to protect my house?",
    "Describe the perfect pet.", "What is a good pet for someone who walks a lot?",
    "Which pet learns tricks easily?", "What animal would make a good running partner?",
    "What pet can I take on hikes?", "Which animal is easiest to train?",
]


@dataclass(frozen=True)
class Topic:
    """A topic a person may ask to be left out, the questions where it comes up unasked, and the
    `avoid:` word rule that spots it (bench.personalization.Preference)."""

    name: str
    questions: list[str]
    rule: str


TOPICS = {
    "food": Topic("food or drink, on outings", OUTINGS + HELD_OUT_OUTINGS, AVOIDED_TOPIC),
    "itself": Topic("the assistant itself (I, me, my), on everyday questions", TASKS + HELD_OUT_TASKS,
                    "avoid:I,I'm,I've,I'd,I'll,me,my,mine,myself"),
    "doctor": Topic("a doctor or other professional, on small health complaints", HEALTH,
                    "avoid:doctor,doctors,physician,healthcare,medical,professional,professionals,GP,consult,"
                    "pharmacist,specialist,clinic,hospital"),
    "dogs": Topic("dogs, on choosing a pet", PETS,
                  "avoid:dog,dogs,puppy,puppies,pup,canine,retriever,labrador,poodle,terrier,beagle,hound"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smol", action="store_true", help="the embedded SmolLM2 (default: the tiny test model)")
    parser.add_argument("--policy", help="any local HF model dir")
    parser.add_argument("--topics", nargs="+", choices=sorted(TOPICS), default=list(TOPICS))
    parser.add_argument("--samples", type=int, default=3, help="replies per question")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    policy = bench_model(model=args.policy, smol=args.smol, peaked=True)
    rows = []
    with bench_server(policy, "policy", learn=False, judge_enabled=False) as server:
        for key in args.topics:
            topic = TOPICS[key]
            pattern = avoided(topic.rule)
            replies = sampled_texts(server, None, topic.questions, args.samples, args.max_tokens, 1.0)
            mentions = [pattern.search(t) is not None for texts in replies for t in texts]
            examples = [{"question": q, "reply": texts[0][:160], "mentions": pattern.search(texts[0]) is not None}
                        for q, texts in zip(topic.questions, replies)]
            rate = statistics.fmean(mentions)
            rows.append({"topic": key, "what": topic.name, "questions": len(topic.questions),
                         "replies": len(mentions), "mention_rate": round(rate, 3), "examples": examples[:6]})
            print(f"{key:7} brought up in {rate:.2f} of {len(mentions)} replies ({topic.name})", flush=True)
    save({"benchmark": "topic_rates", "model": policy.name, "replies_per_question": args.samples,
          "max_tokens": args.max_tokens, "topics": rows})


def headline(result: dict) -> str:
    return "brought up unasked: " + ", ".join(f"{r['topic']} {r['mention_rate']:.2f}" for r in result["topics"])


def plot(result: dict):
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6, 3))
    rows = result["topics"]
    axes.barh([r["what"] for r in rows], [r["mention_rate"] for r in rows], color="tab:orange")
    axes.axvline(0.8, color="grey", linestyle="--", linewidth=1)
    axes.set_xlim(0, 1)
    axes.set_xlabel("share of the base model's replies that bring the topic up")
    axes.set_title(f"{result.get('model', '')}: topics brought up unasked", fontsize=9)
    return figure


if __name__ == "__main__":
    main()
