"""``python -m scripts.research.config_reference [--check]``: see the package docstring."""

from . import main

raise SystemExit(main())
