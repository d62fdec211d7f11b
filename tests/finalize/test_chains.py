"""Each receipt's chain in its manifest, found column-wise for a whole shard: the chain or the reason it is refused.

The expected chain of every manifest shape is written out by hand from docs/architecture.md §7
and 8 (follow parents up from the receipt's terminal; duplicates, re-attribution, cycles and
missing parents are refused with their reason), and the manifests reach :func:`shard_chains`
interleaved as concurrent rollouts write them, next to rows no receipt commits.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from tasks.capture import terminal
from tasks.finalize import reasons as r
from tasks.finalize.verify.chains import ShardChains, shard_chains
from tasks.records.ledger import CallRecord, FailureRow, Receipt
from tasks.storage.ledger_reader import LedgerTables

from .hand_built import build_chain, failure, receipt_for

Manifest = list[CallRecord]


def rollout(index: int, turns: int = 3, attempt: int = 0) -> Manifest:
    """A linear chain of rollout ``index`` in ledger order, at staging rows of its own."""
    records = build_chain([(2, 1)] * turns, rollout_id=f"r{index:06d}-00", first_id=100 * index).records
    return [
        dataclasses.replace(c, call_id=c.call_id.replace(".a00.", f".a{attempt:02d}."), staging_row=10 * index + k)
        for k, c in enumerate(records)
    ]


def child_of(call: CallRecord, parent: CallRecord, **changes: object) -> CallRecord:
    """``call`` re-pointed at ``parent`` (a token_in child carrying its prefix)."""
    prev_len = parent.cum_len
    fields = {"parent_call_id": parent.call_id, "mode": "token_in", "prev_len": prev_len}
    return dataclasses.replace(call, **fields, cum_len=prev_len + call.delta_len, **changes)  # type: ignore[arg-type]


def sibling_retry(index: int) -> Manifest:
    """root, an abandoned child, then the retried child the rollout continued from."""
    root, child, _ = rollout(index)
    return [root, child, dataclasses.replace(child, call_id=child.call_id[:-3] + "009", staging_row=99)]


def cases() -> dict[str, tuple[Manifest, dict[str, object]]]:
    """Manifests (ledger order) and receipt overrides, one per shape the walk distinguishes."""
    c = {i: rollout(i) for i in range(1, 14)}
    return {
        "linear": (c[1], {}),
        "single_call": (rollout(2, turns=1), {}),
        "out_of_ledger_order": ([*c[3][1:], c[3][0]], {"terminal_call_id": c[3][2].call_id}),
        "duplicate_call_id": ([*c[4], c[4][-1]], {"num_calls": 4}),
        "shared_coordinates": ([*c[5][:2], dataclasses.replace(c[5][2], staging_row=c[5][1].staging_row)], {}),
        "repeated_id_on_a_linear_chain": (
            [*c[6][:2], child_of(c[6][0], c[6][1], staging_row=99)],
            {"terminal_call_id": c[6][0].call_id},
        ),
        "sibling_retry_declared": (sibling_retry(7), {}),
        "sibling_retry_heuristic": (sibling_retry(8), {"terminal_selection": "heuristic"}),
        "cycle": ([child_of(c[9][0], c[9][2]), *c[9][1:]], {}),
        "orphan": ([c[10][0], dataclasses.replace(c[10][1], parent_call_id="r999999-00.a00.c000")], {}),
        "heuristic_linear": (c[11], {"terminal_selection": "heuristic"}),
        "terminal_not_last": (c[12], {"terminal_call_id": c[12][1].call_id}),
        "terminal_not_in_manifest": (c[13], {"terminal_call_id": "r000013-00.a00.c077"}),
        "no_calls": ([], {"status": "failed", "failure_reason": "environment_error"}),
    }


def receipt(manifest: Manifest, index: int, **overrides: object) -> Receipt:
    rollout_id = manifest[0].rollout_id if manifest else f"r{100 + index:06d}-00"
    fields: dict[str, object] = {"rollout_id": rollout_id, "num_calls": len(manifest)}
    fields["terminal_call_id"] = manifest[-1].call_id if manifest else None
    if overrides.get("status") == "failed":
        fields |= {"terminal_call_id": None, "terminal_selection": None, "terminal_attribution_reason": None}
    return receipt_for(build_chain([(1, 1)], rollout_id=rollout_id), **(fields | overrides))


def interleaved(manifests: list[Manifest], rng: random.Random) -> Manifest:
    """The calls of every manifest, each manifest's in its order, interleaved as concurrent rollouts write them."""
    turns = [i for i, m in enumerate(manifests) for _ in m]
    rng.shuffle(turns)
    pending = [list(m) for m in manifests]
    return [pending[i].pop(0) for i in turns]


