"""The dataset card, ``dataset/README.md``: what a published batch holds and how to load it.

Written by publish, rendered from the batch config, the metrics, the parts the marker names,
both validation outcomes and the review decision, so the card is a pure function of what was
published (its only timestamp is the recorded decision's: re-rendering gives the same bytes).
Its YAML header declares the parts as the ``train`` split for Hugging Face ``datasets``. A
partial dataset says so in the first sentence under the title, naming the missing shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tasks.finalize.reasons import DESCRIPTIONS as REASON_DESCRIPTIONS
from tasks.models.provenance import WEIGHTS_DECLARED, WEIGHTS_VERIFIED
from tasks.records.dataset_row import COLUMN_DESCRIPTIONS, DatasetRow
from tasks.records.review import ReviewDecision, utc_text

PARTS_GLOB = "part-*.parquet"
# What every row says of its weights (the card's Weights section ends with it).
ROW_WEIGHTS = (
    "Each row names the weight version that sampled each call's tokens in `weight_version_spans`, and its "
    "weights per version in `weights_by_version`: their sha256 where every call of the row naming that version "
    f"names the same one, else null ({WEIGHTS_DECLARED})."
)


def render_card(
    *,
    batch_id: str,
    config: Mapping[str, Any],
    metrics: Mapping[str, Any],
    parts: Sequence[Mapping[str, Any]],
    validation: Mapping[str, Mapping[str, Any]],
    review: ReviewDecision | None,
) -> str:
    """Markdown of the card. ``parts``: dicts with ``path``, ``rows``, ``size``, ``sha256``.

    ``metrics`` is what ``metrics.json`` holds, including ``missing_shards`` and ``audit``;
    ``validation`` each suite's outcome as the committed manifest records it.
    """
    audit = metrics.get("audit")
    sampling = config.get("sampling", {})
    sections = [
        _front_matter(batch_id),
        f"# GRPO dataset `{batch_id}`\n",
        *_partial(metrics.get("missing_shards", []), config.get("shards")),
        (
            f"Rollouts of environment {_code(config.get('environment'))}: {config.get('num_tasks')} tasks × "
            f"group size {config.get('group_size')} on model {_code(config.get('model', {}).get('reference'))}, "
            f"sampled at temperature {sampling.get('temperature')}, top_p {sampling.get('top_p')}, "
            f"top_k {sampling.get('top_k')}. Advantages: {_code(config.get('advantage'))}; invalid rollouts: "
            f"{_code(config.get('on_invalid'))}. Every trainable row is the exact token sequence the model "
            "saw and sampled, verified against its staged deltas; anything unproven is masked "
            "(`sample_mask` 0) or dropped, with its reason.\n"
        ),
        *_agent_isolation(config),
        _weights(config, metrics.get("weights_by_version") or {}),
        _counts(metrics),
        _statistics(metrics),
        _invalid_reasons(metrics),
        _capture(metrics),
        _weight_versions(metrics),
        _validation(validation),
        _review(review),
    ]
    if audit is not None:
        sections.append(_audit(audit))
    sections += [_loading(batch_id), _columns(), _files(parts)]
    return "\n".join(sections)


def _weights(config: Mapping[str, Any], by_version: Mapping[str, Mapping[str, Any]]) -> str:
    """Which weights sampled each weight version (``weights_by_version`` of the metrics); without it (metrics
    written before versions were judged, or no call read), how the plan knew them."""
    if not by_version:
        return _planned_weights(config)
    planned = config.get("model", {}).get("weights_sha256")
    versions = sorted(by_version, key=int)
    declared = [v for v in versions if by_version[v].get("weights") != WEIGHTS_VERIFIED]
    verified = [v for v in versions if v not in declared]
    summary = (
        f"Weights: {WEIGHTS_VERIFIED} for every weight version"
        if not declared
        else f"Weights: {WEIGHTS_DECLARED} for weight version(s) {', '.join(declared)}"
        + (f"; {WEIGHTS_VERIFIED} for {', '.join(verified)}" if verified else "")
    )
    rows = []
    for version in versions:
        entry = by_version[version]
        sha = entry.get("weights_sha256")
        shown = "–" if sha is None else f"`{sha}`" + (" (the planned model's)" if sha == planned else "")
        rows.append((version, entry.get("weights"), shown, entry.get("why"), entry.get("calls")))
    return (
        f"{summary}. A weight version's weights are {WEIGHTS_VERIFIED} only where they were hashed where they "
        "were loaded and every call of that version in the rows names the same sha256; anything else is "
        f"{WEIGHTS_DECLARED}. {ROW_WEIGHTS}\n\n"
        + _table(("weight version", "weights", "sha256", "why not verified", "calls"), rows)
    )


def _planned_weights(config: Mapping[str, Any]) -> str:
    """How the generating weights are known to be the planned model's (``model.weights`` of the config)."""
    model, engine = config.get("model", {}), config.get("engine", {})
    if model.get("weights", WEIGHTS_VERIFIED) == WEIGHTS_VERIFIED:
        return (
            f"Weights: {WEIGHTS_VERIFIED}. Their sha256 ({_code(model.get('weights_sha256'))}) was checked "
            f"against the plan where they were loaded. {ROW_WEIGHTS}\n"
        )
    return (
        f"Weights: {model['weights']}. The {_code(engine.get('name'))} servers that generated this batch "
        f"loaded a model folder the planning machine could not hash; they were accepted by their model name "
        f"{_code(engine.get('options', {}).get('served_model'))}. The token ids and logprobs are exactly the "
        f"servers' own; that they came from the planned weights is the servers' word. {ROW_WEIGHTS}\n"
    )


