"""``python -m ps_train.plan``: see ``ps_train.plan.cli``."""

import sys

from ps_train.plan.cli import main

sys.exit(main())
