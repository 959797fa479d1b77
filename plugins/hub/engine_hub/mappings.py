"""What ``engine migrate`` maps onto this plugin (hook ``trainer_argument_mappings``):
TrainingArguments' push_to_hub and hub_* fields."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine import ConfigError
from engine.kit.mappings import Conversion, flag, plugin


def _push_to_hub(c: Conversion, name: str, value: Any) -> None:
    if not flag(value):
        return
    c.enable("hub")
    if not c.arguments.get("hub_model_id"):
        output = Path(str(c.arguments.get("output_dir") or "trainer_output")).name
        c.placeholder("hub.repo", f"user/{output}", "Trainer pushed to your user's repo named after output_dir; "
                                                      "name the repo 'user/model' (or a path or fsspec URL)")


def _secret(c: Conversion, name: str, value: Any) -> None:
    if value is not None:  # masked by now (engine.tooling.migration); to_dict()'s "<HUB_TOKEN>" is Trainer's default
        raise ConfigError("a token is never written to a run file: set HF_TOKEN where the run starts "
                          "(or hub.token, which the engine masks)")


TRAINER_ARGUMENTS = {
    "push_to_hub": plugin("hub", convert=_push_to_hub, note="true enables the plugin"),
    "hub_token": plugin("hub", "token", convert=_secret,
                        note="never written to a run file: HF_TOKEN, or the cached login"),
    "hub_private_repo": plugin("hub", "private"),
    "hub_model_id": plugin("hub", "repo"),
    "hub_strategy": plugin("hub", "strategy"),
    "hub_always_push": plugin("hub", "always_push"),
    "hub_revision": plugin("hub", "revision"),
}
