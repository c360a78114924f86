"""`python -m ultrajax.convert` keeps its name: the command is ultrajax/tools/convert.py."""

from ultrajax import cli
from ultrajax.tools.convert import main

if __name__ == "__main__":
    cli.run(main)
