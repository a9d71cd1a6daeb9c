"""`python -m molt_core ...` is the `molt` command: for a venv that sees molt-core but holds no
`molt` script (one made with --system-site-packages, or on a PYTHONPATH)."""

import sys

from molt_tools.commands import main

sys.exit(main())
