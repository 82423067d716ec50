import sys

from vlrft.cli import main

sys.exit(main())
