"""Record invariants as data: each rule is written once and checked on one record or on a whole table.

A :class:`Rule` is a predicate over named fields, written against an operations namespace
``o``. Given :class:`OnColumns`, the predicate computes a boolean column over every row of an
Arrow table (the ledger reader's proof of a file); given :class:`OnSource`, the same predicate
spells itself as a Python expression, and :class:`RecordRules` compiles a record class's rules,
with a type test of every field against its declared Arrow column (what a table's schema
guarantees), into one function that a record's constructor calls (as ``dataclasses`` compiles
``__init__``). When that function says no, each field and then each rule is checked alone,
so the error names the first field of the wrong type or the first broken rule.

Nulls: a predicate tests them with ``is_null`` / ``not_null``; every other operation is false
on a null (a null never matches, equals or exceeds anything). A rule over one ``optional``
field holds where that field is null.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Collection, Iterable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from tasks.checks import HEX_DIGEST, REASON_NAME, check_int, is_int, is_number
from tasks.ids import ID_PATTERN, MAX_ID_LENGTH, is_id

Column = pa.Array | pa.ChunkedArray


class Source(str):
    """A Python expression over the record ``r`` (an operand that is not a constant)."""


class OnSource:
    """The operations as Python expressions over a record ``r``; constants are bound by name in ``names``."""

    def __init__(self) -> None:
        self.names: dict[str, Any] = {"is_id": is_id, "isfinite": math.isfinite}

    def _operand(self, value: Any) -> str:
        if isinstance(value, Source):
            return value
        name = f"_k{len(self.names)}"
        self.names[name] = value
        return name

    def is_null(self, value: Source) -> Source:
        return Source(f"({value} is None)")

    def not_null(self, value: Source) -> Source:
        return Source(f"({value} is not None)")

    def eq(self, value: Source, other: Any) -> Source:
        return Source(f"({value} is not None and {value} == {self._operand(other)})")

    def ge(self, value: Source, bound: Any) -> Source:
        return Source(f"({value} is not None and {value} >= {self._operand(bound)})")

    def add(self, value: Source, other: Any) -> Source:
        other = self._operand(other)
        return Source(f"(None if {value} is None or {other} is None else {value} + {other})")

    def one_of(self, value: Source, allowed: Collection[Any]) -> Source:
        return Source(f"({value} is not None and {value} in {self._operand(frozenset(allowed))})")

    def is_id(self, value: Source) -> Source:
        return Source(f"is_id({value})")

    def all_ids(self, value: Source) -> Source:
        return Source(f"({value} is not None and all(is_id(item) for item in {value}))")

    def matches(self, value: Source, pattern: re.Pattern[str]) -> Source:
        return Source(f"({value} is not None and {self._operand(pattern)}.fullmatch({value}) is not None)")

    def starts_with(self, value: Source, prefix: str) -> Source:
        return Source(f"({value} is not None and {value}.startswith({self._operand(prefix)}))")

    def non_empty(self, value: Source) -> Source:
        return Source(f"({value} is not None and len({value}) > 0)")

    def finite(self, value: Source) -> Source:
        return Source(f"({value} is not None and isfinite({value}))")

    def satisfies(self, value: Source, test: Callable[[Any], bool]) -> Source:
        return Source(f"({value} is not None and {self._operand(test)}({value}))")

    def iff(self, holds: Source, other: Source) -> Source:
        return Source(f"({holds} == {other})")

    def implies(self, holds: Source, then: Source) -> Source:
        return Source(f"(not {holds} or {then})")

    def any_of(self, *holds: Source) -> Source:
        return Source(f"({' or '.join(holds)})")


class OnColumns:
    """The same operations on Arrow columns, row by row; every boolean result is null-free."""

    @staticmethod
    def is_null(column: Column) -> Column:
        return pc.is_null(column)

    @staticmethod
    def not_null(column: Column) -> Column:
        return pc.is_valid(column)

    @staticmethod
    def eq(column: Column, other: Any) -> Column:
        return _false_on_null(pc.equal(column, other))

    @staticmethod
    def ge(column: Column, bound: Any) -> Column:
        return _false_on_null(pc.greater_equal(column, bound))

    @staticmethod
    def add(column: Column, other: Any) -> Column:
        return pc.add_checked(column, other)  # an overflow raises: the table is then checked record by record

    @staticmethod
    def one_of(column: Column, allowed: Collection[Any]) -> Column:
        return pc.is_in(column, value_set=pa.array(list(allowed), type=column.type))

    @staticmethod
    def is_id(column: Column) -> Column:
        short = pc.less_equal(pc.utf8_length(column), MAX_ID_LENGTH)
        return _false_on_null(pc.and_(_fullmatch(column, ID_PATTERN), short))

    @staticmethod
    def all_ids(column: Column) -> Column:
        """Per list: every item an id (an empty list holds)."""
        lists = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        broken = pc.invert(OnColumns.is_id(pc.list_flatten(lists)))
        owners = pc.filter(pc.list_parent_indices(lists), broken)
        rows = pa.array(range(len(lists)), pa.int64())
        return _false_on_null(pc.and_(pc.invert(pc.is_in(rows, value_set=owners.cast(pa.int64()))), pc.is_valid(lists)))

    @staticmethod
    def matches(column: Column, pattern: re.Pattern[str]) -> Column:
        return _false_on_null(_fullmatch(column, pattern))

    @staticmethod
    def starts_with(column: Column, prefix: str) -> Column:
        return _false_on_null(pc.starts_with(column, prefix))

    @staticmethod
    def non_empty(column: Column) -> Column:
        return _false_on_null(pc.greater(pc.utf8_length(column), 0))

    @staticmethod
    def finite(column: Column) -> Column:
        return _false_on_null(pc.is_finite(column))

    @staticmethod
    def satisfies(column: Column, test: Callable[[Any], bool]) -> Column:
        """``test`` runs once per distinct value, in Python."""
        passing = [v for v in pc.unique(column).to_pylist() if v is not None and test(v)]
        return pc.is_in(column, value_set=pa.array(passing, type=column.type))

    @staticmethod
    def iff(holds: Column, other: Column) -> Column:
        return pc.equal(holds, other)

    @staticmethod
    def implies(holds: Column, then: Column) -> Column:
        return pc.or_(pc.invert(holds), then)

    @staticmethod
    def any_of(*holds: Column) -> Column:
        return functools.reduce(pc.or_, holds)


Ops = OnSource | OnColumns


def _fullmatch(column: Column, pattern: re.Pattern[str]) -> Column:
    """Whether each value matches ``pattern`` entirely, as ``pattern.fullmatch`` does (RE2 must read it alike)."""
    return pc.match_substring_regex(column, f"^(?:{pattern.pattern})$")


def _false_on_null(holds: Column) -> Column:
    return pc.fill_null(holds, False)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One invariant: ``predicate(o, *fields)`` and the message of a record that breaks it.

    ``message`` is formatted with the record's fields by name (``"... {rollout_id} ..."``).
    """

    name: str
    fields: tuple[str, ...]
    predicate: Callable[..., Any]
    message: str
    optional: bool = False

    def __post_init__(self) -> None:
        if self.optional and len(self.fields) != 1:
            raise ValueError(f"rule {self.name}: only a rule over one field can be optional")

    def source(self, ops: OnSource) -> str:
        """The rule as a Python expression over the record ``r``."""
        fields = [Source(f"r.{name}") for name in self.fields]
        holds = self.predicate(ops, *fields)
        return f"({fields[0]} is None or {holds})" if self.optional else holds

    def holds_on(self, table: pa.Table) -> Column:
        """Per row of ``table``: whether it satisfies the rule."""
        columns = [table.column(name) for name in self.fields]
        holds = self.predicate(OnColumns, *columns)
        return pc.or_(pc.is_null(columns[0]), holds) if self.optional else holds

    def error(self, record: object) -> ValueError:
        return ValueError(self.message.format_map(_FieldsOf(record)))


