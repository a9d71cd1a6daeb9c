"""`python -m molt_tools ...` is the `molt` command (for environments without its script on PATH)."""

import sys

from molt_tools.commands import main

sys.exit(main())
