"""What the publish gate and the held-out figures read of a trainer's weights.

The trainer trains; these read. Each reading has two sides, the weights being judged and the
base model, and the base model's side never changes: it is computed once per prompt or held-out
turn and kept (on two CPU cores a base reply of SmolLM2 costs seconds, an agent's prompt
minutes). The gate's rules are in learner/gate.py, the held-out figures' in learner/held_out.py.
Calls block on the model and are meant for the learner's worker thread.
"""

from __future__ import annotations

import math
import random
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessorList

from nextstate.core.types import Sample
from nextstate.engine import kv_cache
from nextstate.engine.prefix_cache import PrefixCache
from nextstate.learner.held_out import HintMove, VersionFigures, figures as held_out_figures, probe_passages, shipped_lines
from nextstate.learner.micro_batches import length_groups, micro_batches
from nextstate.learner.prompt_prefix import read_through
from nextstate.learner.seeded_sampling import SeededGumbel, row_seed
from nextstate.learner.forward import pad_id, stop_ids
from nextstate.learner.trainer import LoraTrainer
from nextstate.modelio.logprobs import token_logprobs

# Replies per gate prompt, sampled at temperature 1: sixteen in all over eight prompts, a mean
# that one unlucky draw moves by a sixteenth of its repetition.
GATE_SAMPLED_REPLIES = 2
# Words of each gate reply its repetition reads: the bench's length-matched quality figure
# (bench/personalization), so the gate guards what the quality target measures. Thirty-two
# new tokens of SmolLM2 are ~20-25 words.
REPETITION_WORDS = 16
# Base-model repetition figures kept (one per recent prompt).
BASE_REPLIES_KEPT = 256
# Base-model logprobs of held-out turns kept (NEXTSTATE_HELD_OUT_MAX per user, several users).
BASE_HELD_OUT_KEPT = 4096
# What one gate read keeps of the prompts it read, for the next of them that shares a start.
GATE_KV_BYTES = 1 << 30
# The gate reads the general-text probe this many passages at a time, and stops once the
# forgetting's upper bound (PROBE_Z standard errors of the passages read) is inside its limit.
PROBE_STEP = 15
PROBE_Z = 3.0


@dataclass
class GateFigures:
    """What one version scores on the gate's held-out samples and prompts."""

    liked_logprob: float | None  # mean per-token logprob of held-out rewarded replies
    repetition: float | None  # mean share of repeated words in the gate's replies (first REPETITION_WORDS)
    version: VersionFigures | None = None  # gain, kl and forgetting on the scope's held-out turns (learner/held_out.py)
    empty: float | None = None  # mean chance that a reply ends at its first token


@dataclass
class Replies:
    """Replies generated for the gate, and per prompt the chance of an empty reply."""

    ids: list[list[int]]
    empty: list[float]


def mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


# In Chinese and Japanese, written without spaces, each Han character or kana counts as a word
# (a morpheme or a syllable): a reply would otherwise be one "word" and go unchecked. Thai and
# other unspaced alphabets are not split: their characters are letters, which repeat by nature.
_UNSPACED = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_WORD = re.compile(f"[{_UNSPACED}]|[^\\s{_UNSPACED}]+")
# Punctuation around a word, including the full-width marks of those scripts.
_AROUND = ".,;:!?()\"'*\u3001\u3002\uff01\uff0c\uff1a\uff1b\uff1f\u300c\u300d\uff08\uff09"


def split_words(text: str) -> list[str]:
    """The words `repetition` counts: split at spaces, and each Han character or kana apart."""
    return _WORD.findall(text)


def repetition(text: str, words: int | None = None) -> float | None:
    """Share of the reply's words (its first `words`, with a number) that repeat an earlier one,
    case and surrounding punctuation aside; None under 4 words. The gate reads REPETITION_WORDS,
    since longer replies repeat more ("the", "a") without degenerating, and a wish that
    lengthens replies would read as repetition; the bench reads whole replies as well. In a
    script written without spaces each character counts as a word (`_UNSPACED`)."""
    found = split_words(text)
    cut = found[:words] if words is not None else found
    kept = [w for w in (w.strip(_AROUND).lower() for w in cut) if w]
    return 1 - len(set(kept)) / len(kept) if len(kept) >= 4 else None


