import sys

from .learner import main

sys.exit(main())
