"""`python -m ultrajax.generate` keeps its name: the command is ultrajax/tools/generate.py."""

from ultrajax import cli
from ultrajax.tools.generate import main

if __name__ == "__main__":
    cli.run(main)
