"""Synthetic verified rollouts and their assembled rows for assembly, metrics, publish and collate tests."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import numpy as np

from tasks import ids, layout
from tasks.config import BatchConfig, ModelSpec
from tasks.finalize.assemble import AssembledRows, assemble_rows
from tasks.finalize.card import render_card
from tasks.finalize.weights import PlannedWeights
from tasks.records.dataset_row import CallSpan, DatasetRow, WeightSpan
from tasks.records.ledger import canonical_json
from tasks.records.sampling_mask import KeptSets
from tasks.sampling import SamplingSettings
from tasks.storage.dataset_manifest import DatasetMarker
from tasks.storage.marker import MarkedFile
from tasks.storage.objects import ObjectStore

from .verdicts import UNTRUNCATED, VerifiedRollout, columns_of

BATCH_ID = "batch-test"
UNVERIFIED_PLAN = PlannedWeights()  # planned version 0, its weights not verified: a call naming none names null
TRUNCATED = SamplingSettings(temperature=0.9, top_p=0.9, top_k=50)  # kept sets on every sampled token


def kept_sets_of(sampled: Sequence[int] | np.ndarray) -> KeptSets:
    """Synthetic kept sets: each sampled token with the one or two ids above it (sizes vary with the token)."""
    return KeptSets.of([range(int(t), int(t) + 1 + int(t) % 3) for t in sampled])


def make_rollout(
    task: int = 0,
    sample: int = 0,
    *,
    reward: float | None = 1.0,
    reason: str | None = None,
    calls: Sequence[tuple[int, int]] = ((4, 2), (3, 3)),
    versions: Sequence[int] | None = None,
    linearized: bool = True,
    truncated: bool = False,
    terminal_selection: str | None = "declared",
    epoch_span_count: int = 0,
    extras: Sequence[object] | None = None,
    kept: bool = False,
) -> VerifiedRollout:
    """A rollout of task ``task``: one (carry_len, gen_len) per call, tokens derived from the ids; ``extras``
    per call as the engine gave them (none given: null each); with ``kept``, each sampled token's kept set
    (:func:`kept_sets_of`), as a truncated batch's verified chain holds them."""
    rollout_id = ids.rollout_id(task, sample)
    base = {"batch_id": BATCH_ID, "group_id": ids.group_id(task), "rollout_id": rollout_id, "reward": reward}
    if not linearized:
        return VerifiedRollout(**base, reason=reason, terminal_selection=terminal_selection)
    versions = list(versions) if versions is not None else [0] * len(calls)
    rng = np.random.default_rng([task, sample])
    call_spans, weight_spans, masks = [], [], []
    start = 0
    for ordinal, ((carry, gen), version) in enumerate(zip(calls, versions, strict=True)):
        call = ids.call_id(rollout_id, 0, ordinal)
        call_spans.append(CallSpan(call_id=call, carry_len=carry, gen_len=gen))
        weight_spans.append(WeightSpan(call_id=call, start=start, end=start + carry + gen, weight_version=version))
        masks += [0] * carry + [1] * gen
        start += carry + gen
    mask = np.array(masks, np.uint8)
    logprobs = np.where(mask == 1, -rng.uniform(0.01, 5.0, mask.size), 0.0).astype(np.float32)
    input_ids = rng.integers(0, 50_000, mask.size).astype(np.int32)
    return VerifiedRollout(
        **base,
        reason=reason,
        input_ids=input_ids,
        loss_mask=mask,
        logprobs=logprobs,
        prompt_len=calls[0][0],
        call_spans=tuple(call_spans),
        weight_spans=tuple(weight_spans),
        extras_json=tuple(canonical_json(e) for e in extras) if extras is not None else (),
        truncated=truncated,
        num_turns=len(calls),
        terminal_selection=terminal_selection,
        epoch_span_count=epoch_span_count,
        kept=kept_sets_of(input_ids[mask == 1]) if kept else KeptSets.empty(),
    )


def planned_ids(task: int, group_size: int) -> list[str]:
    return [ids.rollout_id(task, s) for s in range(group_size)]


def batch_config(num_tasks: int = 3, group_size: int = 4, **options) -> BatchConfig:
    return BatchConfig(
        batch_id=BATCH_ID,
        environment="guess_number",
        num_tasks=num_tasks,
        group_size=group_size,
        shards=1,
        model=ModelSpec(reference="models/tiny"),
        **options,
    )


def mixed_rollouts(config: BatchConfig) -> dict[str, list[VerifiedRollout]]:
    """group id -> verified rollouts: task 0 all valid, task 1 poisoned + missing, later tasks alternating rewards."""
    groups: dict[str, list[VerifiedRollout]] = {}
    for task in range(config.num_tasks):
        verified = groups.setdefault(ids.group_id(task), [])
        for sample in range(config.group_size):
            if task == 1 and sample == 0:
                verified.append(make_rollout(task, sample, reason="capture_poisoned", terminal_selection="heuristic"))
            elif task == 1 and sample == 1:
                continue  # no receipt
            else:
                calls = ((4 + task, 2), (3, 1 + sample))
                verified.append(make_rollout(task, sample, reward=float((task + sample) % 2), calls=calls))
    return groups


def assemble(
    verified: Sequence[VerifiedRollout],
    *,
    task: int = 0,
    group_size: int = 4,
    weights: PlannedWeights = UNVERIFIED_PLAN,
    sampling: SamplingSettings = UNTRUNCATED,
    **options: str,
) -> AssembledRows:
    """The rows of task ``task``'s planned group (``group_size`` rollouts) from ``verified``, sampled with
    ``sampling``; ``weights`` the plan's (by default: planned version 0, its weights not verified)."""
    return assemble_rows(
        columns_of(BATCH_ID, verified, sampling),
        batch_id=BATCH_ID,
        planned={ids.group_id(task): planned_ids(task, group_size)},
        weights=weights,
        **options,
    )


def rows_of(assembled: AssembledRows) -> list[DatasetRow]:
    """The assembled rows as records, each checked against every invariant of :class:`DatasetRow`."""
    return DatasetRow.from_table(assembled.table)


def mixed_groups(config: BatchConfig) -> list[AssembledRows]:
    """The groups of :func:`mixed_rollouts`, assembled one by one."""
    return [
        assemble(
            verified, task=task, group_size=config.group_size, on_invalid=config.on_invalid, advantage=config.advantage
        )
        for task, verified in enumerate(mixed_rollouts(config).values())
    ]


def commit_by_hand(store: ObjectStore, staged: DatasetMarker) -> None:
    """Commit a staged dataset the way publish does, with passing outcomes (for tests of what reads it)."""
    outcomes = {"lineage": {"status": "passed", "warned": []}, "dataset": {"status": "passed", "warned": []}}
    card_text = render_card(
        batch_id=staged.batch_id,
        config=staged.config,
        metrics=json.loads(store.read_bytes(layout.DATASET_METRICS)),
        parts=[dataclasses.asdict(part) for part in staged.parts],
        validation=outcomes,
        review=None,
    )
    card = MarkedFile.of(store.write_once(layout.DATASET_CARD, card_text.encode()), kind="card", rows=0)
    committed = dataclasses.replace(staged, card=card, validation=outcomes)
    store.write_once(layout.DATASET_MARKER, committed.to_json().encode())
