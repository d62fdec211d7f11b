"""Verification of committed shards, step by step (docs/architecture.md §8).

``shard`` reads a shard and combines the verdicts; ``chains`` finds each receipt's chain in its
manifest; ``fetch`` reads the chains' staged rows, each segment once; ``staged_rows`` checks
those rows and linearizes them; ``guards`` applies what receipts and failure rows say;
``verdicts`` holds the result, one verdict per planned rollout, as columns.
"""