class Readings:
    """The gate's and the held-out readings of `trainer`'s weights, with the base model's side
    of each kept."""

    def __init__(self, trainer: LoraTrainer) -> None:
        self.trainer = trainer
        # per prompt: each base reply's repetition, and the chance of an empty reply
        self._base_replies: OrderedDict[tuple, tuple[list[float | None], float]] = OrderedDict()
        # the base model's side of the held-out figures: per sample id, and the probe
        self._base_held_out: OrderedDict[int, torch.Tensor] = OrderedDict()
        # per passage of the probe, in `_probe_order`: NLL summed and tokens (read ahead in parts)
        self._base_probe: list[tuple[float, int]] = []
        self._probe: list[list[int]] | None = None
        self._everyday: list[list[int]] | None = None  # the gate's shipped prompts, rendered once

    # ---------------------------------------------------------------- what a version gained and forgot

    def version_figures(self, scope: str, held_out: list[Sample], probe: bool = True,
                        max_forgetting: float | None = None) -> VersionFigures:
        """The scope's weights as they are now, scored on `held_out` and (`probe`) the
        general-text probe (learner/held_out.py). The gate scores the serving version without
        the probe: its forgetting is compared with nothing, and the probe is most of the cost.
        With `max_forgetting` (the gate's limit) the probe stops once its passages so far put
        the forgetting clearly inside it (`_probe_nll`)."""
        t = self.trainer
        t._activate(scope)
        t.model.eval()
        at_base = t._at_base(scope)
        with torch.no_grad():
            now = t._logprobs_each(held_out) if held_out and not at_base else []
            base: list[torch.Tensor | None] = [self._base_held_out.get(s.id) if s.id is not None else None for s in held_out]
            missing = [i for i, b in enumerate(base) if b is None]
            if missing:
                with t._base_model():
                    for i, lp in zip(missing, t._logprobs_each([held_out[i] for i in missing])):
                        base[i] = lp
                        if held_out[i].id is not None:
                            self._base_held_out[held_out[i].id] = lp
            probe_nll = base_nll = None
            if probe:
                self.base_probe_ahead()  # what the read-ahead left
                probe_nll, base_nll = self._probe_nll(max_forgetting, at_base)
            moves = self._hint_moves(held_out, at_base)
        if at_base:
            now = [b for b in base if b is not None]  # every one filled above
        while len(self._base_held_out) > BASE_HELD_OUT_KEPT:
            self._base_held_out.popitem(last=False)
        return held_out_figures(held_out, now, base, probe_nll, base_nll, moves)  # type: ignore[arg-type]

    def _hint_moves(self, held_out: list[Sample], at_base: bool = False) -> list[HintMove | None]:
        """Per held-out turn with a teacher's prompt (a hint or correction): the hinted base
        model's top K at each response position, the base model's log-probabilities of them
        without the hint (both computed once and kept), and the active weights' (the `wish`
        figure, learner/held_out.py; the base model's again while they are `at_base`); None for
        the others."""
        todo = [i for i, s in enumerate(held_out) if s.teacher_prompt_ids and s.id is not None]
        if not todo:
            return [None] * len(held_out)
        kept = self.trainer._base_sides(held_out, todo)  # kept by sample id, as a training target's are
        version = ({i: unhinted for i, (_, _, unhinted) in kept.items()} if at_base
                   else self.trainer._gathered(held_out, todo, {i: ids for i, (ids, _, _) in kept.items()}))
        return [HintMove(kept[i][1], kept[i][2], version[i]) if i in kept else None for i in range(len(held_out))]

    def base_probe_ahead(self, stop: Callable[[], bool] = lambda: False) -> bool:
        """The base model's side of the general-text probe, PROBE_STEP passages at a time until
        `stop()`; whether all of it is read. It never changes, and the first check in a process
        read it after the update, on the way to the version: 10-20 s of two cores (60 passages,
        ~5k tokens); now the learner reads it while a batch fills (learner/gate.py `read_ahead`)."""
        order = self._probe_order()
        if len(self._base_probe) < len(order):
            with torch.no_grad(), self.trainer._base_model():
                while len(self._base_probe) < len(order) and not stop():
                    self._base_probe += self._probe_nlls(order[len(self._base_probe): len(self._base_probe) + PROBE_STEP])
        return len(self._base_probe) == len(order)

    def _probe_order(self) -> list[int]:
        """The probe's passages in a fixed shuffled order, so that any first part of it is a fair
        sample of the whole (the file keeps passages of a kind together)."""
        if self._probe is None:
            self._probe = self.trainer._encoded(probe_passages())
        order = list(range(len(self._probe)))
        random.Random(0).shuffle(order)
        return order

    def _probe_nll(self, max_forgetting: float | None, at_base: bool = False) -> tuple[float, float]:
        """Mean NLL per token of the general-text probe under the active weights and under the
        base model, over the same passages: all of them, or, with `max_forgetting`, the first
        PROBE_STEP at a time until the forgetting plus PROBE_Z standard errors of the passages
        read (paired with the base model's, a ratio estimate) is under it. A version far inside
        the limit, as an agent-size update's is (forgetting −0.1%), is known from a quarter of
        the probe (6 s instead of 25 on two cores: docs/benchmark-log.md, ninth issue-76 pass);
        one near it is read whole."""
        base = self._base_probe
        order, total = self._probe_order(), len(base)
        assert total == len(order), "the base model's side is read first (`base_probe_ahead`)"
        step = PROBE_STEP if max_forgetting is not None else total
        read: list[tuple[float, int]] = [] if not at_base else list(base)
        while len(read) < total:
            read += self._probe_nlls(order[len(read): len(read) + step])
            if len(read) < total and self._inside(read, base, max_forgetting):
                break
        tokens = sum(n for _, n in read)
        return sum(v for v, _ in read) / tokens, sum(v for v, _ in base[: len(read)]) / tokens

    @staticmethod
    def _inside(read: list[tuple[float, int]], base: list[tuple[float, int]], limit: float | None) -> bool:
        """Whether the passages read put exp(ΔNLL + PROBE_Z·SE) − 1 under `limit`."""
        n = len(read)
        if limit is None or n < 2:
            return False
        tokens = sum(t for _, t in read)
        diffs = [v - b for (v, _), (b, _) in zip(read, base)]
        shift = sum(diffs) / tokens
        spread = sum((d - shift * t) ** 2 for d, (_, t) in zip(diffs, read)) * n / (n - 1)
        return math.exp(shift + PROBE_Z * math.sqrt(spread) / tokens) - 1 < limit

    def _probe_nlls(self, passages: list[int]) -> list[tuple[float, int]]:
        """Each of the probe's `passages` (indices, in `_probe_order`): its NLL summed over its
        tokens under the active weights (no grad), and how many tokens."""
        t = self.trainer
        assert self._probe is not None
        chosen = [self._probe[i] for i in passages]
        out: list[tuple[float, int]] = [(0.0, 0)] * len(chosen)
        for group in micro_batches([ids[:-1] for ids in chosen], t._pass_tokens):
            rows = [chosen[i] for i in group]

            def at(logits: torch.Tensor, i: int, part: slice) -> torch.Tensor:
                return token_logprobs(logits, torch.tensor(rows[i][1:], device=t.device)[part], 1.0)

            for i, pieces in zip(group, t._over_responses([r[:-1] for r in rows], [len(r) - 1 for r in rows], at)):
                scores = torch.cat(pieces)
                out[i] = (-float(scores.sum()), scores.numel())
        return out

    # ---------------------------------------------------------------- the publish gate's replies

    def gate_figures(self, scope: str, liked: list[Sample], prompts: list[list[int]], max_new: int) -> GateFigures:
        """The scope's current weights scored as learner/gate.py says."""
        t = self.trainer
        t._activate(scope)
        t.model.eval()
        with torch.no_grad():
            per_token = [float(lp.mean()) for lp in t._logprobs_each(liked)] if liked else []
        if t._at_base(scope):  # the base model's replies, answered once for the gate's base side too
            repeats, empty = self.base_figures(prompts, max_new)
            return GateFigures(mean(per_token), repeats, empty=empty)
        replies = self.sampled(prompts, max_new, GATE_SAMPLED_REPLIES)
        return GateFigures(mean(per_token), mean([self._repetition(r) for r in replies.ids]), empty=mean(replies.empty))

    def base_ahead(self, prompts: list[list[int]], max_new: int, stop: Callable[[], bool] = lambda: False) -> int:
        """`base_figures` of the prompts not kept yet, read ahead of the check that needs them, a
        prompt at a time until `stop()`. Returns how many were answered."""
        answered = 0
        for prompt in [p for p in prompts if _reply_key(p, max_new) not in self._base_replies]:
            if stop():
                break
            self.base_figures([prompt], max_new)
            answered += 1
        return answered

    def base_figures(self, prompts: list[list[int]], max_new: int) -> tuple[float | None, float | None]:
        """The base model's repetition and chance of an empty reply on these prompts; the base
        never changes, so each prompt is answered once."""
        keys = [_reply_key(p, max_new) for p in prompts]
        missing = [(k, p) for k, p in zip(keys, prompts) if k not in self._base_replies]
        if missing:
            n = GATE_SAMPLED_REPLIES  # a prompt's sampled replies count one each in the mean
            with self.trainer._base_model():
                answer = self.sampled([p for _, p in missing], max_new, n)
            per_prompt = [([self._repetition(r) for r in answer.ids[j * n:(j + 1) * n]], empty)
                          for j, empty in enumerate(answer.empty)]
            self._base_replies.update((key, figures) for (key, _), figures in zip(missing, per_prompt))
        repeats = mean([v for k in keys for v in self._base_replies[k][0]])
        empty = mean([self._base_replies[k][1] for k in keys])
        for key in keys:
            self._base_replies.move_to_end(key)
        while len(self._base_replies) > BASE_REPLIES_KEPT:
            self._base_replies.popitem(last=False)
        return repeats, empty

    def _repetition(self, reply: list[int]) -> float | None:
        """A gate reply's repetition, read in words as learner/gate.py says."""
        return repetition(self.trainer._chat().tokenizer.decode(reply, skip_special_tokens=True), REPETITION_WORDS)

    def sampled(self, prompts: list[list[int]], max_new: int, n: int) -> Replies:
        """`n` replies to each prompt sampled at temperature 1 (`ids`: a prompt's n together, in
        the prompts' order), each from a random stream seeded by the prompt and the reply's index
        alone (learner/seeded_sampling.py): the same draws for every weights asked, whatever else
        runs or shares the batch (common random numbers), with each prompt's chance of an empty
        reply. Prompts go in left-padded batches of similar lengths: eight everyday questions
        padded to an agent prompt's 2k tokens cost as much as four more agent prompts."""
        ids: list[list[list[int]]] = [[] for _ in prompts]
        empty: list[float] = [0.0] * len(prompts)
        for group in length_groups([len(p) for p in prompts]):
            replies = self._sampled_batch([prompts[i] for i in group], max_new, n)
            for k, i in enumerate(group):
                ids[i], empty[i] = replies.ids[k * n:(k + 1) * n], replies.empty[k]
        return Replies([reply for replies in ids for reply in replies], empty)

    def _sampled_batch(self, prompts: list[list[int]], max_new: int, n: int) -> Replies:
        t = self.trainer
        model = t.model if t.model is not None else t._base
        pad = pad_id(model)
        rows = [p[-t.settings.max_train_tokens:] for p in prompts for _ in range(n)]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=t.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=t.device)
        noise = LogitsProcessorList([SeededGumbel([row_seed(p, j) for p in prompts for j in range(n)], width)])
        read = {}
        if width > 1:
            read["past_key_values"] = self._read_once(model, rows[::n], width, n)
        with torch.no_grad(), warnings.catch_warnings():
            # transformers 5 renames generate's past_key_values to `cache`; 4.56-4.x, which
            # pyproject allows, know only the old name
            warnings.filterwarnings("ignore", message="`past_key_values` is deprecated", category=FutureWarning)
            generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                       do_sample=False, use_cache=True, pad_token_id=pad, logits_processor=noise,
                                       return_dict_in_generate=True, output_logits=True, **read)
        empty = _empty_chance(model, generated.logits[0][::n])  # a prompt's rows share their first step
        return Replies([_until_stop(model, row) for row in generated.sequences[:, width:].tolist()], empty)

    def _read_once(self, model: torch.nn.Module, prompts: list[list[int]], width: int, replies: int) -> Any:
        """The KV cache of each prompt but its last token, left-padded to `width` - 1, read once
        and repeated for each of its `replies`: reading an agent's prompt once per reply doubled
        the sampled gate check's prefill on a CPU. Each prompt is read alone, from the longest
        prefix an earlier one of them shares with it (an agent's turns share its system prompt
        and conversation: four OpenClaw prompts are 4.5k tokens read, not 16k); its positions
        start at 0 as generate gives them from the mask, so the replies are a full read's. The
        base model's reads go through the keys and values it keeps (`_base_kv`, which never go
        stale): a new scope's first update then finds the agent's prompts the gate read for
        its serving side, and its teacher reads only the hints and replies. The adapter's reads
        go through the prompt prefixes kept at its weights (learner/prompt_prefix.py): right
        after an update, the candidate's prompts begin with what its last pass read."""
        if any(len(p) < 2 for p in prompts):
            return None  # a one-token prompt has nothing to read first: generate reads them all
        t = self.trainer
        # the adapter's reads hold until its weights change; the base model's never go stale
        if _adapter_on(model):
            kept = t._prefixes.kept
        else:
            kept = t._base_kv if t._base_kv.budget > 0 else PrefixCache(GATE_KV_BYTES)
        base = self.trainer._base
        rows = [kv_cache.pad_left(read_through(kept, model, p[:-1], named_by=base), width - len(p)) for p in prompts]
        return kv_cache.to_cache(tuple((k.repeat_interleave(replies, 0), v.repeat_interleave(replies, 0))
                                       for k, v in kv_cache.stack(rows)))

    def everyday_prompts(self, n: int) -> list[list[int]]:
        """The first `n` shipped everyday questions as chat prompts of this model, for the gate's
        repetition check where a scope has too few prompts of its own (learner/gate.py)."""
        if self._everyday is None:
            self._everyday = [self.trainer._chat().render([{"role": "user", "content": q}]).ids
                              for q in shipped_lines("everyday_questions.txt")]
        return self._everyday[:n]


