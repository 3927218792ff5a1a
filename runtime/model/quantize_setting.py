"""The `[model] quantize` setting: its values, and the checks start-up makes of it before any layer is
built (runtime.preflight, runtime.bootstrap); the layers it makes are runtime.model.quantize's."""

from __future__ import annotations

import torch

from runtime.model.loader import SettingError

QUANTIZE_MODES = ("auto", "none", "int8", "int4")


class QuantizeError(SettingError):
    """A `quantize` setting the model's layers cannot take; the message is one line naming it."""


def check_mode(mode: str) -> None:
    if mode not in QUANTIZE_MODES:
        raise QuantizeError(f"model.quantize = {mode!r} is not one of {', '.join(QUANTIZE_MODES)}")


def check_device(mode: str, device: torch.device, where: str = "model.device is") -> None:
    """Raise `QuantizeError` unless `mode` can run on `device` (the quantized kernels are the CPU's)."""
    if mode not in ("none", "auto") and device.type != "cpu":
        raise QuantizeError(f"model.quantize = {mode!r} runs on the CPU only, and {where} {device.type}; "
                            "set model.quantize = \"none\" or model.device = \"cpu\"")
