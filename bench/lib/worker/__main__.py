import sys

from bench.lib.worker import main

sys.exit(main())