def _agent_isolation(config: Mapping[str, Any]) -> list[str]:
    """How the agent commands of an ``agent_command`` batch were isolated (no section for other environments)."""
    isolation = config.get("environment_options", {}).get("isolation")
    if isolation is None:
        return []
    if isolation == "sandbox":
        return ["Agents: each agent command ran in an OS sandbox (bubblewrap): no other process, no worker file.\n"]
    return [
        f"Agents: isolation {_code(isolation)}: the agent commands ran as plain child processes, without an OS "
        "sandbox (the deployment declared it; docs/security.md says what that leaves open).\n"
    ]


def _partial(missing: Sequence[int], shards: object) -> list[str]:
    """The partial-dataset warning (no section when every planned shard is in the dataset)."""
    if not missing:
        return []
    return [
        f"PARTIAL: shards {list(missing)} are missing (of {shards} planned). This dataset was finalized with "
        "`--allow-partial`: the rollouts of those shards are not in it, and their groups are not counted.\n"
    ]


def _front_matter(batch_id: str) -> str:
    return (
        "---\n"
        f"pretty_name: rollout-ledger GRPO batch {batch_id}\n"
        "tags:\n- rollout-ledger\n- grpo\n- reinforcement-learning\n"
        "configs:\n- config_name: default\n  data_files:\n  - split: train\n"
        f'    path: "{PARTS_GLOB}"\n'
        "---\n"
    )


