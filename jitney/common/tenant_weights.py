"""A tenant's weight (``--fairness tenant``) as the key file and the flags write it:
shared by the key file's parser (scheduler/security) and the fairness policy
(scheduler/core/fairness.py)."""

from __future__ import annotations

import math
import re

MAX_TENANT_WEIGHT = 1000.0
# A weight in a key file or a flag: looks like a number (so a bad one is an
# error, not silently part of a key).
_NUMBERISH = re.compile(r"[-+]?[0-9.]*[0-9][0-9.eE+-]*|[-+]?(inf|nan|infinity)", re.IGNORECASE)


def looks_like_weight(text: str) -> bool:
    return _NUMBERISH.fullmatch(text.strip()) is not None


def parse_weight(text: str) -> float:
    """A tenant weight: a number in (0, MAX_TENANT_WEIGHT]. Raises ValueError."""
    try:
        weight = float(text)
    except ValueError:
        weight = math.nan
    if not 0 < weight <= MAX_TENANT_WEIGHT:
        raise ValueError(f"a tenant weight is a number in (0, {MAX_TENANT_WEIGHT:g}], got {text.strip()!r}")
    return weight
