"""``python -m tasks.cli``: the ``rollout-ledger`` command."""

from tasks.cli.main import main

raise SystemExit(main())