def _cell(value: object) -> str:
    """A value made safe for a Markdown table cell."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def _code(value: object) -> str:
    """A value as inline code, safe in running text."""
    return "`" + str(value).replace("`", "'").replace("\n", " ") + "`"


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_cell(_fmt(v)) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _fmt(value: object) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _counts(m: Mapping[str, Any]) -> str:
    names = (
        "planned_rollouts",
        "receipts",
        "rows",
        "trainable_rows",
        "masked_rows",
        "invalid_row_rate",
        "groups",
        "groups_dropped",
        "groups_zero_variance",
        "groups_single_valid",
        "tokens",
        "sampled_tokens",
        "truncated_rate",
    )
    return "## Counts\n\n" + _table(("metric", "value"), [(n, m.get(n)) for n in names])


def _statistics(m: Mapping[str, Any]) -> str:
    rows = [
        (label, *(m.get(key, {}).get(s) for s in ("count", "mean", "std", "min", "max")))
        for label, key in (
            ("reward (trainable rows)", "reward"),
            ("tokens per row", "row_length"),
            ("turns (trainable rows)", "turns"),
        )
    ]
    return "## Rewards and lengths\n\n" + _table(("statistic", "count", "mean", "std", "min", "max"), rows)


def _invalid_reasons(m: Mapping[str, Any]) -> str:
    found = m.get("invalid_reasons", {})
    if not found:
        return "## Invalid rollouts\n\nNone: every planned rollout is trainable.\n"
    rows = [(f"`{r}`", n, REASON_DESCRIPTIONS.get(r, "")) for r, n in sorted(found.items())]
    return "## Invalid rollouts\n\n" + _table(("reason", "rollouts", "meaning"), rows)


def _capture(m: Mapping[str, Any]) -> str:
    keys = [
        "calls_per_rollout",
        "token_in_rate",
        "capture_poisoned_rollouts",
        "epoch_span_count",
        *sorted(k for k in m if k.startswith("terminal_selection_")),
    ]
    text = "## Capture\n\n" + _table(("metric", "value"), [(k, m.get(k)) for k in keys])
    prefixes = m.get("failure_reasons_by_prefix", {})
    if prefixes:
        text += "\nCapture failure rows by reason family:\n\n" + _table(("family", "rows"), sorted(prefixes.items()))
    return text


def _weight_versions(m: Mapping[str, Any]) -> str:
    versions = m.get("group_weight_versions", {})
    if not versions:
        return "## Weight versions\n\nNo group has a trainable row.\n"
    rows = sorted(versions.items(), key=lambda kv: int(kv[0]))
    return (
        "## Weight versions\n\nA group's version is the lowest weight version among its trainable rows; "
        "rows carry per-call spans in `weight_version_spans`.\n\n" + _table(("weight version", "groups"), rows)
    )


def _validation(validation: Mapping[str, Mapping[str, Any]]) -> str:
    rows = [
        (suite, outcome.get("status"), ", ".join(f"`{name}`" for name in outcome.get("warned", [])) or "–")
        for suite, outcome in validation.items()
    ]
    return "## Validation\n\n" + _table(("suite", "status", "warned"), rows)


def _review(review: ReviewDecision | None) -> str:
    if review is None:
        return "## Review\n\nNone needed: both suites passed and no review was required.\n"
    who = "nobody (the review timed out)" if review.decided_by is None else _code(review.decided_by)
    rows = [
        ("decision", review.choice),
        ("decided by", who),
        ("decided at", utc_text(review.decided_at)),
        ("via", review.via),
        ("reason", review.reason),
    ]
    intro = "A person decided to publish this batch after reading its validation reports.\n\n"
    return "## Review\n\n" + intro + _table(("review", "value"), rows)


def _audit(audit: Mapping[str, Any]) -> str:
    rows = [(k, v) for k, v in sorted(audit.items()) if not isinstance(v, (dict, list, tuple))]
    return "## Logprob audit\n\n" + _table(("measure", "value"), rows)


def _loading(batch_id: str) -> str:
    return (
        "## Loading\n\n"
        "`batch` is the URL of the batch directory (any fsspec URL: a local path, `s3://...`); "
        "this card lives in its `dataset/` folder. With Hugging Face `datasets`:\n\n"
        "```python\n"
        "from datasets import load_dataset\n\n"
        f'batch = ".../batches/{batch_id}"\n'
        f'rows = load_dataset("parquet", data_files=f"{{batch}}/dataset/{PARTS_GLOB}", split="train")\n'
        "```\n\n"
        "With the project's torch collator (reads only the parts `_COMMITTED.json` names, checking each sha256):\n\n"
        "```python\n"
        "from torch.utils.data import DataLoader\n"
        "from tasks.trainer.collate import GrpoCollator, PublishedDataset\n\n"
        "data = PublishedDataset.from_url(batch)  # storage_options={...} for object stores\n"
        "loader = DataLoader(data, batch_size=8, collate_fn=GrpoCollator(pad_token_id=0))\n"
        "```\n\n"
        "Train only where `train_mask` is 1 (sampled tokens of trainable rows); masked rows carry advantage 0.\n"
    )


def _columns() -> str:
    rows = [(f"`{f.name}`", f"`{f.type}`", COLUMN_DESCRIPTIONS[f.name]) for f in DatasetRow.arrow_schema()]
    return "## Columns\n\n" + _table(("column", "type", "meaning"), rows)


def _files(parts: Sequence[Mapping[str, Any]]) -> str:
    rows = [(p["path"].rsplit("/", 1)[-1], p["rows"], p["size"], f"`{p['sha256']}`") for p in parts]
    return "## Files\n\n" + _table(("part", "rows", "bytes", "sha256"), rows)
