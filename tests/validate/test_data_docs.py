"""Data Docs load nothing from the network: each asset GX's templates take from a CDN is vendored, named relatively."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import pyarrow as pa
import pytest

from tasks.validate.data_docs import SITE_VENDOR, VENDOR, VENDORED, localize
from tasks.validate.gx_run import run_gx_suite
from tasks.validate.suites import ExpectationSpec, SuiteSpec, TableSpec

from .page_assets import ABSOLUTE, external, resources

HOSTILE = "<img src=\"http://198.51.100.7/x\">vegaEmbed('#x')<script src=//198.51.100.7/s.js></script>"


def gx_templates() -> Path:
    import great_expectations

    return Path(great_expectations.__file__).parent / "render" / "view" / "templates"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The Data Docs of one suite run whose offending values carry markup that loads from elsewhere."""
    site_dir = tmp_path_factory.mktemp("data-docs")
    table = TableSpec("calls", "call_id", "call records")
    rules = (
        ExpectationSpec("unique", "calls", "expect_column_values_to_be_unique", {"column": "call_id"}, "warn", "x"),
        ExpectationSpec(
            "known",
            "calls",
            "expect_column_values_to_be_in_set",
            {"column": "call_id", "value_set": ["a"]},
            "fail",
            "y",
        ),
    )
    suite = SuiteSpec(name="lineage", tables=(table,), expectations=rules, rows_table="calls")
    results = run_gx_suite(
        suite, {"calls": pa.table({"call_id": ["a", HOSTILE, HOSTILE]})}, site_dir=site_dir, run_name="run-000"
    )
    assert not results["known"].success  # the hostile value is data, it fails no build
    return site_dir


def test_every_page_and_style_sheet_loads_its_assets_from_the_site_itself(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) == 3  # the index, the suite's expectations, its validation result
    for path in [*pages, *site.glob("static/styles/*.css")]:
        text = path.read_text()
        address = f"http://site.invalid/{path.relative_to(site).as_posix()}"
        for value in resources(text.replace(HOSTILE, "")):  # the planted value is data: GX shows it as is
            assert not ABSOLUTE.match(value), (path, value)
            if value.startswith(("data:", "#")):
                continue
            target = site / urlsplit(urljoin(address, value)).path.removeprefix("/")
            assert target.is_file(), (path, value)  # every relative asset exists, the favicon included
    index = (site / "index.html").read_text()
    assert f'<script src="{SITE_VENDOR}/jquery/jquery.min.js">' in index
    assert "integrity=" not in index and "crossorigin=" not in index and "vega" not in index


def test_every_cdn_address_in_gx_templates_is_vendored():
    """GX's templates name no asset from elsewhere that the table misses, and the table names no stale address."""
    named = set()
    for template in gx_templates().glob("*.j2"):
        named |= set(external(template.read_text()))
    ignored = {url for url in named if "cdn.jsdelivr.net/npm/vega" in url or "great-expectations-web-assets" in url}
    assert named - ignored == set(VENDORED)
    assert {"https://cdn.jsdelivr.net/npm/vega@5", "https://cdn.jsdelivr.net/npm/vega-lite@5"} <= ignored
    for path in VENDORED.values():
        assert (VENDOR / path).is_file(), path
    local = localize(
        (gx_templates() / "page.j2").read_text() + (gx_templates() / "js_script_imports.j2").read_text(), ""
    )
    assert not external(local)


def test_the_vendored_scripts_are_the_files_gx_pins_by_hash():
    pinned = dict(
        re.findall(r'src="([^"]+)" integrity="(sha384-[^"]+)"', (gx_templates() / "js_script_imports.j2").read_text())
    )
    assert len(pinned) == 2  # Popper and Bootstrap's script
    for url, integrity in pinned.items():
        data = (VENDOR / VENDORED[url]).read_bytes()
        assert "sha384-" + base64.b64encode(hashlib.sha384(data).digest()).decode() == integrity, url


def test_font_awesome_finds_its_fonts_and_every_package_keeps_its_license():
    css = (VENDOR / "fontawesome-free/css/all.min.css").read_text()
    for font in ("fa-solid-900", "fa-regular-400", "fa-v4compatibility"):
        assert f"url(../webfonts/{font}.woff2)" in css
        assert (VENDOR / "fontawesome-free/webfonts" / f"{font}.woff2").is_file()
    folders = {path.split("/", 1)[0] for path in VENDORED.values()}
    licensed = {path.parent.name for path in VENDOR.glob("*/LICENSE*")}
    assert folders - licensed == {"popper.js"}  # its license is the header of popper.min.js
    assert "Distributed under the MIT License" in (VENDOR / "popper.js/popper.min.js").read_text()[:200]


def test_the_index_shows_its_tables_without_scripts(site):
    """GX draws the index's lists from script data; the localized index has them as rows linking each page."""
    index = (site / "index.html").read_text()
    result = next(site.glob("validations/**/*.html")).relative_to(site).as_posix()
    results = index[index.index('class="table-sm ge-index-page-validation-results-table"') :]
    assert f'<a href="{result}">' in results.split("</table>")[0]  # the result's row links its page
    suites = index[index.index('class="table-sm ge-index-page-expectation_suites-table"') :].split("</table>")[0]
    assert '<a href="expectations/lineage/calls.html">' in suites and "<th>Expectation Suites</th>" in suites
    assert ".tab-pane { display: block !important" in index  # every tab's pane shows, one under the other
