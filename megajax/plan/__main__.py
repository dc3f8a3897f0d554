"""python -m megajax.plan: the planner's command line (megajax/cli/plan.py)."""

import sys

from megajax.cli.plan import plan_command

sys.exit(plan_command())
