"""What an HTML page or a style sheet loads: the addresses of its resources, and those on another host."""

from __future__ import annotations

import re

# An element other than a link (<a>) naming a resource; a CSS url() or @import.
TAG = re.compile(r"<(?!a[\s>])[a-zA-Z][^>]*>")
RESOURCE = re.compile(r"""\b(?:src|href|srcset|data|poster|action)\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s>]+))""")
CSS_URL = re.compile(r"""(?:url\(\s*|@import\s+)["']?([^"')\s]*)""")
ABSOLUTE = re.compile(r"\s*(?:[a-zA-Z][a-zA-Z0-9+.-]*:)?//")  # http://, https://, //host, any scheme://


def resources(text: str) -> list[str]:
    """Every address ``text`` (HTML or CSS) loads as a resource: tag attributes other than links', CSS urls."""
    found = [value for tag in TAG.findall(text) for groups in RESOURCE.findall(tag) for value in groups if value]
    return found + CSS_URL.findall(text)


def external(text: str) -> list[str]:
    """The resources of ``text`` named by absolute or scheme-relative URL."""
    return [value for value in resources(text) if ABSOLUTE.match(value)]
