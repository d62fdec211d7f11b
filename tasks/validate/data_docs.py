"""Great Expectations Data Docs that load nothing from the network: GX's CDN assets, vendored.

GX 1.x's page templates load Bootstrap, jQuery, Popper, bootstrap-table, bootstrap-datepicker,
Font Awesome and bootstrap-dark from public CDNs, Vega from jsDelivr, and GX's logo from S3 (with
the data context's id in the query). :func:`localize_site` copies the vendored files
(``data_docs_vendor/``: versions, sources and licenses in its README) into the site's
``static/vendor/`` and rewrites every page and style sheet of the site to name them, and GX's own
``static/images/logo-long.png`` for the logo, by relative URL (and corrects GX's favicon link, one
level short on validation result pages). Vega is not vendored: no expectation of our suites draws a
chart (a page that did would show none), so its script tags are dropped. ``integrity`` and
``crossorigin`` attributes go too: the vendored files are the ones they name (tested). The viewer
runs no script in a report, so the site's index gets the tables its script would draw as HTML
(:func:`static_tables`); the other pages show their content without scripts.

Invariant: once localized, nothing GX's templates put in a page or style sheet loads an asset from
another host; links (``<a href>``) may still point anywhere. GX does not escape the values it
shows, so a page can carry whatever markup the data holds: the viewer's policy keeps such a page
from loading or sending anything (``tasks/orchestration/report_viewer.py``).
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

VENDOR = Path(__file__).with_name("data_docs_vendor")
SITE_VENDOR = "static/vendor"  # where the vendored files go in a site
LOGO = "static/images/logo-long.png"  # GX's own copy in every site, for the logos it loads from S3
# Each CDN address GX 1.x's templates use → the vendored file, below data_docs_vendor/.
VENDORED = {
    "https://maxcdn.bootstrapcdn.com/bootstrap/4.3.1/css/bootstrap.min.css": "bootstrap/bootstrap.min.css",
    "https://stackpath.bootstrapcdn.com/bootstrap/4.3.1/js/bootstrap.min.js": "bootstrap/bootstrap.min.js",
    "https://code.jquery.com/jquery-3.7.1.min.js": "jquery/jquery.min.js",
    "https://cdnjs.cloudflare.com/ajax/libs/popper.js/1.12.9/umd/popper.min.js": "popper.js/popper.min.js",
    "https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.css": "bootstrap-table/bootstrap-table.min.css",
    "https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.js": "bootstrap-table/bootstrap-table.min.js",
    # 1.19.0's filter-control style sheet is 1.19.1's, but for the version in its header comment
    "https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/bootstrap-table-filter-control.css": (
        "bootstrap-table/bootstrap-table-filter-control.min.css"
    ),
    "https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/bootstrap-table-filter-control.min.css": (
        "bootstrap-table/bootstrap-table-filter-control.min.css"
    ),
    "https://unpkg.com/bootstrap-table@1.19.1/dist/extensions/filter-control/bootstrap-table-filter-control.min.js": (
        "bootstrap-table/bootstrap-table-filter-control.min.js"
    ),
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/css/bootstrap-datepicker.min.css": (
        "bootstrap-datepicker/bootstrap-datepicker.min.css"
    ),
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/js/bootstrap-datepicker.min.js": (
        "bootstrap-datepicker/bootstrap-datepicker.min.js"
    ),
    "https://cdnjs.cloudflare.com/ajax/libs/font-awesome/6.6.0/css/all.min.css": "fontawesome-free/css/all.min.css",
    "https://cdn.jsdelivr.net/npm/@forevolve/bootstrap-dark@1.1.0/dist/css/bootstrap-prefers-dark.css": (
        "bootstrap-dark/bootstrap-prefers-dark.min.css"
    ),
}
GX_WEB_ASSETS = re.compile(r"https://great-expectations-web-assets\.s3\.us-east-2\.amazonaws\.com/[^\"'()\s<>]*")
VEGA_SCRIPT = re.compile(r'[ \t]*<script src="https://cdn\.jsdelivr\.net/npm/vega(?:-lite|-embed)?@\d+"></script>\n?')
SRI = re.compile(r'\s(?:integrity|crossorigin)="[^"]*"')
# A table bootstrap-table draws on the index page: its id, and the columns and data literals of its script.
TABLE_SCRIPT = re.compile(
    r"\$\('#(?P<id>[\w-]+)'\)\.bootstrapTable\(\s*Object\.assign\(\s*\{\s*columns: (?P<columns>\[.*?\]),\s*"
    r"data: (?P<data>\[.*?\]),\s*toolbar:",
    re.DOTALL,
)
# Without scripts, bootstrap's tabs never switch: every pane of the index shows, one under the other (Chromium does
# not render <noscript> in a page its policy sandboxes without scripts, so this applies with scripts too).
SHOW_TAB_PANES = "<style>.tab-content > .tab-pane { display: block !important; opacity: 1 !important; }</style>"
# GX's favicon link, one "../" short on validation result pages; rewritten from the page's own depth.
FAVICON = re.compile(r'href="(?:\./|\.\./)*static/images/favicon\.ico"')


def localize(text: str, up: str) -> str:
    """A page or style sheet with every CDN asset replaced by its vendored copy; ``up`` leads to the site's root."""
    text = SRI.sub("", VEGA_SCRIPT.sub("", text))
    for url, path in VENDORED.items():
        text = text.replace(url, f"{up}{SITE_VENDOR}/{path}")
    text = GX_WEB_ASSETS.sub(up + LOGO, text)
    text = FAVICON.sub(f'href="{up}static/images/favicon.ico"', text)
    return text


