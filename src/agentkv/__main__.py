"""``python -m agentkv``: the same as the ``agentkv`` command."""

from ._surfaces._cli import main

raise SystemExit(main())
