"""The wire of services bins: its messages and ops, registered in the op table of
:mod:`.protocol` at import (filled in by its issue)."""

from __future__ import annotations
