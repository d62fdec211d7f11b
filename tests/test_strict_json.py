"""The strict JSON-to-dataclass loader: nested documents, named paths, the caller's error class."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tasks.strict_json import load_dataclass, parse_json


class DocumentError(ValueError):
    """Stands in for a caller's error class (ConfigError, MalformedMarkerError)."""


@dataclass(frozen=True)
class Part:
    path: str
    rows: int | None = None

    def __post_init__(self) -> None:
        if self.rows is not None and self.rows < 0:
            raise DocumentError(f"rows must be >= 0, got {self.rows}")


@dataclass(frozen=True)
class Settings:
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass(frozen=True)
class Document:
    name: str
    parts: tuple[Part, ...]
    card: Part | None = None
    settings: Settings = field(default_factory=Settings)
    options: dict[str, object] = field(default_factory=dict)
    pair: tuple[int, str] = (0, "")


def load(raw: object, **kwargs: object) -> Document:
    return load_dataclass(Document, raw, source="doc.json", error=DocumentError, **kwargs)  # type: ignore[arg-type]


def test_nested_dataclasses_tuples_and_optionals_are_built() -> None:
    doc = load(
        {
            "name": "d",
            "parts": [{"path": "a", "rows": 2}, {"path": "b"}],
            "card": None,
            "settings": {"temperature": 0.5},
            "options": {"k": [1, 2]},
            "pair": [1, "x"],
        }
    )
    assert doc == Document(
        name="d",
        parts=(Part("a", 2), Part("b")),
        card=None,
        settings=Settings(0.5),
        options={"k": [1, 2]},
        pair=(1, "x"),
    )
    assert load({"name": "d", "parts": [], "card": {"path": "c"}}).card == Part("c")


def test_fields_with_defaults_may_be_omitted_unless_every_field_is_required() -> None:
    assert load({"name": "d", "parts": []}).settings == Settings()
    every_field = r"^doc\.json: missing field\(s\) \['card', 'options', 'pair', 'settings'\]$"
    with pytest.raises(DocumentError, match=every_field):
        load({"name": "d", "parts": []}, require_all=True)
    with pytest.raises(DocumentError, match=r"^doc\.json\.parts\[0\]: missing field\(s\) \['rows'\]$"):
        load(
            {"name": "d", "parts": [{"path": "a"}], "card": None, "settings": {}, "options": {}, "pair": [0, ""]},
            require_all=True,
        )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], r"^doc\.json must be a JSON object, got list$"),
        ({"parts": []}, r"^doc\.json: missing field\(s\) \['name'\]$"),
        ({"name": "d", "parts": [], "extra": 1}, r"^doc\.json: unknown field\(s\) \['extra'\]$"),
        ({"name": "d", "parts": {}}, r"^doc\.json\.parts must be a list, got dict$"),
        (
            {"name": "d", "parts": [{"path": "a", "owner": 1}]},
            r"^doc\.json\.parts\[0\]: unknown field\(s\) \['owner'\]$",
        ),
        ({"name": "d", "parts": ["a"]}, r"^doc\.json\.parts\[0\] must be a JSON object, got str$"),
        ({"name": "d", "parts": [], "pair": [1]}, r"^doc\.json\.pair must hold 2 items, got 1$"),
        (
            {"name": "d", "parts": [], "settings": {"temperature": -1}},
            r"^doc\.json\.settings: temperature must be >= 0",
        ),
        ({"name": "d", "parts": [{"path": "a", "rows": -1}]}, r"^doc\.json\.parts\[0\]: rows must be >= 0, got -1$"),
    ],
)
def test_every_problem_raises_the_callers_error_naming_the_path(raw: object, message: str) -> None:
    with pytest.raises(DocumentError, match=message):
        load(raw)


def test_an_error_of_a_subclass_keeps_its_class() -> None:
    class PartError(DocumentError):
        pass

    @dataclass(frozen=True)
    class Strict:
        value: int

        def __post_init__(self) -> None:
            raise PartError("never valid")

    with pytest.raises(PartError, match=r"^s\.json: never valid$"):
        load_dataclass(Strict, {"value": 1}, source="s.json", error=DocumentError)


def test_parse_json_names_the_source() -> None:
    assert parse_json(b'{"a": 1}', source="x") == {"a": 1}
    for text in ("{not json", b"\xff\xfe"):
        with pytest.raises(DocumentError, match=r"^doc\.json is not valid JSON"):
            parse_json(text, source="doc.json", error=DocumentError)