class _FieldsOf:
    """A record's fields by name, for formatting a message."""

    def __init__(self, record: object) -> None:
        self._record = record

    def __getitem__(self, name: str) -> Any:
        return getattr(self._record, name)


class RecordRules:
    """A record class's rules, in order: :meth:`check` runs them on one record, :meth:`all_hold` on a table."""

    def __init__(self, *rules: Rule | Iterable[Rule]) -> None:
        self.rules = tuple(r for item in rules for r in ((item,) if isinstance(item, Rule) else item))
        names = [rule.name for rule in self.rules]
        if len(set(names)) != len(names):
            raise ValueError(f"rule names must be unique, got {names}")
        self._compiled: dict[type, _Compiled] = {}

    def check(self, record: object) -> None:
        """Raise for the first field whose value its Arrow column cannot hold, then for the first broken rule."""
        compiled = self._compiled.get(type(record))
        if compiled is None:
            compiled = self._compiled[type(record)] = _Compiled(type(record), self.rules)
        if not compiled.holds(record):
            compiled.raise_first_error(record)

    def all_hold(self, table: pa.Table) -> bool:
        """Whether every row of ``table`` (the record's schema) satisfies every rule.

        False too when the table cannot be proved column-wise (invalid UTF-8, an overflow in a
        sum): the caller then builds its records one by one, which names the row and the rule.
        """
        try:
            table.validate(full=True)  # UTF-8 of every string, as decoding each one would check
            return all(pc.all(rule.holds_on(table), min_count=0).as_py() for rule in self.rules)
        except (pa.ArrowException, ValueError):
            return False


