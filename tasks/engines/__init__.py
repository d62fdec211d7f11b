"""Inference engines behind one interface (:class:`tasks.engines.base.Engine`), chosen by name (:mod:`.registry`).

Importing this package is light (see :mod:`tasks.engines.registry`): it re-exports the registry's
functions only. The contract's types live in :mod:`tasks.engines.base`; each engine in its own
package (:mod:`tasks.engines.vllm`, :mod:`tasks.engines.megatron`).
"""

from tasks.engines.registry import (
    check_engine,
    create_engine,
    engine_class,
    engine_labels,
    engine_names,
    options_schema,
)

__all__ = ["check_engine", "create_engine", "engine_class", "engine_labels", "engine_names", "options_schema"]
