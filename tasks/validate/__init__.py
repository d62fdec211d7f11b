"""Validation stages: a lineage suite over the ledger and a dataset suite over the staged dataset.

Both run Great Expectations Core over small Arrow-computed profiles and leave Data Docs and a
``summary.json`` per run under ``reports/{suite}/`` on the batch's storage. Importing this package
does not import Great Expectations (seconds to import): only a running suite does.
"""

from tasks.validate.stage import SuiteOutcome, validate_dataset, validate_lineage

__all__ = ["SuiteOutcome", "validate_dataset", "validate_lineage"]
