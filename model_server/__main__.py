from model_server.cli import main

raise SystemExit(main())