def _reply_key(prompt: list[int], max_new: int) -> tuple:
    """What a base reply is kept under: a digest, since prompts run to thousands of tokens."""
    return hash(tuple(prompt)), len(prompt), max_new


def _adapter_on(model: torch.nn.Module) -> bool:
    """Whether `model`'s LoRA layers apply their adapter now: off (peft's `disable_adapter()`,
    however it was entered) or with no adapter at all, it is the base model reading."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    return bool(layers) and not any(m.disable_adapters for m in layers)


def _until_stop(model: torch.nn.Module, row: list[int]) -> list[int]:
    """A generated row cut after its stop token (rows that finished early are padded out)."""
    stops = set(stop_ids(model))
    return row[:next((i + 1 for i, t in enumerate(row) if t in stops), len(row))]


def _empty_chance(model: torch.nn.Module, first_logits: torch.Tensor) -> list[float]:
    """Per row, the stop tokens' share of the first token's distribution at temperature 1: the
    chance that a sampling client is served an empty reply. Read from the generation's own
    first step, so it costs nothing, and a probability, so it sees what a handful of replies
    cannot (a version that ends one reply in twenty before it begins)."""
    stops = stop_ids(model)
    if not stops:
        return [0.0] * first_logits.shape[0]
    return torch.softmax(first_logits.float(), dim=-1)[:, stops].sum(-1).tolist()
