"""`python -m relay.cli`: the `relay` command."""

from relay.cli import main

main()
