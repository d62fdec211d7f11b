"""Validation stages: a lineage suite over the ledger and a dataset suite over the staged dataset (issue 10).

Both run Great Expectations Core over small Arrow-computed profiles and leave Data Docs and a
``summary.json`` per run under ``reports/{suite}/`` on the batch's storage. Importing this package
does not import Great Expectations (seconds to import): only a running suite does.
"""

from tasks.errors import NothingToValidateError
from tasks.records.suite_summary import SuiteSummary
from tasks.validate.stage import SuiteOutcome, validate_dataset, validate_lineage
from tasks.validate.suite_runs import read_suite_summary

__all__ = [
    "NothingToValidateError",
    "SuiteOutcome",
    "SuiteSummary",
    "read_suite_summary",
    "validate_dataset",
    "validate_lineage",
]
