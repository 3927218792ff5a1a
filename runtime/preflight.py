"""Check the start-up settings that only torch can judge, before anything is served.

    python -m runtime.preflight < encoded RuntimeOptions

`ponder serve` runs this first, so a setting this machine cannot honour (`--device cuda` without
CUDA, a dtype the device only emulates) stops start-up with one line naming the setting instead of
leaving a server up that answers 503. Exit status 2 and the line on stderr on a bad setting.
"""

from __future__ import annotations

import sys

from runtime.loader import SettingError, pick_device, pick_dtype
from runtime.protocol import RuntimeOptions, decode_options
from runtime.quantize import check_device, check_mode


def check(options: RuntimeOptions) -> None:
    """Raise `SettingError` for the first setting this machine cannot honour."""
    device = pick_device(options.device)
    pick_dtype(options.dtype, device)
    check_mode(options.quantize)
    check_device(options.quantize, device)


def main() -> int:
    try:
        check(decode_options(sys.stdin.buffer.read()))
    except SettingError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
