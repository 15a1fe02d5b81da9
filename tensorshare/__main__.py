"""``python -m tensorshare``: the same as the ``tensorshare`` command."""

from .cli import main

raise SystemExit(main())
