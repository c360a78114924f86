"""`python -m ultrajax.batchfit` keeps its name: the command is ultrajax/tools/batchfit.py."""

from ultrajax import cli
from ultrajax.tools.batchfit import main

if __name__ == "__main__":
    cli.run(main)
