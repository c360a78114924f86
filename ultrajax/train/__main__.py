"""`python -m ultrajax.train`: ultrajax/tools/train.py."""

from ultrajax import cli
from ultrajax.tools.train import main

cli.run(main)
