"""``python -m ragkv.cli``: the same as the ``ragkv`` command."""

from ragkv.cli import main

main()
