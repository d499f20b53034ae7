import sys

from .convert import main

sys.exit(main())
