"""`rollout-ledger status`: what a batch holds, read from its storage alone.

The first thing a user runs when a batch looks wrong. Reading is apart from writing text:
:func:`~tasks.status.gather.batch_status` reads the batch into the records of
:mod:`tasks.status.model` (shards in :mod:`tasks.status.shards`, the suggested command in
:mod:`tasks.status.next_step`), and :func:`~tasks.status.render.render_status` turns them into
lines. Nothing here writes, renames or deletes, so status is safe against a batch whose shards
are being generated.
"""
