"""The command line: `python -m bench.personalization` (see the package docstring for the flags)."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict

from nextstate.core.settings import JudgeSettings, LearnerSettings
from nextstate.learner.gate import GATE_PROMPTS

from bench.models import bench_model
from bench.personalization.evaluation import reread, task_list
from bench.personalization.person import (
    ANSWER_HINT,
    HELD_OUT_TASKS,
    KIND_QUESTIONS,
    KINDS,
    MODES,
    NONSENSE_HINTS,
    NOT_AN_ANSWER,
    QUESTIONS,
    ChatModel,
    ModelScorer,
    ModelUser,
    Preference,
    PreferenceJudge,
    RuleScorer,
    RuleUser,
    instruction_for,
    questions_of,
)
from bench.personalization.reports import report, seeds_report, summarise
from bench.personalization.run import (
    LEARNER_WAIT_S,
    StopRequest,
    engine_settings,
    overrides,
    probe_marker,
    run_mode,
)
from bench.reply_surprise import SENSIBLE_SURPRISE
from bench.report import save


def arguments() -> argparse.ArgumentParser:
    """Every flag, described in the package docstring (`--help` prints it)."""
    import bench.personalization as package

    parser = argparse.ArgumentParser(description=package.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", help="any local HF model dir (default: a peaked tiny model)")
    parser.add_argument("--smol", action="store_true", help="the embedded SmolLM2 as the policy")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--tasks", type=int, default=160, help="fresh tasks per mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rule", help="rule-checked preference: capital, digit, marker:WORD or marker:auto "
                        "(default: capital on the tiny model, marker:auto otherwise, none with --preference)")
    parser.add_argument("--kind", choices=sorted(KINDS), help="a preference kind by name (sets --rule): " + ", ".join(
        f"{k} = {v}" for k, v in KINDS.items()))
    parser.add_argument("--target", type=float, default=0.15, help="marker:auto picks the word with this base probability")
    parser.add_argument("--preference", help="the preference in words (needed with a model user/scorer)")
    parser.add_argument("--sensible-user", action="store_true",
                        help="the user also turns down a reply the base model reads as nonsense (surprise over "
                             f"{SENSIBLE_SURPRISE:g} nats/token, bench/reply_surprise.py): \"{NOT_AN_ANSWER} ...\"")
    parser.add_argument("--nonsense-hint", choices=NONSENSE_HINTS, default="wish",
                        help="the rule judge's hint for a reply turned down as nonsense: the wish's sentence alone "
                             f"(wish), or \"{ANSWER_HINT}\" before it (answer)")
    parser.add_argument("--max-attempts", type=int, default=2, help="replies per task before the user moves on")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--think-s", type=float, default=0.3, help="pause after each task")
    parser.add_argument("--final-samples", type=int, default=16,
                        help="replies sampled per task from the final version, to score the run (0: none)")
    parser.add_argument("--questions", choices=sorted(QUESTIONS), default=None,
                        help="the questions asked and held out (default: the kind's, else everyday)")
    parser.add_argument("--held-out-samples", type=int, default=2,
                        help=f"replies sampled per held-out question ({len(HELD_OUT_TASKS)} questions the user never "
                             "asks) from each version as it begins serving (0: none)")
    parser.add_argument("--defaults", action="store_true",
                        help="every server setting at its default (batch, lr, LoRA, votes): what a newcomer gets")
    parser.add_argument("--feedback", action="store_true",
                        help="the user also rates every reply with POST /v1/feedback (a correction when it misses); "
                             "without --judge-url the server's own default judge is kept (the served model)")
    parser.add_argument("--served-judge", action="store_true",
                        help="the server's own default judge (the served model; benched when it fails its check, "
                             "then next states teach as hints: NEXTSTATE_JUDGE_FALLBACK) instead of the rule judge")
    parser.add_argument("--judge-fallback", choices=("hindsight", "ratings"), default=None,
                        help="NEXTSTATE_JUDGE_FALLBACK (default: the setting's default)")
    parser.add_argument("--fresh-base", action="store_true",
                        help="read the base model again instead of taking its readings from the cache "
                             "(bench/base_cache.py: kept by model, engine, parameters and source)")
    parser.add_argument("--wait-for-learner", action="store_true",
                        help="after each task, wait until the learner trained every full batch: updates per task "
                             "fixed by the batch size, not by the machine's speed")
    parser.add_argument("--learner-wait-s", type=float, default=LEARNER_WAIT_S,
                        help="--wait-for-learner gives up after this many seconds (a stuck learner)")
    parser.add_argument("--set", action="append", metavar="NAME=VALUE",
                        help="any server setting by name, e.g. --set minibatch_size=4 (repeatable)")
    parser.add_argument("--no-gate", action="store_true", help="NEXTSTATE_PUBLISH_GATE=false: every update serves")
    parser.add_argument("--gate-max-repetition-rise", type=float, default=None,
                        help="NEXTSTATE_GATE_MAX_REPETITION_RISE (default: the setting's default)")
    parser.add_argument("--gate-backtracks", type=int, default=None,
                        help="NEXTSTATE_GATE_BACKTRACKS (default: the setting's default)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--lora-r", type=int, default=None)
    parser.add_argument("--votes", type=int, default=1, help="judge votes per turn (the rule judge always agrees)")
    for role in ("user", "judge", "scorer"):
        parser.add_argument(f"--{role}-url", help=f"OpenAI-compatible endpoint for the {role} (default: rules)")
        parser.add_argument(f"--{role}-model", default="default")
    parser.add_argument("--api-key-env", default="OPENAI_API_KEY")
    parser.add_argument("--variant", help="a name for this run's settings: its results get their own file")
    parser.add_argument("--stop-after-min", type=float, default=None, metavar="MINUTES",
                        help="end the tasks at the first task boundary after this long (SIGTERM does too): the "
                             "final evaluation runs and the result is written, with `stopped_after` the tasks done")
    parser.add_argument("--sglang-url", help="serve the policy from this SGLang server (deploy/) instead of in-process")
    parser.add_argument("--report", nargs="+", metavar="JSON", help="print saved results as a table and exit")
    parser.add_argument("--seeds-report", nargs="+", metavar="JSON",
                        help="print runs of several seeds, grouped by preference and mode, as curves with spread")
    parser.add_argument("--reread", nargs="+", metavar="JSON",
                        help="add the surprise figure (bench/reply_surprise.py) to saved SmolLM2 results and exit")
    return parser


def main() -> None:
    args = arguments().parse_args()
    if args.report:
        report(args.report)
        return
    if args.seeds_report:
        seeds_report(args.seeds_report)
        return
    if args.reread:
        reread(args.reread)
        return

    policy = bench_model(model=args.policy, smol=args.smol, peaked=True)
    tiny = not (args.policy or args.smol)
    args.max_tokens = args.max_tokens or (8 if tiny else 48)
    if args.defaults:  # what the server does with no NEXTSTATE_* variable set, for the record
        defaults = LearnerSettings()
        args.batch, args.lr, args.lora_r = defaults.batch_size, defaults.lr, defaults.lora_r
        args.votes = JudgeSettings().prm_votes
    # A --set of a setting the result records is what the run had (it wins over the flags above).
    for name, value in overrides(args.set).items():
        if field := {"batch_size": "batch", "lora_r": "lora_r", "prm_votes": "votes"}.get(name):
            setattr(args, field, int(value))
        elif name == "lr":
            args.lr = value if value == "auto" else float(value)
    args.lr = args.lr or (5e-3 if tiny else 2e-4)
    args.lora_r = args.lora_r or (8 if tiny else 16)
    api_key = os.environ.get(args.api_key_env)

    marker_probability = None
    if args.kind:
        args.rule = KINDS[args.kind]
    args.questions = args.questions or KIND_QUESTIONS.get(args.kind, "everyday")
    rule = args.rule if args.rule is not None else ("" if args.preference else "capital" if tiny else "marker:auto")
    if rule.startswith("marker:"):
        wanted = rule.removeprefix("marker:")
        marker, plain, hinted = probe_marker(policy, engine_settings(args), None if wanted == "auto" else wanted,
                                             args.target)
        rule = f"marker:{marker}"
        marker_probability = {"first_token": round(plain, 4), "first_token_with_hint": round(hinted, 4)}
        print(f"preference marker: {marker!r}, mean first-token probability {plain:.3f}, {hinted:.3f} with the hint")
    instruction = args.preference or instruction_for(rule)
    if instruction is None:
        raise SystemExit(f"unknown --rule {rule!r}: use capital, digit, short, lowercase, nolist, avoid:WORDS, "
                         "marker:WORD or marker:auto")
    preference = Preference(instruction, rule)
    user = ModelUser(ChatModel(args.user_url, args.user_model, api_key), preference) if args.user_url else RuleUser(preference)
    scorer = (ModelScorer(ChatModel(args.scorer_url, args.scorer_model, api_key), preference) if args.scorer_url
              else RuleScorer(preference))
    rule_judge = None
    if args.judge_url:
        judge = {"judge_base_url": args.judge_url, "judge_model": args.judge_model, "judge_api_key": api_key}
    elif args.feedback or args.served_judge:
        judge = {}  # the default: the served model judges, and must pass its calibration first
    else:
        rule_judge = PreferenceJudge(nonsense_hint=args.nonsense_hint)
        judge = {"judge_base_url": rule_judge.base_url, "judge_model": "rules"}

    tasks = task_list(args.seed, args.tasks, questions_of(args).asked)
    result = {
        "benchmark": "personalization",
        "model": policy.name,
        "variant": args.variant,
        "preference": asdict(preference),
        "questions": args.questions,
        "marker_probability": marker_probability,
        "user": (args.user_url and f"{args.user_model} at {args.user_url}" or "rules") + (
            f", turning down nonsense (surprise > {SENSIBLE_SURPRISE:g})" if args.sensible_user else ""),
        "judge": args.judge_url and f"{args.judge_model} at {args.judge_url}" or (
            "the default (the served model itself)" if args.feedback or args.served_judge else "rules (PreferenceJudge)"),
        "judge_fallback": args.judge_fallback or JudgeSettings().judge_fallback,
        "overrides": overrides(args.set),
        "explicit_feedback": args.feedback,
        "publish_gate": not args.no_gate,
        "gate_max_repetition_rise": None if args.no_gate else (
            args.gate_max_repetition_rise if args.gate_max_repetition_rise is not None else LearnerSettings().gate_max_repetition_rise),
        "gate_backtracks": None if args.no_gate else (
            args.gate_backtracks if args.gate_backtracks is not None else LearnerSettings().gate_backtracks),
        "gate_prompts": GATE_PROMPTS,
        "scorer": args.scorer_url and f"{args.scorer_model} at {args.scorer_url}" or "rules",
        "settings": {k: getattr(args, k) for k in ("tasks", "seed", "max_attempts", "max_tokens", "temperature", "think_s",
                                                    "batch", "lr", "lora_r", "votes", "final_samples",
                                                    "wait_for_learner", "sensible_user", "held_out_samples", "nonsense_hint")},
        "summary": [],
        "runs": [],
    }
    stop = StopRequest(args.stop_after_min)
    stop.install()
    try:
        for mode in args.modes:
            if stop.requested:
                print(f"{mode:>8}: not run (stop requested)", flush=True)
                continue
            run = run_mode(mode, policy, tasks, args, judge, user, scorer, stop)
            summary = summarise(run)
            print(f"{mode:>8}: score {summary['score_first_quarter']:.2f} (first quarter) -> "
                  f"{summary['score_last_quarter']:.2f} (last quarter), {summary['updates_published']} updates")
            result["summary"].append(summary)
            result["runs"].append({"mode": run.mode, "steps": run.steps, "calibration": run.calibration,
                                   "tasks": [asdict(t) for t in run.tasks], "final": run.final,
                                   "prose_forgetting": run.prose_forgetting, "held_out": run.held_out,
                                   "stopped_after": run.stopped_after})
            save(result)  # after every mode: an interrupted run keeps the modes it finished
    finally:
        if rule_judge is not None:
            rule_judge.stop()


if __name__ == "__main__":
    main()
