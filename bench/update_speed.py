"""Where an update on four OpenClaw-size rated turns spends its time, with each lever on and off.

    python -m bench.update_speed                          # capture the samples, then time both
    python -m bench.update_speed --samples FILE.json      # time samples captured before

Four turns of OpenClaw's real setup (bench.agent_pace's conversation, 256 tokens a reply) are
served at the defaults with the learner off and each rated −1 with a correction; the four
samples the ratings make are kept (`--keep FILE.json`). The learner then trains one update on
them at every default, from a fresh adapter, as the learner service would, and then reads what
the gate reads (the serving version's figures before, the candidate's after). Twice: with the
update's levers off (every row computed in a pass of its own, the base model reading every
prompt from its start, every training pass reading its rows whole) and on (learner/micro_batches.py's
shared rows, the base model's kept prompts, `ResponseReader._base_hidden`, the long prompts' starts
read once per weights without gradients, learner/prompt_prefix.py). With the levers on, the base
model's side of the first three samples' targets and the gate's base replies to their prompts are
read first, as the learner reads them while a batch fills (`read_ahead_s`, outside the total: it
happens before the fourth rating). Both start from the same seed; their losses and KLs are
printed side by side, so a lever that changed the update would show.

Writes bench/results/update_speed-<model>.json: the seconds of each part, per run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

from bench.agent_pace import CORRECTION, TURNS, parse_value, turn
from bench.models import bench_model, bench_server
from bench.prefix_reuse import openclaw_follow_up, openclaw_start
from bench.report import pyplot, save


def capture(model_dir: Path, max_tokens: int) -> list[dict]:
    """The four rated turns' samples, as the learner would get them."""
    with bench_server(model_dir, learn=False) as server:
        key = server.key("alice")
        client = server.client(key).with_options(timeout=600)
        messages, tools = openclaw_start()
        for i in range(TURNS):
            if i:
                messages.append(openclaw_follow_up(i))
            reply, row = turn(client, messages, tools, max_tokens)
            messages.append(reply)
            for call in reply.get("tool_calls", []):
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "(done; no output)"})
            httpx.post(f"{server.base_url}/feedback", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                       json={"response_id": row["id"], "rating": -1, "correction": CORRECTION})
            print(json.dumps(row), flush=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            samples = [s for s in server.app.state.services.samples.samples() if s.status == "ready"]
            if len(samples) >= TURNS:
                return [s.model_dump() for s in sorted(samples, key=lambda s: s.id)]
            time.sleep(2)
    raise SystemExit("the ratings made no four samples in 10 minutes")


def timed_update(model_dir: Path, samples, levers: bool, overrides: dict | None = None) -> dict:
    """One update at the defaults (but `overrides`, Settings fields) and the gate's reads, with
    the levers on or off."""
    import torch

    from nextstate.core.settings import Settings
    from nextstate.learner import forward as forward_module
    from nextstate.learner.gate import GATE_NEW_TOKENS, GATE_PROMPTS, gate_prompts
    from nextstate.learner.readings import Readings
    from nextstate.learner.trainer import LoraTrainer

    original = forward_module.prefix_hosts
    if not levers:
        forward_module.prefix_hosts = lambda rows: list(range(len(rows)))
    try:
        torch.manual_seed(0)
        trainer = LoraTrainer(model_dir, Settings(**(overrides or {})).learner)
        readings = Readings(trainer)
        if not levers:
            trainer._base_kv.budget = 0
            trainer._prefixes.grad_tokens = None

        def the_gates(batch) -> list[list[int]]:  # the batch's prompts, topped up as a new scope's are
            return gate_prompts(gate_prompts([s.prompt_ids for s in batch]) + readings.everyday_prompts(GATE_PROMPTS))

        prompts = the_gates(samples)
        out: dict = {}
        mark = time.monotonic()
        if levers:  # what the learner reads while the batch fills, before the last rating (LoraTrainer.read_ahead)
            trainer.read_ahead(samples[:-1])
            readings.base_ahead(the_gates(samples[:-1]), GATE_NEW_TOKENS)  # and the gate's (PublishGate.read_ahead)
        out["read_ahead_s"] = round(time.monotonic() - mark, 1)
        mark = time.monotonic()
        readings.gate_figures("alice", [], prompts, GATE_NEW_TOKENS)  # the serving version: the base model
        out["gate_serving_s"] = round(time.monotonic() - mark, 1)
        result = trainer.step("alice", samples)
        out.update(step_s=round(result.seconds, 1), timings=result.timings, epochs=result.epochs,
                   policy_kl=result.policy_kl, loss=result.loss, kl_tries=len(result.kl_tries), skipped=result.skipped)
        mark = time.monotonic()
        readings.gate_figures("alice", [], prompts, GATE_NEW_TOKENS)
        readings.version_figures("alice", [])
        out["gate_candidate_s"] = round(time.monotonic() - mark, 1)
        out["total_s"] = round(out["gate_serving_s"] + out["step_s"] + out["gate_candidate_s"], 1)
        return out
    finally:
        forward_module.prefix_hosts = original


def headline(result: dict) -> str:
    runs = result["runs"]
    return "; ".join(f"levers {name}: update {r['step_s']:.0f} s ({', '.join(f'{k} {v:.0f}' for k, v in r['timings'].items())}), "
                     f"gate {r['gate_serving_s'] + r['gate_candidate_s']:.0f} s, total {r['total_s']:.0f} s"
                     f" (read ahead before the last rating: {r.get('read_ahead_s', 0):.0f} s)"
                     for name, r in runs.items())


def plot(result: dict):
    plt = pyplot()
    figure, ax = plt.subplots(figsize=(8, 3.4))
    names = list(result["runs"])
    parts = ["gate_serving_s", "teacher", "passes", "epoch_kl", "kl_fit", "gate_candidate_s"]
    left = [0.0] * len(names)
    for part in parts:
        widths = [r.get(part, r["timings"].get(part, 0.0)) for r in result["runs"].values()]
        ax.barh(names, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("seconds")
    ax.legend(fontsize=7)
    ax.set_title(f"{result['model']}: one update on four OpenClaw-size rated turns, 2 CPU cores", fontsize=9)
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local HF model dir (default: the embedded SmolLM2)")
    parser.add_argument("--samples", type=Path, help="samples captured before (a JSON list)")
    parser.add_argument("--keep", type=Path, help="write the captured samples here")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--only", choices=["off", "on"], help="one run only")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a learner Settings field for the runs (e.g. learner_dtype=bfloat16)")
    parser.add_argument("--variant", help="a name for this run's result file (with --set)")
    args = parser.parse_args()
    overrides = {k: parse_value(v) for k, v in (s.split("=", 1) for s in args.set)}

    from nextstate.core.types import Sample

    model_dir = bench_model(model=args.model, smol=not args.model)
    raw = json.loads(args.samples.read_text()) if args.samples else capture(model_dir, args.max_tokens)
    if args.keep:
        args.keep.write_text(json.dumps(raw))
    samples = [Sample(**s) for s in raw]
    print("samples:", [(len(s.prompt_ids), len(s.response_ids)) for s in samples], flush=True)
    runs = {}
    for name in ("off", "on"):
        if args.only and name != args.only:
            continue
        runs[name] = timed_update(model_dir, samples, levers=name == "on", overrides=overrides)
        print(name, json.dumps(runs[name]), flush=True)
    result = {"benchmark": "update_speed", "model": model_dir.name, "variant": args.variant or args.only, "settings": overrides,
              "samples": [[len(s.prompt_ids), len(s.response_ids)] for s in samples], "runs": runs}
    print(headline(result))
    save(result)


if __name__ == "__main__":
    main()
