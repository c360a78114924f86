"""`python -m ultrajax.plan` keeps its name: the command is ultrajax/tools/plan.py."""

from ultrajax import cli
from ultrajax.tools.plan import main

if __name__ == "__main__":
    cli.run(main)