class _Compiled:
    """The rules of one record class as Python functions: all at once, and each alone."""

    def __init__(self, record_cls: type, rules: tuple[Rule, ...]) -> None:
        ops = OnSource()
        self._types = [
            (f.name, python_type, f.metadata["nullable"])
            for f in dataclasses.fields(record_cls)
            if (python_type := _python_type(f.metadata["arrow"])) is not None
        ]
        type_tests = [t.source(Source(f"r.{name}"), nullable) for name, t, nullable in self._types]
        rule_tests = [rule.source(ops) for rule in rules]
        self.holds = _function(" and ".join([*type_tests, *rule_tests]), ops.names)
        self._rules = [(rule, _function(test, ops.names)) for rule, test in zip(rules, rule_tests, strict=True)]

    def raise_first_error(self, record: object) -> None:
        """Raise for the first field of the wrong type, then the first broken rule; return if there is none.

        The compiled test also refuses values it does not expect exactly (a str subclass, a numpy
        int) that the checks one by one accept.
        """
        for name, python_type, nullable in self._types:
            value = getattr(record, name)
            if value is not None or not nullable:
                python_type.check(name, value)
        for rule, holds in self._rules:
            if not holds(record):
                raise rule.error(record)


def _function(expression: str, names: dict[str, Any]) -> Callable[[object], bool]:
    """``lambda r: expression`` with ``names`` bound (the constants of :class:`OnSource`)."""
    # The expression is built from the rules declared in code, never from data.
    return eval(f"lambda r: bool({expression or True})", dict(names))


@dataclasses.dataclass(frozen=True)
class _PythonType:
    """What a Python value must be to fill a column of one Arrow type."""

    description: str
    exact: tuple[type, ...]  # the types the compiled test accepts as they are
    accepts: Callable[[Any], bool]
    bounds: tuple[int, int] | None = None

    def source(self, value: Source, nullable: bool) -> str:
        """The compiled test: exact types only (subclasses and numpy scalars fall back to :meth:`check`)."""
        test = " or ".join(f"{value}.__class__ is {t.__name__}" for t in self.exact)
        if self.bounds is not None:
            test = f"({test}) and {self.bounds[0]} <= {value} <= {self.bounds[1]}"
        return f"({value} is None or ({test}))" if nullable else f"({test})"

    def check(self, name: str, value: Any) -> None:
        if self.bounds is not None:
            check_int(value, field=name, minimum=self.bounds[0], maximum=self.bounds[1])
        elif not self.accepts(value):
            raise TypeError(f"{name} must be {self.description}, got {type(value).__name__}: {value!r}")


def _is_str_tuple(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(item, str) for item in value)


