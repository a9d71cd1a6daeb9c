"""`python -m molt_core` is the `molt` command (a venv that sees molt-core without its script)."""
from molt_tools.commands import main

raise SystemExit(main())
