"""`python -m ultrajax.data prepare|bench`: ultrajax/data/command.py."""

from ultrajax import cli
from ultrajax.data.command import main

cli.run(main)
