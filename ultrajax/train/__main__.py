"""`python -m ultrajax.train`: ultrajax/train/command.py."""

from ultrajax import cli
from ultrajax.train.command import main

cli.run(main)
