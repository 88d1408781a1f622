import sys

from minillm.entrypoints.cli import main

sys.exit(main())
