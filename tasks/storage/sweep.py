"""Delete the objects of a committed shard that its marker does not name (docs/architecture.md §10).

Orphans are staged segments of calls that crashed before their ledger record, ledger files
of dead or losing attempts that were not adopted (compacted files of an attempt that died before
its marker among them), the small ledger files whose rows the committing attempt rewrote into
compacted files (``LedgerWriter.commit``), and temp files of crashed local writes (only
once they are :data:`TEMP_GRACE_SECONDS` old: a younger one may belong to a live writer of
another attempt, mid-write). Only a committed shard is swept: before its marker exists, every
object may still be adopted. The marker itself, every object it names and every attempt's claim
(``_CLAIM.json``: who ran the attempt, kept for ``status`` and post-mortems) are never deleted.
Two sweeps of one shard may run at once: an orphan already deleted by the other is fine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tasks import layout
from tasks.errors import UncommittedShardError
from tasks.storage.claims import is_claim_path
from tasks.storage.marker import read_marker
from tasks.storage.objects import ObjectStore, is_temp_file

TEMP_GRACE_SECONDS = 3600.0


@dataclass(frozen=True)
class SweepReport:
    """What a sweep found: ``orphans`` (deleted unless ``dry_run``) and what it ``kept``: named objects and claims."""

    shard: int
    orphans: tuple[str, ...]
    kept: tuple[str, ...]
    dry_run: bool

    @property
    def deleted(self) -> tuple[str, ...]:
        return () if self.dry_run else self.orphans


def sweep_orphans(store: ObjectStore, shard: int, *, dry_run: bool = False) -> SweepReport:
    """Delete every object under the shard's staging and ledger directories that its marker does not name.

    Attempt claims are kept whether or not their attempt committed.

    ``store`` is rooted at the batch directory. Raises :class:`UncommittedShardError` when the
    shard has no marker. With ``dry_run`` nothing is deleted; the report lists what would be.
    """
    marker = read_marker(store, shard)
    if marker is None:
        raise UncommittedShardError(f"shard {shard} has no commit marker; refusing to sweep its objects")
    named = {f.path for f in marker.files} | {marker.path}
    present = [
        path
        for directory in (layout.staging_shard_dir(shard), layout.ledger_shard_dir(shard))
        for path in store.list_files(directory)
        if path.startswith(directory + "/")
    ]
    kept = tuple(sorted(p for p in present if p in named or is_claim_path(p, shard)))
    young_temp = {p for p in present if is_temp_file(p) and _age(store, p) < TEMP_GRACE_SECONDS}
    orphans = tuple(sorted(set(present) - set(kept) - young_temp))
    if not dry_run:
        for path in orphans:
            try:
                store.delete(path)
            except FileNotFoundError:
                continue  # another sweep, or the write that owned a temp file, removed it first
    return SweepReport(shard=shard, orphans=orphans, kept=kept, dry_run=dry_run)


def _age(store: ObjectStore, path: str) -> float:
    try:
        return time.time() - store.modified_at(path)
    except FileNotFoundError:
        return 0.0
