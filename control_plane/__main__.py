from control_plane.cli import main

raise SystemExit(main())
