"""The records a batch is made of, as they are stored: one definition of each schema and its rules.

Ledger rows (staged deltas, call records, failure rows, receipts) with their digests, planned
rollouts, dataset rows, suite summaries and review decisions. Pure data: no storage access here
(:mod:`tasks.storage` reads and writes them).
"""
