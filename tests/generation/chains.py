"""Test helper: read a committed shard back and check every chain the way finalization will."""

from __future__ import annotations

import numpy as np

from tasks.records import digest as dg
from tasks.records.ledger import StagedDelta
from tasks.storage.ledger_reader import LedgerReader
from tasks.storage.objects import ObjectStore
from tasks.storage.staged_reader import StagedReader
from tasks.storage.staging import CommitCoordinates


def verified_sequences(store: ObjectStore, shard: int) -> dict[str, list[StagedDelta]]:
    """rollout id -> staged deltas root→terminal of every ok rollout, after checking each link.

    Checks: digests recompute; a child's prev_len is its parent's cum_len; chain hashes walk;
    cumulative hashes equal the hash of the concatenated deltas; masks are carry-then-sampled.
    """
    ledger = LedgerReader(store, shard)
    reader = StagedReader(store, segment_sha256=ledger.segment_sha256)
    chains: dict[str, list[StagedDelta]] = {}
    for bundle in ledger.rollouts():
        if bundle.receipt.status != "ok":
            continue
        by_id = {c.call_id: c for c in bundle.manifest}
        path = []
        call = by_id[bundle.receipt.terminal_call_id]
        while call is not None:
            path.append(call)
            call = by_id.get(call.parent_call_id) if call.parent_call_id else None
        path.reverse()
        deltas = reader.fetch_records(
            [(c.staging_key, CommitCoordinates(c.staging_segment, c.staging_row)) for c in path]
        )
        sequence = np.zeros(0, np.int64)
        parent_chain = None
        for record, delta in zip(path, deltas, strict=True):
            assert delta.digest == record.digest == delta.recompute_digest()
            assert delta.prev_len == sequence.size
            assert delta.chain_hash == dg.chain_hash(parent_chain, delta.token_ids_delta)
            sequence = np.concatenate([sequence, delta.token_ids_delta])
            assert delta.cumulative_hash == dg.hash_token_ids(sequence)
            mask = delta.token_mask_delta
            assert np.all(np.diff(mask) >= 0), "mask must be carried (0) then sampled (1)"
            parent_chain = delta.chain_hash
        chains[bundle.rollout_id] = deltas
    return chains


def linearized(deltas: list[StagedDelta]) -> np.ndarray:
    return np.concatenate([d.token_ids_delta for d in deltas])
