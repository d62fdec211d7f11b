"""The guards of a receipted rollout, and how they combine with its chain's verdict (docs/architecture.md §8).

Guards are what the receipt and the failure rows say on their own: a receipt that contradicts
its manifest, a failed or poisoned rollout, a failure row on its chain. A guard's reason wins
over the chain's and its staged rows' reasons, but a rollout whose chain verified keeps its
linearized tokens even when a guard rejects it (its row is masked, not emptied).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tasks.capture import terminal
from tasks.finalize import reasons as r
from tasks.records.ledger import FailureRow, Receipt

# Failure rows with this reason poison a rollout only when the failed call is on its chain.
OFF_CHAIN_TOLERATED_FAILURE = "request_finished_without_staged_coordinates"
# Poisoned receipts carrying one of these keep it; any other poisoned receipt is capture_poisoned.
RECEIPT_REASONS = frozenset((*r.TERMINAL_REASONS, r.NO_REWARD))


def rollout_verdict(
    receipt: Receipt,
    manifest_size: int,
    chain_reason: str | None,
    failures: Sequence[FailureRow],
    chain_call_ids: Callable[[], set[str]],
    staged: int | str,
) -> tuple[str | None, int]:
    """(reason, linearized chain or -1) of a receipted rollout; guards win over the chain and its rows.

    ``chain_reason`` is why the manifest gives no chain (None: it does); ``staged`` is the chain's
    linearization index, or the reason its staged rows failed; ``chain_call_ids`` returns the
    chain's call ids (asked only when there are failure rows).
    """
    guard = _receipt_reason(receipt, manifest_size)
    if chain_reason is not None:
        return guard or chain_reason, -1
    if guard is None and failures:
        guard = _failure_reason(failures, chain_call_ids())
    if isinstance(staged, str):
        return guard or staged, -1
    return guard, staged


def _receipt_reason(receipt: Receipt, manifest_size: int) -> str | None:
    """What the receipt alone says: inconsistent with its manifest, failed, or poisoned."""
    if receipt.num_calls != manifest_size:
        return r.INVALID_RECEIPT
    if receipt.status == "ok" and receipt.terminal_attribution_reason != terminal.SELECTED:
        return r.INVALID_RECEIPT
    if receipt.status == "failed":
        return r.ROLLOUT_FAILED
    if receipt.status == "poisoned":
        return receipt.failure_reason if receipt.failure_reason in RECEIPT_REASONS else r.CAPTURE_POISONED
    return None


def _failure_reason(failures: Sequence[FailureRow], chain_call_ids: set[str]) -> str | None:
    """Failure rows poison the rollout, except a tolerated reason on a call off the chain."""
    for failure in failures:
        if failure.reason != OFF_CHAIN_TOLERATED_FAILURE or failure.call_id in chain_call_ids:
            return r.CAPTURE_POISONED
    return None
