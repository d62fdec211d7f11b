"""The ``rollout-ledger`` command: one sub-command per stage. Scripts depend on it; keep it stable.

Exit codes: 0 done; 1 failed (a validation suite failed the batch, publish was refused, the engine
died, an unexpected error); 2 a
usage or input error (bad flags, config, environment, model, unreadable storage, a review decision
without a reason: fix the command); 3 a conflict with what storage already holds (a batch planned
differently, a model whose hashes differ from the plan, data that fails an integrity check, a
decision on a batch already decided otherwise); 128+N stopped by signal N (completed
work is kept; run the command again). stdout carries the result, stderr the progress and errors.
S3 settings come from the standard AWS environment variables (``AWS_ENDPOINT_URL``, ...).

Modules: ``flags`` and ``context`` (what commands share: flag parsing; storage, lineage and
messages), one module per group of commands (``plan``, ``generate``, ``dataset``: finalize,
validate, publish; ``batches``: status, sweep, demo; ``servers``: serve, refit), and ``main``
(the parser and dispatch; the exit codes come from :mod:`tasks.entry_point`). Each command module
reaches the library only; no other part of ``tasks`` imports this package.
"""
