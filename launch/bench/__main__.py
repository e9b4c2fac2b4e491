"""`python -m launch.bench <what>`: see launch/bench/__init__.py."""

import sys

from launch.bench import main

sys.exit(main())