# case -> (reason, the chain as positions in the manifest, root→terminal): what the contract says.
EXPECTED: dict[str, tuple[str | None, list[int]]] = {
    "linear": (None, [0, 1, 2]),
    "single_call": (None, [0]),
    "out_of_ledger_order": (None, [2, 0, 1]),  # the root was written last
    "duplicate_call_id": (r.DUPLICATE_MANIFEST_CALL_ID, []),
    "shared_coordinates": (r.DUPLICATE_STAGING_KEY, []),
    "repeated_id_on_a_linear_chain": (r.DUPLICATE_MANIFEST_CALL_ID, []),
    "sibling_retry_declared": (None, [0, 2]),  # the abandoned child is off the chain
    "sibling_retry_heuristic": (terminal.AMBIGUOUS_TERMINAL, []),  # two childless children of the root
    "cycle": (r.LINEAGE_CYCLE, []),
    "orphan": (r.MISSING_PARENT, []),
    "heuristic_linear": (None, [0, 1, 2]),
    "terminal_not_last": (None, [0, 1]),
    "terminal_not_in_manifest": (r.MISSING_TERMINAL, []),
    "no_calls": (r.MISSING_TERMINAL, []),
}


def test_every_manifest_gets_the_chain_or_reason_the_contract_gives() -> None:
    shapes = cases()
    assert set(shapes) == set(EXPECTED)
    manifests = [manifest for manifest, _ in shapes.values()]
    receipts = [receipt(m, i, **overrides) for i, (m, overrides) in enumerate(shapes.values())]
    stray = rollout(50)  # a rollout without a receipt
    dead = rollout(1, attempt=1)  # the same rollout's rows from an attempt whose receipt is not committed
    ledger_order = interleaved([*manifests, stray, dead], random.Random(0))
    poisoned = failure(build_chain([(1, 1)], rollout_id="r000007-00"), "r000007-00.a00.c001", "staging_failed")
    tables = LedgerTables(
        calls=CallRecord.to_table(ledger_order),
        call_attempts=np.array([1 if ".a01." in call.call_id else 0 for call in ledger_order], np.int64),
        failures=FailureRow.to_table([poisoned]),
        failure_attempts=np.zeros(1, np.int64),
        receipts=Receipt.to_table(receipts),
    )
    found = shard_chains(tables, receipts)
    call_ids = tables.calls.column("call_id").to_pylist()
    for i, (name, manifest) in enumerate(zip(shapes, manifests, strict=True)):
        reason, positions = EXPECTED[name]
        chain = [call_ids[row] for row in found.receipt_rows(i)]
        assert (found.reasons[i], chain) == (reason, [manifest[k].call_id for k in positions]), name
        assert found.manifest_sizes[i] == len(manifest), name
        assert found.failures[i] == ((poisoned,) if name == "sibling_retry_declared" else ()), name


def independent_calls(index: int, calls: int = 3) -> Manifest:
    """A gateway agent's rollout under independent calls: every call a root of its own."""
    rollout_id = f"r{index:06d}-00"
    return [
        dataclasses.replace(
            build_chain([(2, 1)], rollout_id=rollout_id, first_id=100 * index + 10 * k).records[0],
            call_id=f"{rollout_id}.a00.c{k:03d}",
            staging_row=10 * index + k,
        )
        for k in range(calls)
    ]


def test_independent_calls_are_one_chain_each_and_only_when_the_batch_says_so() -> None:
    roots, linear = independent_calls(1), rollout(2)
    receipts = [receipt(roots, 0), receipt(linear, 1)]
    ledger_order = interleaved([roots, linear], random.Random(1))
    tables = LedgerTables(
        calls=CallRecord.to_table(ledger_order),
        call_attempts=np.zeros(len(ledger_order), np.int64),
        failures=FailureRow.to_table([]),
        failure_attempts=np.zeros(0, np.int64),
        receipts=Receipt.to_table(receipts),
    )
    call_ids = tables.calls.column("call_id").to_pylist()

    def chains_of(found: ShardChains, i: int) -> list[list[str]]:
        lo, hi = found.receipt_starts[i], found.receipt_starts[i + 1]
        return [[call_ids[r] for r in found.rows[found.starts[k] : found.starts[k + 1]]] for k in range(lo, hi)]

    independent = shard_chains(tables, receipts, independent=True)
    assert chains_of(independent, 0) == [[call.call_id] for call in roots]  # ledger order
    assert chains_of(independent, 1) == [[call.call_id for call in linear]]  # a linked rollout keeps its chain
    assert independent.reasons == [None, None]
    # the default message graph trains the declared terminal's chain: the last root alone
    assert chains_of(shard_chains(tables, receipts), 0) == [[roots[-1].call_id]]
