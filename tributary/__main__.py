"""`python -m tributary serve ...`: the same as the `tributary` command."""

import sys

from tributary.app.cli import main

sys.exit(main())
