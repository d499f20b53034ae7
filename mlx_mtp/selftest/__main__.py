import sys

from .checks import main

sys.exit(main())
