"""`python -m narwhal.mock --dialect ... --port ...`: see narwhal/mock/cli.py."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
