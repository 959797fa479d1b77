"""What ``engine migrate`` maps onto this plugin (hook ``trainer_argument_mappings``):
TrainingArguments' neftune_noise_alpha."""

from __future__ import annotations

from engine.kit.mappings import enable_with_value, plugin

TRAINER_ARGUMENTS = {
    "neftune_noise_alpha": plugin("neftune", "noise_alpha", convert=enable_with_value,
                                  note="a value enables the plugin"),
}
