import sys

from kvoffload.bench.suite import main

sys.exit(main())
