from .chat import main

raise SystemExit(main())
