"""`python -m capsvc` is the `capsvc` command."""

import sys

from capsvc.cli import main

sys.exit(main())
