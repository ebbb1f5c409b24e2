"""Four ratings at the defaults: does the first update serve, and how should an overshooting
step be shortened? (issue 38, "No rating lost")

    python -m bench.kl_backtracking --smol --seeds 0 1 2

For each seed, nextstate runs at every default on the model (SmolLM2 with --smol) beside an
admin key; a person sends four requests — Chat Completions, Anthropic Messages, Responses and
one more chat, through the HTTP API — and rates each −1 with the correction "Answer in one
short sentence." (as the issue's new user did). The partial batch's wait is the only setting
changed (1 s instead of 120 s). Recorded: whether a version was published, each length the
KL line search tried and the KL there.

Then the choice of the line search's rule, on the same four samples, with the learner alone:
the step is trained at full length once, and the KL measured at lengths 1, 0.7, 0.5, … 1/32 of
it (the curve), and each rule — the quadratic model (learner/step_sizes.py) and plain halving
(TRPO's) — is run from the same trained step, at the default limit and at a quarter of the
step's own KL (so that both must search whatever this seed's first step did): lengths tried,
the length kept (more kept is more of the update learnt), the KL there, and the seconds the
search cost.

Writes bench/results/kl_backtracking-<model>.json and a PNG of the curves.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import httpx

from bench.models import bench_model, bench_server
from bench.report import pyplot, save

CORRECTION = "Answer in one short sentence."
PROMPTS = ("Tell me about the moon.", "What is a good breakfast?", "Explain what a river is.", "Why do cats purr?")
CURVE = (1.0, 0.7, 0.5, 0.35, 0.25, 0.125, 0.0625, 0.03125)


def four_ratings(server, seed: int) -> list[dict]:
    """The new user's four replies through three APIs, each rated −1 with a correction."""
    key = server.key("alice")
    server.key("root", admin=True)
    headers = {"Authorization": f"Bearer {key}"}
    base = server.base_url
    with httpx.Client(timeout=300, headers=headers) as http:
        chat = lambda prompt: http.post(f"{base}/chat/completions", json={  # noqa: E731
            "model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 48, "seed": seed}).json()["id"]
        ids = [
            chat(PROMPTS[0]),
            http.post(f"{base}/messages", json={"model": "m", "max_tokens": 48,
                                                "messages": [{"role": "user", "content": PROMPTS[1]}]}).json()["id"],
            http.post(f"{base}/responses", json={"model": "m", "input": PROMPTS[2], "max_output_tokens": 48}).json()["id"],
            chat(PROMPTS[3]),
        ]
        for response_id in ids:
            answer = http.post(f"{base}/feedback", json={"response_id": response_id, "rating": -1, "correction": CORRECTION})
            assert answer.json()["status"] == "accepted", answer.text
    deadline = time.monotonic() + 600
    learner = server.app.state.services.learner
    while not learner.steps and time.monotonic() < deadline:
        time.sleep(0.5)
    return [dict(step) for step in learner.steps]


def line_search(trainer, scope: str, samples, before, shrink: float | None, max_kl: float) -> dict:
    """One rule's search from the same trained step (trained again from the same state);
    `before`: the policy's logprobs of the samples before the step, what its KL is measured from."""
    from nextstate.learner.step_sizes import StepSizes

    trainer.step_sizes = StepSizes(max_kl, trainer.settings.kl_backtracks, shrink)
    started = time.monotonic()
    kl, tries = trainer._fit_kl(scope, samples, before)
    seconds = time.monotonic() - started
    return {"tries": [t.to_dict() for t in tries], "kept": tries[-1].scale, "kl": kl, "fits": kl <= max_kl,
            "seconds": round(seconds, 2)}


def compare_rules(model_dir, samples, max_kl: float) -> dict:
    import copy

    import torch

    from nextstate.core.settings import LearnerSettings
    from nextstate.learner.trainer import LoraTrainer

    settings = LearnerSettings(max_kl=1e9)  # train once at full length, whatever its KL
    trainer = LoraTrainer(model_dir, settings)
    scope = "bench"
    trainer.ensure_scope(scope)
    with torch.no_grad():  # the fresh adapter is the base model: the policy before the step
        before = [lp.detach() for lp in trainer._logprobs_each(samples)]
    result = trainer.step(scope, samples)
    trained = [p.detach().clone() for p in trainer._params(trainer.ensure_scope(scope))]
    weights_before, optimizer_before = trainer._before[scope]
    saved_before = ([w.clone() for w in weights_before], copy.deepcopy(optimizer_before))

    def back_to_trained():
        import torch

        with torch.no_grad():
            for p, w in zip(trainer._params(trainer.ensure_scope(scope)), trained):
                p.copy_(w)
        trainer._before[scope] = ([w.clone() for w in saved_before[0]], copy.deepcopy(saved_before[1]))

    curve = []
    for scale in CURVE:
        back_to_trained()
        if scale < 1:
            trainer.shorten_step(scope, scale)
        curve.append({"scale": scale, "kl": trainer._policy_kl(samples, before)})
    # the default limit, and one a quarter of this step's own KL, so that every rule must search
    limits = sorted({max_kl, round(curve[0]["kl"] / 4, 4)}, reverse=True)
    rules: dict[str, dict] = {}
    for limit in limits:
        for name, shrink in (("quadratic", None), ("halving", 0.5)):
            back_to_trained()
            rules.setdefault(name, {})[f"{limit:g}"] = line_search(trainer, scope, samples, before, shrink, limit)
    return {"step_seconds": round(result.seconds, 2), "curve": curve, "limits": limits, "rules": rules}


def headline(result: dict) -> str:
    runs = result["runs"]
    published = sum(r["published"] for r in runs)
    def kept(name: str) -> float:  # at the tighter limit of each run (a quarter of its own step's KL)
        return statistics.fmean(r["rules"][name][f"{r['limits'][-1]:g}"]["kept"] for r in runs)

    return (f"{published}/{len(runs)} seeds published from four ratings at the defaults; at a limit of a quarter of "
            f"the step's KL, step kept: quadratic {kept('quadratic'):.2f}, halving {kept('halving'):.2f} (mean)")


def plot(result: dict):
    plt = pyplot()
    figure, ax = plt.subplots(figsize=(6, 4))
    for run in result["runs"]:
        curve = run["curve"]
        ax.plot([c["scale"] for c in curve], [c["kl"] for c in curve], marker="o", label=f"seed {run['seed']}")
    ax.axhline(result["max_kl"], color="grey", linestyle="--", label="NEXTSTATE_MAX_KL")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("share of the trained step")
    ax.set_ylabel("policy KL on its batch")
    ax.set_title(f"First update of four ratings ({result['model']})")
    ax.legend(fontsize=8)
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", help="any local HF model dir (default: a tiny model)")
    parser.add_argument("--smol", action="store_true", help="the embedded SmolLM2")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    model_dir = bench_model(args.policy, args.smol)
    from nextstate.core.settings import LearnerSettings

    max_kl = LearnerSettings().max_kl
    runs = []
    for seed in args.seeds:
        with bench_server(model_dir, batch_wait_s=1.0) as server:
            steps = four_ratings(server, seed)
            samples = sorted(server.app.state.services.samples.samples(), key=lambda s: s.id)
        first = steps[0] if steps else {}
        run = {"seed": seed, "published": bool(first.get("published")), "server_step": {
            k: first.get(k) for k in ("published", "kl_tries", "step_scale", "skipped", "samples", "seconds")}}
        run.update(compare_rules(model_dir, samples, max_kl))
        runs.append(run)
        print(f"seed {seed}: published {run['published']}, server's tries {first.get('kl_tries')}; "
              f"curve {[(c['scale'], round(c['kl'], 4)) for c in run['curve']]}", flush=True)
        for name, by_limit in run["rules"].items():
            for limit, found in by_limit.items():
                print(f"  {name:>9} at limit {limit}: kept {found['kept']:.3g} in {len(found['tries'])} lengths, "
                      f"KL {found['kl']:.4g}, {found['seconds']} s", flush=True)
    name = "SmolLM2-135M-Instruct" if args.smol else model_dir.name
    save({"benchmark": "kl_backtracking", "model": name, "max_kl": max_kl, "runs": runs})
    for run in runs:
        assert all(math.isfinite(c["kl"]) for c in run["curve"])


if __name__ == "__main__":
    main()
