"""`python -m ultrajax.data prepare|bench`: ultrajax/tools/data.py."""

from ultrajax import cli
from ultrajax.tools.data import main

cli.run(main)
