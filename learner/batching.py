"""Which ready samples of a scope make the next update — or what the scope is waiting for.

A person who rates four replies and sees nothing happen needs to be told why. So choosing a
batch answers either with the batch or with a `Waiting`: the reason in a word, and in a
sentence what would release it, which `nextstate status`, `/v1/admin/progress` and the
dashboard show.

Two rules keep one person's feedback from steering a shared adapter, everyone's model: a batch
holds samples of at least `shared_min_contributors` users (2 by default: a lone rater waits for
a second), and no user fills more than `max_user_share` of it. The cap counts as "other users"
only those who are training the adapter — with samples waiting, or trained within
`RECENT_USER_S` — never someone who merely holds a key: an admin key made for the dashboard, or
a colleague's idle key, stalled a lone user's training for good.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from nextstate.core.stores.samples import SampleStore
from nextstate.core.settings import LearnerSettings
from nextstate.core.types import Sample

# A user whose samples were trained this recently still counts as training the shared adapter.
RECENT_USER_S = 3600.0


@dataclass(frozen=True)
class Waiting:
    scope: str
    reason: str  # batch_wait, min_batch, partial_off, user_share, contributors; the learner's own: memory (a step did not fit), unpublished (an update was not published)
    detail: str  # what it waits for, and what would release it
    ready: int  # ready samples of the scope

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_batch(
    scope: str, ready: list[Sample], settings: LearnerSettings, training_users: set[str], now: float | None = None,
) -> list[Sample] | Waiting | None:
    """The batch to train now (oldest first), what the scope waits for, or None when nothing
    of it is ready. `training_users`: who trains this scope's adapter (the share cap's "others")."""
    if not ready:
        return None
    now = time.time() if now is None else now
    size, share = settings.batch_size, settings.max_user_share
    users = training_users | {x.user for x in ready}
    capped = scope == "shared" and share < 1 and len(users) > 1
    cap = max(1, math.ceil(share * size)) if capped else size
    taken: dict[str, int] = {}
    batch: list[Sample] = []
    for sample in ready:
        if taken.get(sample.user, 0) < cap:
            taken[sample.user] = taken.get(sample.user, 0) + 1
            batch.append(sample)
            if len(batch) == size:
                break
    needed = settings.shared_min_contributors if scope == "shared" else 1
    if len(taken) < needed:  # the cap bounds a share; this, that nobody moves everyone's model alone
        who = ", ".join(sorted(taken))
        detail = (f"every ready sample is {who}'s; a shared adapter trains on batches of at least {needed} users' "
                  "samples, so that no one moves everyone's model alone (NEXTSTATE_SHARED_MIN_CONTRIBUTORS; a "
                  "personal model per user: NEXTSTATE_ADAPTER_SCOPE=user)")
        return Waiting(scope, "contributors", detail, len(ready))
    if len(batch) == size:
        return batch
    oldest = min(x.created_at for x in batch)
    waited = settings.batch_wait_s > 0 and now - oldest >= settings.batch_wait_s
    within_share = not capped or max(taken.values()) <= share * len(batch)
    if len(batch) >= settings.min_batch_size and waited and within_share:
        return batch
    if capped and (len(batch) < len(ready) or not within_share):
        top = max(taken, key=lambda u: taken[u])
        others = sorted(users - {top})
        detail = (f"{top}'s samples may fill at most {share:.0%} of a shared batch while other users train this "
                  f"adapter ({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}); it trains once their samples "
                  "arrive. A personal model per user: NEXTSTATE_ADAPTER_SCOPE=user; no cap: NEXTSTATE_MAX_USER_SHARE=1.")
        return Waiting(scope, "user_share", detail, len(ready))
    if len(batch) < settings.min_batch_size:
        if settings.min_batch_size >= size:  # no partial batch is smaller than a full one (the defaults: 4 and 4)
            detail = f"{len(batch)} sample(s) ready; an update needs {size} (NEXTSTATE_BATCH_SIZE)"
        else:
            detail = (f"{len(batch)} sample(s) ready; an update needs {size}, or at least {settings.min_batch_size} "
                      f"once the oldest has waited {settings.batch_wait_s:g} s (NEXTSTATE_MIN_BATCH_SIZE)")
        return Waiting(scope, "min_batch", detail, len(ready))
    if settings.batch_wait_s <= 0:
        detail = f"{len(batch)} of {size} samples ready; partial batches are off (NEXTSTATE_BATCH_WAIT_S=0)"
        return Waiting(scope, "partial_off", detail, len(ready))
    remaining = settings.batch_wait_s - (now - oldest)
    detail = (f"{len(batch)} of {size} samples ready; they train as a partial batch once the oldest has waited "
              f"{settings.batch_wait_s:g} s, in {max(0.0, remaining):.0f} s (NEXTSTATE_BATCH_WAIT_S)")
    return Waiting(scope, "batch_wait", detail, len(ready))


def ready_by_scope(
    store: SampleStore, settings: LearnerSettings, per_user: bool, now: float | None = None,
) -> list[tuple[str, list[Sample], set[str]]]:
    """Each scope with ready samples: (scope, its ready samples oldest first, who trains its
    adapter besides the samples' own users: the share cap's "others", shared scope only)."""
    if per_user:
        return [(user, store.ready_samples(n, user), set()) for user, n in store.ready_counts_by_user().items()]
    now = time.time() if now is None else now
    return [("shared", store.ready_samples(settings.batch_size * 50), store.training_users(now - RECENT_USER_S))]


def waiting_in_store(store: SampleStore, settings: LearnerSettings, per_user: bool, now: float | None = None) -> list[Waiting]:
    """What each scope waits for as the sample store stands (`nextstate status` on the data dir,
    server running or not): the learner's own choice, before it screens stale or overlong
    samples out."""
    choices = (choose_batch(scope, ready, settings, users, now) for scope, ready, users in
               ready_by_scope(store, settings, per_user, now))
    return [c for c in choices if isinstance(c, Waiting)]
