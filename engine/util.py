"""Small helpers shared by the core and plugins."""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

from .errors import ConfigError, EngineError, MissingDependencyError, UserCodeError


def is_peft_model(model: Any) -> bool:
    """A model wrapped by peft (checked by its class's module: the core does not import peft)."""
    return model is not None and type(model).__module__.split(".")[0] == "peft"


def is_callable_spec(spec: str) -> bool:
    """True for ``"package.module:function"`` (and not an existing path that has a colon)."""
    return ":" in spec and not Path(spec).exists()


def load_callable(spec: str, key: str) -> Callable[..., Any]:
    """Import ``"package.module:function"`` named by config key ``key``.

    A malformed spec, a module that is missing or fails to import (a syntax error, an exception
    at import) or a missing attribute is an error that names ``key`` and the spec.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: expected 'package.module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigError(f"{key}: no module named {exc.name!r} (from {spec!r}; is it on PYTHONPATH?)") from None
        raise UserCodeError(f"{key}: importing {module_name!r} failed: {describe_exception(exc)}") from exc
    except Exception as exc:  # the module's own code failed: say where
        raise UserCodeError(f"{key}: importing {module_name!r} failed: {describe_exception(exc)}") from exc
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"{key}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(target):
        raise ConfigError(f"{key}: {spec!r} is not callable")
    return target


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` of an exception (a syntax error with its file and line)."""
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({exc.filename}, line {exc.lineno})"
    return f"{type(exc).__name__}: {exc}"


def call_user(key: str, name: str, function: Callable[..., Any], *args: Any) -> Any:
    """Call user code (a model factory, a data function, compute_metrics) that config ``key`` names.

    Arguments it cannot take, or an exception it raises, become one error naming ``key``, the
    code and the exception (:class:`UserCodeError`; the exception is its ``__cause__``).
    """
    try:
        inspect.signature(function).bind(*args)
    except TypeError:
        raise ConfigError(f"{key}: {name} takes {inspect.signature(function)}, but is called with "
                          f"{len(args)} argument(s)") from None
    except ValueError:  # no signature (a builtin): let the call say
        pass
    try:
        return function(*args)
    except EngineError:
        raise
    except Exception as exc:
        raise UserCodeError(f"{key}: {name} raised {describe_exception(exc)}") from exc


def require(module: str, package: str | None = None, feature: str = "", extra: str | None = None,
            import_now: bool = True) -> Any:
    """Import ``module`` or raise :class:`MissingDependencyError` naming what to install.

    ``extra`` names the engine extra that provides it (``pip install 'engine[galore]'``); otherwise the message
    names the pip ``package``. A package that is installed but fails to import (a broken build, a missing shared
    library) is reported with its own error instead. ``import_now = False`` only looks for it (None if found): for
    a library whose import takes seconds. Example: ``require("galore_torch", "galore-torch", extra="galore")``.
    """
    try:
        if not import_now and importlib.util.find_spec(module) is not None:
            return None
        return importlib.import_module(module)  # not found: raises ModuleNotFoundError
    except ImportError as exc:
        what = f" for {feature}" if feature else ""
        if is_missing(exc, module):
            install = f"pip install 'engine[{extra}]'" if extra else f"pip install {package or module}"
            raise MissingDependencyError(
                f"package {package or module!r} is needed{what} (missing module {exc.name or module!r}): {install}"
            ) from exc
        raise MissingDependencyError(
            f"package {package or module!r} is installed but fails to import{what}: {describe_exception(exc)}; "
            f"reinstall it (pip install --force-reinstall {package or module})") from exc


def is_missing(exc: ImportError, module: str) -> bool:
    """Whether ``exc`` (raised importing ``module``) means a module is not installed, not that one is broken."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return False  # e.g. a shared library that does not load: the package is there, broken
    if exc.name == module or module.startswith(exc.name + "."):
        return True
    try:  # a dependency the module imports: missing if it cannot be found at all
        return importlib.util.find_spec(exc.name.split(".")[0]) is None
    except (ImportError, ValueError):
        return True


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float (nan, inf) replaced by None, in nested dicts and lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(item) for item in value]
    return value


def decode_utf8(data: bytes, what: str, fix: str = "save it as UTF-8") -> str:
    """``data`` as text (a UTF-8 byte-order mark accepted); bytes that are not UTF-8 are a
    ConfigError naming ``what``, the first bad byte and its line, and saying ``fix``."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{what} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); {fix}") from None


# a credential by its name: the last word is token, password, ... (not tokens_seen, pad_token_id, a special eos_token)
_SECRET_NAME = re.compile(r"(?<!eos|bos|pad|unk|sep|cls)(?<!mask)(?<!concat)(?:^|[_\-.])(?:token|password|passwd|"
                          r"secret|credentials?|(?:api|access|secret|private)[_\-]?key)$", re.IGNORECASE)


def is_secret_name(name: Any) -> bool:
    """True for the name of a credential (``hub_token``, ``wandb_api_key``, ``password``, ...)."""
    return isinstance(name, str) and _SECRET_NAME.search(name) is not None


def mask_secrets(value: Any, mask: str) -> Any:
    """``value`` with every set value under a credential's name (:func:`is_secret_name`), in nested dicts
    and lists, replaced by ``mask``: what may be shown or written of a configuration someone gave."""
    if isinstance(value, dict):
        return {key: mask if is_secret_name(key) and item is not None else mask_secrets(item, mask)
                for key, item in value.items()}
    if isinstance(value, list):
        return [mask_secrets(item, mask) for item in value]
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


def is_callback(obj: Any) -> bool:
    """A ``transformers.TrainerCallback`` instance or subclass (transformers is not imported for it)."""
    module = sys.modules.get("transformers.trainer_callback")
    if module is None:  # not imported: nothing here can be a TrainerCallback
        return False
    base = module.TrainerCallback
    return isinstance(obj, base) or (isinstance(obj, type) and issubclass(obj, base))


def is_datasets_object(obj: Any) -> bool:
    """A 🤗 ``datasets.Dataset`` or ``IterableDataset`` (checked without importing datasets)."""
    return type(obj).__module__.startswith("datasets.") and hasattr(obj, "column_names")
