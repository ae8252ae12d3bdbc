"""``python -m edgeinfer`` is the ``edgeinfer`` command."""

from edgeinfer.console import main

main()
