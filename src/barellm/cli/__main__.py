"""`python -m barellm.cli`: the `barellm` command."""

import sys

from barellm.cli import main

sys.exit(main())
