"""``python -m quarry`` runs the command line."""

from quarry.cli import main

main()
