"""`python -m ultrajax.analyze` keeps its name: the command is ultrajax/tools/analyze.py."""

from ultrajax import cli
from ultrajax.tools.analyze import main

if __name__ == "__main__":
    cli.run(main)
