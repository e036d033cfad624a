"""JSON as the HTTP door writes it: compact, UTF-8 as is, no NaN or infinity."""

from __future__ import annotations

import json
from typing import Any


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
