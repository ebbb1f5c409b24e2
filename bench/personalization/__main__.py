"""`python -m bench.personalization`."""

from bench.personalization.cli import main

main()
