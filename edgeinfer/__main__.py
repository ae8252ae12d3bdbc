"""``python -m edgeinfer`` is the ``edgeinfer`` command."""

from edgeinfer.cli import main

main(prog_name="edgeinfer")
