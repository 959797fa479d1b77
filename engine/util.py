"""Small helpers shared by the core and plugins."""

from __future__ import annotations

import importlib
import json
import math
import os
from pathlib import Path
from typing import Any, Callable

from .errors import ConfigError, MissingDependencyError


def is_callable_spec(spec: str) -> bool:
    """True for ``"package.module:function"`` (and not an existing path that has a colon)."""
    return ":" in spec and not Path(spec).exists()


def load_callable(spec: str, key: str) -> Callable[..., Any]:
    """Import ``"package.module:function"`` named by config key ``key``.

    A malformed spec, a missing module or a missing attribute is a :class:`ConfigError` that
    names ``key`` and the spec.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: expected 'package.module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import module {module_name!r} ({exc})") from exc
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"{key}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(target):
        raise ConfigError(f"{key}: {spec!r} is not callable")
    return target


def require(module: str, package: str | None = None, feature: str = "", extra: str | None = None) -> Any:
    """Import ``module`` or raise :class:`MissingDependencyError` naming what to install.

    ``extra`` names the engine extra that provides it (``pip install 'engine[galore]'``);
    otherwise the message names the pip ``package``.

    Example::

        galore_torch = require("galore_torch", "galore-torch", feature="train.optim = 'galore_adamw'",
                               extra="galore")
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        what = f" for {feature}" if feature else ""
        install = f"pip install 'engine[{extra}]'" if extra else f"pip install {package or module}"
        raise MissingDependencyError(
            f"package {package or module!r} is needed{what} (missing module {exc.name or module!r}): {install}"
        ) from exc


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float (nan, inf) replaced by None, in nested dicts and lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(item) for item in value]
    return value


def dumps_json(value: Any, **kwargs: Any) -> str:
    """Valid JSON (RFC 8259) for ``value``: non-finite floats become null, never ``NaN``.

    Every JSON the engine writes goes through here, so a diverged metric reads back as None.
    """
    return json.dumps(finite_json(value), allow_nan=False, **kwargs)


def write_json(path: str | Path, value: Any) -> None:
    """Write ``value`` as JSON to ``path`` atomically (a temporary file renamed into place)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(dumps_json(value, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
