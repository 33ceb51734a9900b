"""`python -m pt2e_fq ...`: the `pt2e-fq` command."""

import sys

from .cli.command import main

sys.exit(main())
