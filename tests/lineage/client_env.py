"""The CLI's lineage sink built under exactly the OpenLineage settings a test names, and nothing of the machine's."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import pytest

from tasks.lineage.emit import EventSink, NoLineage, sink_from_environment

SETTINGS = ("OPENLINEAGE", "AIRFLOW__OPENLINEAGE")


def sink_under(environ: Mapping[str, str], where: Path) -> EventSink | NoLineage:
    """:func:`sink_from_environment` with ``environ`` as the only OpenLineage settings, ``where`` (a folder with no
    ``openlineage.yml`` unless the test put one there) as working directory and home. What the client adds to
    the environment (it aliases ``OPENLINEAGE_URL``) is removed again."""
    before = set(os.environ)
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith(SETTINGS)]:
            patch.delenv(name)
        for name, value in {**environ, "HOME": str(where)}.items():
            patch.setenv(name, value)
        patch.chdir(where)
        try:
            return sink_from_environment()
        finally:
            for name in set(os.environ) - before - set(environ):
                del os.environ[name]
