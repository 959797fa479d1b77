"""First-party plugins: which distribution and pip extra provide which plugin and names.

Used only to turn "unknown name" errors into instructions ("optim 'galore_adamw' comes from
engine-galore: pip install 'engine[galore]'"). Nothing here is imported or installed. The data is
engine/catalogue.toml.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class FirstParty:
    extra: str
    provides: dict[str, tuple[str, ...]] = field(default_factory=dict)  # registry kind -> names

    @property
    def distribution(self) -> str:
        return f"engine-{self.extra}"

    @property
    def install(self) -> str:
        return f"pip install 'engine[{self.extra}]'"


_DATA = tomllib.loads(Path(__file__).with_name("catalogue.toml").read_text(encoding="utf-8"))
FIRST_PARTY = {plugin: FirstParty(plugin, {kind: tuple(names) for kind, names in provides.items()})
               for plugin, provides in _DATA["plugins"].items()}
# TrainingArguments.optim names tied to hardware or libraries this engine does not support -> what to use instead
UNSUPPORTED_OPTIMIZERS: dict[str, str] = _DATA["unsupported_optimizers"]
# train.resume_from_checkpoint names a first-party plugin fetches -> that plugin
CHECKPOINT_SOURCES: dict[str, str] = _DATA["checkpoint_sources"]
# Run(model=<a peft model>): the plugin that saves and loads its checkpoints (the adapter only)
ADAPTER_PLUGIN: str = _DATA["adapter"]["plugin"]


def provider_of(kind: str, name: str) -> str | None:
    """The first-party plugin that registers ``name`` in registry ``kind``, if any."""
    for plugin, info in FIRST_PARTY.items():
        if name in info.provides.get(kind, ()):
            return plugin
    return None
