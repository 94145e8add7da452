"""Every FASTCOMM_* variable of both products: the collectives' (fastcomm.config) and K-quant serving's
(fastcomm.kquant.settings), for what shows or checks them all (`fastcomm env`, the vLLM plugin's typo check,
bench-decode's pre-check). Each product resolves only its own."""
from __future__ import annotations

from typing import Mapping

from . import config
from .kquant import settings as kquant_settings

GROUPS = (config.GROUP, kquant_settings.GROUP)
VARIABLES = tuple(v for variables, _ in GROUPS for v in variables)


def check_environment(env: Mapping[str, str] | None = None) -> list[config.Status]:
    return config.check_environment(env, GROUPS)


def unknown_variables(env: Mapping[str, str] | None = None) -> list[str]:
    return config.unknown_variables(env, GROUPS)
