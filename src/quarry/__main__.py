"""``python -m quarry`` runs the command line."""

from quarry._entry import main

main()
