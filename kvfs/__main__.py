import sys

from kvfs.cli.main import main

sys.exit(main())
