"""The batch's overview page, ``reports/index.html``: what people read before a dataset goes to training.

One self-contained HTML page: the batch's headline numbers; pass / warn / fail of each validation
suite's current run, with links to its Data Docs (``lineage/run-NNN/index.html``, relative to the
page) and to each table's validation result page; the expectations that failed or warned with
their examples; the off-policy gate's figures (ratios over the kept set and the full vocabulary,
kept mass, peers' shares, staleness, NaN and missing-mask counts, thresholds) with a token view of
each row it flags, every flagged figure linking to its rows (:mod:`tasks.report.off_policy`); and
plots drawn as inline SVG: rewards per group, turns and sequence lengths, failure reasons,
weight-version spread and the logprob audit's differences. A suite that has not run, or a dataset
not built yet, shows as "not run".

Reading is apart from drawing: :func:`~tasks.report.gather.gather_report` reads the batch into
plain figures (:mod:`tasks.report.gather`), :mod:`tasks.report.charts` turns them into positioned
marks, and :func:`~tasks.report.render.render_report` renders the Jinja2 templates
(``templates/``), escaping every value.

Re-runs. The page changes after each validation run, but objects on the batch's storage are
created once. :func:`write_report_index` therefore writes the page twice: create-once under its
content address, ``reports/index-<sha256[:16]>.html`` (an immutable record of every distinct page
shown; a re-run that renders the same bytes is a no-op, since the page holds no clock time),
then the same bytes to ``reports/index.html``, the one object of the batch that is replaced:
atomically (:meth:`ObjectStore.replace`: a temp file, fsync and a rename on local disk; a single
whole-object PUT on S3), so a reader sees the old page or the new one, never a torn one. No stage
reads the page. Two runs racing leave the page of whichever replaced last; both versions stay.
"""

from __future__ import annotations

from tasks import layout
from tasks.batch import Batch
from tasks.report.gather import gather_report
from tasks.report.render import render_report
from tasks.storage.objects import sha256_hex

INDEX = layout.REPORTS_INDEX

__all__ = ["INDEX", "write_report_index"]


def write_report_index(batch: Batch) -> str:
    """Render the batch's overview page and write it (see the module docstring); returns ``reports/index.html``."""
    page = render_report(gather_report(batch)).encode("utf-8")
    store = batch.store
    store.write_once(f"{layout.REPORTS_DIR}/index-{sha256_hex(page)[:16]}.html", page)
    store.replace(INDEX, page)
    return INDEX
