"""`python -m cascade_service.cli ...`: the same as the `cascade-service` command."""

import sys

from .main import main

sys.exit(main())
