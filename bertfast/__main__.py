import sys

from bertfast.tools.cli import main

sys.exit(main())
