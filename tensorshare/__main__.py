"""``python -m tensorshare``: the same as the ``tensorshare`` command."""

from .cli.main import main

raise SystemExit(main())
