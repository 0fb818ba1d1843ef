from streamkeep.cli import main

raise SystemExit(main())
