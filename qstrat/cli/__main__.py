"""``python -m qstrat.cli``: the ``qstrat`` command."""
from qstrat.cli.commands import main

raise SystemExit(main())
