"""Does it learn a person's preference from how they react? The paper's §5.1/5.3 in miniature.

    pip install -e '.[bench]'
    python -m bench.personalization                 # peaked tiny model, rule-based user/judge/scorer
    python -m bench.personalization --smol          # the embedded SmolLM2 as the policy
    python -m bench.personalization --policy DIR \\
        --user-url URL --user-model M --judge-url URL --judge-model M --scorer-url URL --scorer-model M \\
        --preference "Answer like a person texting a friend: lowercase, no lists."

A simulated user with a hidden preference talks to nextstate over the real HTTP API through
the `openai` SDK, as a stock client: no session headers, nothing nextstate-specific. For each
fresh task it asks once; when the reply misses its preference it answers "No, ..." with the
preference and asks again (at most twice), when a reply fits it says thanks. nextstate infers
the sessions, judges each reply from the user's reaction (its next state), and learns online
in the mode under test. A scorer, separate from the judge, rates the *first* reply to every
fresh task against the preference; the curve of that score over the tasks is the result.
Beside it, the share of repeated words in each first reply: a rule scorer sees only the
preference, and a policy that learns it by degenerating (binary RL at a high learning rate
does) repeats itself.

Modes, run one after another on the same policy, tasks and seeds (every request carries
`seed`, so until the first update all modes see the same replies): `none` (serving only: the
baseline), `binary`, `opd` and `combined` (NEXTSTATE_MODE).

**Rule-based mode** (the default; a tiny model cannot play a user or a judge):

* preference — "Always begin your reply with a capital letter." on the tiny model: its replies
  already do now and then (~17% — the paper's base score is 0.17), so the preference is
  reachable but not given. Also `--rule digit` ("include a number") and `--rule marker:WORD`;
  `marker:auto` (the default for other policies) picks the word-like first token whose mean
  base probability over the tasks is nearest `--target` (0.15). For a marker, the result also
  records its probability with the instruction appended as the OPD teacher sees a hint.
* user — checks the rule: "Thanks, that's exactly how I like it." or "No, that's not how I
  like it. <the instruction> Please try again: <task>".
* judge — an OpenAI-compatible server in this process (tests/judge_server.py's rules): a next
  state with thanks → \\boxed{1}, one starting "No" → \\boxed{-1}; hint judge: for a correction,
  the user's own instruction sentence as the hint, otherwise \\boxed{-1}. This is the judge a
  capable model would be on these messages, minus its noise.
* scorer — the same rule on the first reply to each task: 1 or 0.

On the tiny model OPD has nothing to distil: the teacher is the same random network reading
the hint, which it cannot understand, so opd is expected not to help there. Use --smol or
--policy for a model that can read a hint.

**Model mode**: `--user-url/--judge-url/--scorer-url` (+ `--*-model`, API key from
`--api-key-env`, default OPENAI_API_KEY) make any of the three an OpenAI-compatible model,
with `--preference` in words; `--sglang-url` serves the policy from SGLang. `--lr`
and `--batch` set the learner; `--variant NAME` gives a run with other settings its own file.
**Final evaluation**: the 48 first replies of a run's last quarter score it to about ±0.07,
as large as the differences between settings. So after the last task each learning run also
samples `--final-samples` (16) replies to each of the 24 tasks from the version then serving,
in-process through the engine (no session, nothing judged or learnt), with seeds that are the
same for every run and mode: runs compare on the same random draws, and 384 replies measure
score and repetition to about ±0.02. The `none` mode's final evaluation is the base model's.
**Held-out questions**: 24 more questions the simulated user never asks (HELD_OUT_TASKS). The
final evaluation samples them too, and each version is read on them as it begins serving
(`--held-out-samples`, 2 replies a question), beside the ratings the person had given by then:
whether the wish, not the 24 questions it was corrected on, was learnt — and how soon (the
first version after 15 ratings is the summary's `held_out_after_ratings`).

Writes bench/results/personalization-<policy>[-<variant>][-<gpu>].json and a PNG;
`--report FILE...` prints saved results as the table BENCHMARKS.md quotes.
"""

# The names other benches and the tests use, from the modules that hold them; bench/report.py
# draws a saved result with `plot` and `headline`.
from bench.personalization.person import (  # noqa: F401
    ANSWER_HINT, AVOIDED_TOPIC, ChatModel, HELD_OUT_OUTINGS, HELD_OUT_TASKS, INSTRUCTIONS, KINDS, KIND_QUESTIONS, ModelScorer, ModelUser, NOT_AN_ANSWER, OUTINGS, Preference, PreferenceJudge, QUESTIONS, RuleScorer, RuleUser, TASKS, THANKS, avoided, instruction_for, missed, not_an_answer, react,
)
from bench.personalization.run import (  # noqa: F401
    StopRequest, base_model_readings, run_mode,
)
from bench.personalization.evaluation import (  # noqa: F401
    GENERAL_TEXT, final_evaluation, final_seeds, held_out_nll, mean_repetition, reference_readings, sampled_replies, sampled_texts, task_list,
)
from bench.personalization.reports import (  # noqa: F401
    headline, plot, report, seeds_report, summarise,
)
