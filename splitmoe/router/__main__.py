"""``python -m splitmoe.router``: see `splitmoe.router`."""

from splitmoe.router.app import main

raise SystemExit(main())
