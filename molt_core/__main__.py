"""`python -m molt_core ...` is the `molt` command (for environments without its script on PATH)."""

import sys

from molt_core.cli import main

sys.exit(main())