@functools.cache
def _python_type(arrow_type: pa.DataType) -> _PythonType | None:
    """What fills a column of ``arrow_type``; None for list columns other than list<string> (records convert those)."""
    if pa.types.is_string(arrow_type):
        return _PythonType("a str", (str,), lambda value: isinstance(value, str))
    if pa.types.is_list(arrow_type) and pa.types.is_string(arrow_type.value_type):
        return _PythonType("a tuple of str", (tuple,), _is_str_tuple)
    if pa.types.is_boolean(arrow_type):
        return _PythonType("a bool", (bool,), lambda value: isinstance(value, bool))
    if pa.types.is_floating(arrow_type):
        return _PythonType("a number", (float, int), is_number)
    if pa.types.is_integer(arrow_type):
        bits = arrow_type.bit_width
        signed = pa.types.is_signed_integer(arrow_type)
        bounds = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
        return _PythonType("an int", (int,), is_int, bounds)
    return None


# --- rule kinds ---------------------------------------------------------------------------------


def _each(
    kind: str,
    predicate: Callable[[Ops, Any], Any],
    message: str,
    names: Iterable[str],
    *,
    optional: bool = False,
) -> tuple[Rule, ...]:
    """One rule per field of ``names``, named ``<field>_<kind>``: ``predicate(o, value)``.

    In ``message``, ``{field}`` is the field's name and ``{value}`` (``{value!r}``) its value.
    """
    return tuple(
        Rule(
            name=f"{name}_{kind}",
            fields=(name,),
            predicate=predicate,
            message=message.replace("{field}", name).replace("{value", "{" + name),
            optional=optional,
        )
        for name in names
    )


def ids(*names: str, optional: bool = False) -> tuple[Rule, ...]:
    """Each field is an id (:func:`tasks.ids.check_id`)."""
    message = f"{{field}} must be an id ({ID_PATTERN.pattern}, at most {MAX_ID_LENGTH} characters), got {{value!r}}"
    return _each("is_id", lambda o, v: o.is_id(v), message, names, optional=optional)


def id_lists(*names: str) -> tuple[Rule, ...]:
    """Each (list<string>) field holds ids only (:func:`tasks.ids.check_id`)."""
    message = f"every item of {{field}} must be an id ({ID_PATTERN.pattern}), got {{value!r}}"
    return _each("are_ids", lambda o, v: o.all_ids(v), message, names)


def hex_digests(*names: str, optional: bool = False) -> tuple[Rule, ...]:
    """Each field is a SHA-256 digest as 64 lowercase hex digits."""
    message = "{field} must be 64 lowercase hex digits, got {value!r}"
    return _each("is_hex_digest", lambda o, v: o.matches(v, HEX_DIGEST), message, names, optional=optional)


def reasons(*names: str, optional: bool = False) -> tuple[Rule, ...]:
    """Each field is a snake_case reason name."""
    message = "{field} must be a snake_case reason name, got {value!r}"
    return _each("is_reason", lambda o, v: o.matches(v, REASON_NAME), message, names, optional=optional)


def at_least(minimum: int, *names: str) -> tuple[Rule, ...]:
    """Each (int) field is ``minimum`` or more."""
    message = f"{{field}} must be an int >= {minimum}, got {{value!r}}"
    return _each(f"at_least_{minimum}", lambda o, v: o.ge(v, minimum), message, names)


def finite(*names: str, optional: bool = False) -> tuple[Rule, ...]:
    """Each (float) field is finite: no NaN, no infinity."""
    message = "{field} must be a finite number, got {value!r}"
    return _each("is_finite", lambda o, v: o.finite(v), message, names, optional=optional)


def non_empty(*names: str, optional: bool = False) -> tuple[Rule, ...]:
    """Each (str) field is not empty."""
    message = "{field} must be a non-empty str, got {value!r}"
    return _each("non_empty", lambda o, v: o.non_empty(v), message, names, optional=optional)


def one_of(name: str, allowed: Collection[Any], *, optional: bool = False) -> tuple[Rule, ...]:
    """The field is one of ``allowed``."""
    message = f"{{field}} must be one of {list(allowed)}, got {{value!r}}"
    return _each("one_of", lambda o, v: o.one_of(v, allowed), message, (name,), optional=optional)


def equal_to(name: str, expected: Any) -> tuple[Rule, ...]:
    """The field is exactly ``expected`` (a format version)."""
    return _each("current", lambda o, v: o.eq(v, expected), f"{{field}} must be {expected!r}, got {{value!r}}", (name,))