def localize_site(site_dir: Path) -> None:
    """Copy the vendored assets into ``site_dir/static/vendor`` and point every page and style sheet at them; the
    site's index gets its tables as HTML (:func:`static_tables`)."""
    shutil.copytree(VENDOR, site_dir / SITE_VENDOR, dirs_exist_ok=True)
    for path in sorted(site_dir.rglob("*")):
        relative = path.relative_to(site_dir)
        if path.suffix not in (".html", ".css") or relative.is_relative_to(SITE_VENDOR):
            continue
        text = path.read_text(encoding="utf-8")
        local = localize(text, "../" * (len(relative.parts) - 1))
        if relative == Path("index.html"):
            local = static_tables(local)
        if local != text:
            path.write_text(local, encoding="utf-8")


def static_tables(page: str) -> str:
    """The index page with each table bootstrap-table would draw from script data written out as HTML rows.

    The viewer serves reports with no script (docs/security.md, door 6): GX's index draws its lists of
    validation results and suites with bootstrap-table from a literal in a ``<script>``, so without
    this it shows empty tables. Each row links the page the script's row would open; the tab panes
    bootstrap's script would switch between all show, one under the other. With scripts on,
    bootstrap-table draws the tables again from the same data.
    """
    for match in TABLE_SCRIPT.finditer(page):
        table_id = match.group("id")
        columns, rows = (ast.literal_eval(match.group(name)) for name in ("columns", "data"))
        head = "".join(f"<th>{column['title']}</th>" for column in columns)
        body = "".join("<tr>" + "".join(_cell(row, column["field"]) for column in columns) + "</tr>\n" for row in rows)
        rows_html = f"<thead><tr>{head}</tr></thead><tbody>\n{body}</tbody>"
        empty = re.compile(rf'(<table\s+id="{re.escape(table_id)}"[^>]*>)\s*(</table>)')
        page = empty.sub(lambda m, rows=rows_html: m.group(1) + rows + m.group(2), page)
    return page.replace("</head>", f"{SHOW_TAB_PANES}</head>", 1)


def _cell(row: dict[str, object], field: str) -> str:
    """One cell: the value GX would show, linked to the row's page unless it holds a link of its own."""
    value, link = str(row.get(field, "")), row.get("_table_row_link_path")
    if link and "<a " not in value:
        value = f'<a href="{link}">{value.strip()}</a>'
    return f"<td>{value}</td>"
