from vitflow.cli import main

raise SystemExit(main())
