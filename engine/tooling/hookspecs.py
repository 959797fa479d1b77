"""The hooks only the tooling asks, declared beside it: they join ``engine.hookspecs`` through the
entry-point group ``engine.hookspecs`` (``tooling = "engine.tooling.hookspecs"``), as the builtins' do."""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("engine")


# ------------------------------------------------------------ engine.tooling.accelerate_config


@hookspec
def accelerate_mappings() -> dict[str, Any] | None:
    """Map keys of an Accelerate config file onto this plugin, for ``--accelerate-config``.

    **When**: while ``--accelerate-config`` is read, on the installed plugin that the catalogue of
    first-party plugins names for such a key (``fsdp_config``: fsdp), whether or not the run enables
    it yet. **Combine**: broadcast, asked of that one plugin: ``{Accelerate key: handler(mapping,
    key, value, enabled)}``, where ``enabled`` is the strategy plugin the file's
    ``distributed_type`` enables; ``engine.kit.mappings.nested`` makes the handler of a table of
    settings.

    Example::

        @hookimpl
        def accelerate_mappings():
            return {"fsdp_config": nested("fsdp", "FSDP", "an FSDP setting", FSDP_CONFIG)}
    """
