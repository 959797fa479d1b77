"""What ``engine migrate`` maps onto this plugin (hook ``trainer_argument_mappings``):
TrainingArguments' use_liger_kernel and liger_kernel_config."""

from __future__ import annotations

from typing import Any

from engine import ConfigError
from engine.kit.mappings import Conversion, enable, plugin, show

LIGER_KERNELS = ("rope", "rms_norm", "swiglu", "geglu", "layer_norm", "cross_entropy", "fused_linear_cross_entropy")


def _liger_config(c: Conversion, name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ConfigError("expected a table of liger-kernel arguments")
    for kernel, on in value.items():
        if kernel in LIGER_KERNELS and isinstance(on, bool):
            c.set(f"liger.{kernel}", on)
        else:
            c.lose(f"liger_kernel_config.{kernel} = {show(on)}",
                   f"the liger plugin switches these kernels on or off: {', '.join(LIGER_KERNELS)}")


TRAINER_ARGUMENTS = {
    "use_liger_kernel": plugin("liger", convert=enable, note="true enables the plugin"),
    "liger_kernel_config": plugin("liger", *LIGER_KERNELS, convert=_liger_config,
                                  note="each kernel's switch to the [liger] key of the same name"),
}
