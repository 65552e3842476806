"""The settings a compiled directory's ``plan.json`` hands on to ``etgraph train`` (issue #14).

``etgraph compile`` records the data it probed (``data``, ``tokenizer``), the model's input
normalisation (``preprocess``, :class:`etgraph.data.Preprocess`) and the frozen batch-norm mode
(``frozen_bn``, :mod:`etgraph.artifacts`) in ``plan.json``; ``etgraph train DIR`` reuses them
(:func:`train_data`, :func:`train_settings`).
:func:`train_settings` merges them with the command line's options: **an option given on the
command line wins** (the user asked for it), and where it differs from the plan a warning says
so, naming both; the run's ``run.json`` records what was used. A plan written before these
fields existed gives the defaults.

Kept apart from :mod:`etgraph.pipeline` so ``etgraph train`` does not import the compiler.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from passes.onnx import DEFAULT_FROZEN_BN

from .artifacts import check_frozen_bn
from .data import Preprocess, make_preprocess
from .files import read_json

log = logging.getLogger(__name__)

__all__ = ["PLAN_FILE", "data_record", "read_plan", "train_data", "train_settings"]

PLAN_FILE = "plan.json"


def read_plan(directory: str | os.PathLike) -> dict | None:
    """The ``plan.json`` of a compiled directory, or None when it has none.

    Raises:
        ConfigError: the file is not readable JSON.
    """
    path = Path(directory) / PLAN_FILE
    if not path.is_file():
        return None
    again = "compile the model again with etgraph compile"
    return read_json(path, what="", if_missing=again, if_unreadable=again)


def data_record(data: str | None, tokenizer: str | None) -> dict:
    """``{"data", "tokenizer"}`` for ``plan.json``: paths made absolute (a compiled directory
    is used from anywhere), a dataset name (``digits``) and None kept as they are."""

    def absolute(spec: str | None) -> str | None:
        return str(Path(spec).resolve()) if spec is not None and Path(spec).exists() else spec

    return {"data": absolute(data), "tokenizer": absolute(tokenizer)}


def train_data(
    plan: dict | None, data: str | None, tokenizer: str | None
) -> tuple[str | None, str | None]:
    """``(data, tokenizer)`` for ``etgraph train DIR``: the ones given, else the data the plan
    was compiled with (its tokenizer too, unless one is given). None: neither (the run's
    default dataset)."""
    recorded = (plan or {}).get("data")
    if data is not None or recorded is None:
        return data, tokenizer
    log.info("training on the compiled plan's data %s", recorded)
    return recorded, tokenizer if tokenizer is not None else plan.get("tokenizer")


def train_settings(
    plan: dict | None,
    *,
    preset: str | None = None,
    mean: str | None = None,
    std: str | None = None,
    scale: float | None = None,
    channel_order: str | None = None,
    frozen_bn: str | None = None,
) -> tuple[Preprocess, str]:
    """``(preprocess, frozen_bn)`` for a training run: the plan's, overridden by the options
    given (None = not given). ``preset`` starts from a preset instead of the plan's values;
    ``mean``, ``std``, ``scale`` and ``channel_order`` override single fields. An override
    that differs from the plan is logged as a warning.

    Raises:
        ConfigError: a bad option value or a malformed record in the plan
            (:func:`etgraph.data.make_preprocess`, :func:`etgraph.artifacts.check_frozen_bn`).
    """
    plan = plan or {}
    recorded = Preprocess.from_json(plan["preprocess"]) if plan.get("preprocess") else None
    preprocess = make_preprocess(
        preset if preset is not None else recorded,
        mean=mean,
        std=std,
        scale=scale,
        channel_order=channel_order,
    )
    if recorded is not None and _values(preprocess) != _values(recorded):
        log.warning(
            "preprocessing differs from the compiled plan's (%s): training with %s, as given",
            recorded.describe(),
            preprocess.describe(),
        )
    recorded_bn = plan.get("frozen_bn")
    mode = check_frozen_bn(frozen_bn or recorded_bn or DEFAULT_FROZEN_BN)
    if recorded_bn is not None and mode != recorded_bn:
        log.warning(
            "--frozen-bn %s differs from the compiled plan's %s: training with %s, as given "
            "(the plan's predicted step was for %s)",
            mode,
            recorded_bn,
            mode,
            recorded_bn,
        )
    return preprocess, mode


def _values(p: Preprocess) -> tuple:
    return (p.mean, p.std, p.scale, p.channel_order)
