from understudy.cli import main

raise SystemExit(main())
