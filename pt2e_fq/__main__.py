"""`python -m pt2e_fq ...`: the `pt2e-fq` command."""

import sys

from .app.cli import main

sys.exit(main())
